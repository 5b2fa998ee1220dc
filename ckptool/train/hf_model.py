"""``ckptool train --hf-model SRC``: FSDP2 fine-tuning of a transformers causal LM.

Owns turning SRC (a Hugging Face model folder, a Hub repo id ``org/name[@rev]``, or a
``config.json`` alone for a random init) into what the loop trains: the sharded model, its
batches and a ``Checkpointer`` that records the HF config and asset files. The loop itself,
resume and saving are ``loop.py``'s and ``checkpoint.py``'s, unchanged.

How the model is built (no rank ever holds the full model):

1. ``AutoModelForCausalLM.from_config`` under ``accelerate.init_empty_weights(include_buffers=
   False)``: parameters on the meta device, buffers real (so non-persistent buffers such as
   rotary ``inv_freq`` are computed by the model's own ``__init__``, as ``from_pretrained``
   computes them). Ties (embedding and ``lm_head``: one parameter) come from ``post_init``.
2. Activation checkpointing (``checkpoint_wrapper``) on the decoder layers -- the modules whose
   class is in the model's ``_no_split_modules`` -- then ``fully_shard`` on every layer (the
   last one ``reshard_after_forward=False``) and the root (``parallel.shard_model``).
3. ``to_empty``: each rank allocates its own shards only; the buffers are put back.
4. Weights: every rank reads exactly its ``torch.chunk`` rows of every tensor from the
   safetensors byte ranges (headers bounds-checked by ``format/hf_source.py``), 8 MiB at a
   time, cast to the fp32 master dtype on the way. Peak memory: the shard plus one buffer.
   Without weights (``config.json`` alone) the model's ``_init_weights`` runs on the shards.

Model code in the folder (``auto_map``) runs only with ``--trust-remote-code``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckptool.errors import ConfigError, IncompatibleCheckpointError
from ckptool.format.hf_source import INDEX_NAME, MAX_ASSET_BYTES, HFSource, SourceTensor, open_source
from ckptool.train import parallel
from ckptool.train.config import TrainConfig
from ckptool.train.data import TokenBatches, demo_corpus

logger = logging.getLogger(__name__)

#: Sequence length when --seq-len is not given: this, or the model's context if shorter.
DEFAULT_SEQ_LEN = 512
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "spiece.model", "sentencepiece.bpe.model")
_AC_SEGMENT = "_checkpoint_wrapped_module."
_BLOCK = 8 << 20


@dataclass(frozen=True)
class Source:
    """A resolved ``--hf-model``: where its files are and what travels with the checkpoints.

    Attributes:
        label: what was given (a repo id as ``org/name@sha``).
        config_file: the ``config.json`` to read.
        folder: the local folder holding it (and the tokenizer files), or None for a lone file.
        weights: the checked safetensors index, None for a random init.
        assets: asset file name -> bytes (config, generation config, tokenizer files).
    """

    label: str
    config_file: str
    folder: str | None
    weights: HFSource | None
    assets: dict[str, bytes]

    @property
    def has_tokenizer(self) -> bool:
        return self.folder is not None and any(n in self.assets for n in TOKENIZER_FILES)

    def config_dict(self) -> dict[str, Any]:
        try:
            data = json.loads(self.assets["config.json"])
        except (KeyError, ValueError) as e:
            raise ConfigError(f"--hf-model {self.label}: config.json is missing or not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--hf-model {self.label}: config.json is not a JSON object")
        return data


# ---------------------------------------------------------------------------------------------
# The source


def resolve(src: str) -> Source:
    """Check ``src`` and read its headers and assets (called on every rank; a Hub repo is
    downloaded by rank 0 only, into the shared Hub cache, and the others read that copy).

    Raises:
        ConfigError: nothing at ``src``.
        CheckpointNotFoundError, IncompatibleCheckpointError, CorruptCheckpointError: as
            ``ckptool import`` (pickle weights refused, hostile headers).
        HubError: the download failed.
    """
    from ckptool.ops.import_hf import is_repo_id

    if is_repo_id(src):
        return _from_hub(src)
    p = Path(src).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".json":
            raise ConfigError(f"--hf-model {src}: give a model folder, a Hub repo id or a config.json file")
        return Source(src, str(p), None, None, {"config.json": _small_file(p)})
    if not p.is_dir():
        raise ConfigError(f"--hf-model {src}: no such folder or file, and not a Hub repo id org/name")
    names = {e.name for e in p.iterdir()}
    has_weights = INDEX_NAME in names or any(n.endswith((".safetensors", ".bin", ".pt", ".pth")) for n in names)
    weights = open_source(p) if has_weights else None  # pickles are refused there, never read
    if "config.json" not in names:
        raise ConfigError(f"--hf-model {src} holds no config.json",
                          hint="Give a folder written by save_pretrained (config.json and safetensors)")
    assets = _read_assets(weights.assets) if weights is not None else _folder_assets(p)
    return Source(src, str(p / "config.json"), str(p), weights, assets)


def _from_hub(src: str) -> Source:
    from ckptool.errors import CkptError
    from ckptool.ops.hub_download import download

    repo_id, _, revision = src.partition("@")
    got, problem = None, None
    if _rank() == 0:
        try:
            root, files, sha = download(repo_id, revision or None)
            got = (str(root), files, sha)
        except CkptError as e:
            problem = (type(e), str(e))
    got, problem = _broadcast((got, problem))
    if problem is not None:
        raise problem[0](problem[1])
    root, files, sha = got
    weights = open_source(root, files=files)
    if "config.json" not in weights.assets:
        raise ConfigError(f"--hf-model {src}: the repo holds no config.json")
    return Source(f"{repo_id}@{sha}", weights.assets["config.json"], root, weights, _read_assets(weights.assets))


def _small_file(p: Path) -> bytes:
    if p.stat().st_size > MAX_ASSET_BYTES:
        raise ConfigError(f"--hf-model {p} is {p.stat().st_size} bytes, too large for a config file")
    return p.read_bytes()


def _read_assets(paths: dict[str, str]) -> dict[str, bytes]:
    return {name: _small_file(Path(path)) for name, path in sorted(paths.items())}


def _folder_assets(p: Path) -> dict[str, bytes]:
    from ckptool.ops.hf_assets import _from_folder  # the --hf-assets reader: allow-list, no links out

    return _from_folder(p)


# ---------------------------------------------------------------------------------------------
# The model


def load_config(source: Source, *, trust_remote_code: bool = False) -> Any:
    """The model's ``PretrainedConfig``; model code in the folder runs only when trusted."""
    from transformers import AutoConfig

    where = source.folder if source.folder is not None else source.config_file
    try:
        return AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError) as e:
        raise _config_error(source, e) from None


def _config_error(source: Source, e: BaseException) -> ConfigError:
    text = " ".join(str(e).split())
    if "trust_remote_code" in text:
        return ConfigError(f"--hf-model {source.label} needs its own model code (auto_map in config.json), "
                           "which runs only when you trust it",
                           hint="Read the folder's .py files, then pass --trust-remote-code")
    return ConfigError(f"--hf-model {source.label}: transformers cannot build a causal LM from it: {text[:300]}")


def context_length(config: Any) -> int | None:
    """The model's longest sequence (``max_position_embeddings`` / ``n_positions``), if it says."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocab_size(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def empty_model(config: Any, *, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM of ``config`` with every parameter on the meta device and real buffers
    (fp32; ``use_cache`` off for training). Nothing the size of a weight is allocated."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                     trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise _config_error(Source(str(getattr(config, "_name_or_path", "")) or "SRC", "", None, None, {}),
                            e) from None
    model.tie_weights()
    model.config.use_cache = False
    return model


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the repeating blocks: the outermost modules whose class is named in
    ``model._no_split_modules``; failing that, the longest ``ModuleList`` of one class.

    Raises:
        ConfigError: neither is found (FSDP would gather the whole model at once).
    """
    classes = set(getattr(model, "_no_split_modules", None) or [])
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__ in classes and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, module))
    if not found:
        lists = [(n, m) for n, m in model.named_modules()
                 if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1]
        if lists:
            name, longest = max(lists, key=lambda x: len(x[1]))
            found = [(f"{name}.{i}" if name else str(i), c) for i, c in enumerate(longest)]
    if not found:
        raise ConfigError(f"cannot find the decoder layers of {type(model).__name__} (no _no_split_modules, "
                          "no list of blocks): sharding only the root would gather every weight at once")
    return found


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def apply_activation_checkpointing(model: nn.Module, layers: list[tuple[str, nn.Module]],
                                   mode: str) -> list[nn.Module]:
    """``checkpoint_wrapper`` (non-reentrant) on every / every second layer, before sharding;
    the layers as they now sit in the model. ``state_dict()`` keys do not change."""
    if mode == "none":
        return [m for _, m in layers]
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    step = 1 if mode == "every" else 2
    out = []
    for i, (name, module) in enumerate(layers):
        if i % step == 0:
            module = checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            _replace(model, name, module)
        out.append(module)
    return out


def _logits(_module: nn.Module, _args: Any, output: Any) -> Any:
    # The loop computes the loss from logits; an HF model returns a ModelOutput.
    return getattr(output, "logits", output)


def build(config: Any, cfg: TrainConfig, mesh: Any, device: torch.device, precision: str) -> nn.Module:
    """The sharded model, materialized (weights uninitialized, buffers set), returning logits
    from ``forward`` (called on all ranks)."""
    model = empty_model(config, trust_remote_code=cfg.trust_remote_code)
    layers = apply_activation_checkpointing(model, decoder_layers(model), cfg.activation_checkpointing)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    parallel.shard_model(model, mesh, sharding=cfg.sharding, precision=precision, cpu_offload=cfg.cpu_offload,
                         blocks=layers)
    parallel.check_wrapping(model, blocks=layers)
    # Shards only; with CPU offload FSDP2 keeps them in host memory.
    model.to_empty(device="cpu" if cfg.cpu_offload else device)
    for name, value in buffers.items():
        owner, _, attr = name.rpartition(".")
        (model.get_submodule(owner) if owner else model)._buffers[attr] = value.to(device)
    _check_ties(model, config)
    model.register_forward_hook(_logits)
    return model


def _check_ties(model: nn.Module, config: Any) -> None:
    if not getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                   "tie_word_embeddings", False):
        return
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is not None and inp is not None and out.weight is not inp.weight:
        raise ConfigError(f"{type(model).__name__}: the config ties lm_head to the input embedding but "
                          "the sharded model holds two tensors")


def count_params(config: Any, *, trust_remote_code: bool = False) -> int:
    """Parameters of the model ``config`` describes (a tied embedding once), built on meta."""
    model = empty_model(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters())


def param_count(src: str, *, trust_remote_code: bool = False) -> int:
    """Parameters of ``--hf-model SRC`` from its config alone (built on meta; no weight read,
    only ``config.json`` fetched for a Hub repo id)."""
    from ckptool.errors import HubError
    from ckptool.ops.import_hf import is_repo_id

    if is_repo_id(src):
        from huggingface_hub import hf_hub_download

        repo_id, _, revision = src.partition("@")
        try:
            path = Path(hf_hub_download(repo_id, "config.json", revision=revision or None))
        except Exception as e:  # noqa: BLE001 - any Hub failure is one line for the user
            raise HubError(f"--hf-model {src}: cannot fetch config.json: {' '.join(str(e).split())[:200]}") from None
        folder = str(path.parent)
    else:
        p = Path(src).expanduser()
        path, folder = (p / "config.json", str(p)) if p.is_dir() else (p, None)
        if not path.is_file():
            raise ConfigError(f"--hf-model {src}: no config.json there, and not a Hub repo id org/name")
    config = load_config(Source(src, str(path), folder, None, {}), trust_remote_code=trust_remote_code)
    return count_params(config, trust_remote_code=trust_remote_code)


# ---------------------------------------------------------------------------------------------
# Weights


def model_names(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own names (wrapper segments dropped) of every parameter (a tied one once,
    under its first name) and persistent buffer."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name.replace(_AC_SEGMENT, "")] = p
    for mod_name, module in model.named_modules():
        for b_name, b in module._buffers.items():
            if b is not None and b_name not in module._non_persistent_buffers_set:
                out[f"{mod_name}.{b_name}".lstrip(".").replace(_AC_SEGMENT, "")] = b
    return out


def _local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of ``t`` and the global index of its first row (dim-0 shards only)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.data, 0
    if any(not (p.is_replicate() or (p.is_shard() and p.dim == 0)) for p in t.placements):
        raise ConfigError(f"placements {t.placements} are not dim-0 shards; cannot read rows directly")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), (offset[0] if offset else 0)


@torch.no_grad()
def load_weights(model: nn.Module, weights: HFSource, *, tied_head: str | None = None) -> int:
    """Copy this rank's rows of every tensor from the safetensors files (all ranks, no
    collective). Returns the bytes read by this rank.

    Raises:
        IncompatibleCheckpointError: a tensor the model has is missing, or its shape or dtype
            kind differs.
    """
    names = model_names(model)
    missing = [n for n in names if n not in weights.tensors and n != tied_head]
    if missing:
        raise IncompatibleCheckpointError(
            f"{weights.root} lacks {len(missing)} tensor(s) of {type(model).__name__}: {', '.join(missing[:5])}",
            path=weights.root, hint="Give the folder save_pretrained wrote for this architecture")
    done = 0
    for name, target in names.items():
        st = weights.tensors.get(name)
        if st is None:
            continue  # the tied head: it is the embedding's parameter
        if tuple(st.shape) != tuple(target.shape) or st.dtype.is_floating != target.dtype.is_floating_point:
            raise IncompatibleCheckpointError(
                f"{weights.root}: {name} is {st.dtype} {list(st.shape)}, the model's is "
                f"{str(target.dtype).removeprefix('torch.')} {list(target.shape)}", path=weights.root)
        local, row0 = _local_rows(target)
        done += _read_rows(st, row0, local)
    return done


def _read_rows(st: SourceTensor, row0: int, local: torch.Tensor) -> int:
    """Rows ``row0 ..`` of ``st`` into ``local`` (a contiguous row block), in 8 MiB reads."""
    if local.numel() == 0:
        return 0
    if not local.is_contiguous():
        raise ConfigError(f"{st.name}: the local shard is not contiguous")
    row_bytes = st.nbytes // st.shape[0] if st.shape else st.nbytes
    start = st.offset + row0 * row_bytes
    src_dtype = getattr(torch, st.dtype.name)
    flat = local.view(-1)
    raw = torch.empty(_BLOCK, dtype=torch.uint8)
    view = memoryview(raw.numpy())
    total = flat.numel() * st.dtype.itemsize
    fd = os.open(st.path, os.O_RDONLY)
    try:
        done = 0
        while done < total:
            want = min(_BLOCK, total - done)
            got = 0
            while got < want:
                n = os.preadv(fd, [view[got:want]], start + done + got)
                if n <= 0:
                    raise IncompatibleCheckpointError(f"{st.path} ended while reading {st.name} (changed meanwhile?)",
                                                      path=st.path)
                got += n
            items = want // st.dtype.itemsize
            first = done // st.dtype.itemsize
            flat[first:first + items].copy_(raw[:want].view(src_dtype))
            done += want
    finally:
        os.close(fd)
    return total


def tied_head(config: Any, model: nn.Module) -> str | None:
    """The name of the output embedding when it is tied to the input one (files store it once)."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or out.weight is not inp.weight:
        return None
    for name, module in model.named_modules():
        if module is out:
            return f"{name}.weight".replace(_AC_SEGMENT, "")
    return None


@torch.no_grad()
def random_init(model: nn.Module, seed: int) -> None:
    """The model's own ``_init_weights`` on every module, shard by shard.

    On CPU meshes DTensor random ops draw from each rank's generator: seeded here by the shard
    coordinate so that shards differ (identical rows would never learn apart) while
    replicas (HSDP) stay equal."""
    mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
    shard = mesh.get_local_rank(mesh.ndim - 1) if mesh is not None else 0
    torch.manual_seed(seed * 1_000_003 + shard)
    init = getattr(model, "_init_weights", None)
    for module in model.modules():
        if init is not None:
            init(module)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Data


def batches(cfg: TrainConfig, source: Source, vocab: int, rank: int, ws: int) -> TokenBatches:
    """``--data FILE`` (or the built-in corpus) tokenized by the model's own tokenizer when it
    has one, else its bytes mapped into the vocabulary; the loader's global-batch contract
    (and so exact resume at any rank count) is unchanged."""
    if cfg.data:
        with open(cfg.data, "rb") as f:
            raw = f.read()
        name = f"file:{os.path.basename(cfg.data)}:{len(raw)}"
    else:
        raw, name = demo_corpus(), "demo-corpus"
    if source.has_tokenizer:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(source.folder, trust_remote_code=cfg.trust_remote_code)
        except (ValueError, OSError) as e:
            raise _config_error(source, e) from None
        ids = tok(raw.decode("utf-8", errors="replace"), add_special_tokens=False, verbose=False)["input_ids"]
        tokens = torch.tensor(ids, dtype=torch.long)
        if tokens.numel() and int(tokens.max()) >= vocab:
            raise ConfigError(f"--hf-model {source.label}: the tokenizer yields id {int(tokens.max())}, "
                              f"beyond the model's vocab_size {vocab}")
        name += f":tokenizer:{type(tok).__name__}:{len(tok)}"
    else:
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long() % vocab if raw else torch.zeros(0)
        name += f":bytes-mod-{vocab}"
    return TokenBatches(tokens, name=name, seq_len=cfg.effective_seq_len(), global_batch=cfg.batch_size,
                        seed=cfg.seed, rank=rank, world_size=ws)


# ---------------------------------------------------------------------------------------------
# The run


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def fresh_start(cfg: TrainConfig) -> bool:
    """True when the loop will not resume (so the pretrained weights are needed): rank 0
    looks, as ``loop._resume`` will, and tells the others."""
    if cfg.resume_from is not None:
        return False
    if not cfg.resume:
        return True
    from ckptool.checkpoint import latest_valid

    return bool(_broadcast(latest_valid(cfg.out) is None if _rank() == 0 else None))


def setup(cfg: TrainConfig, rank: int, ws: int, device: torch.device, precision: str) -> Any:
    """Model, optimizer, data and checkpointer of an ``--hf-model`` run (all ranks); the
    ``loop._Run`` that ``loop.train`` steps, resumes and saves as for the built-in model."""
    from ckptool.checkpoint import Checkpointer
    from ckptool.train import loop

    source = resolve(cfg.hf_model)
    config = load_config(source, trust_remote_code=cfg.trust_remote_code)
    ctx = context_length(config)
    seq_len = cfg.seq_len if cfg.seq_len is not None else min(DEFAULT_SEQ_LEN, ctx or DEFAULT_SEQ_LEN)
    if ctx is not None and seq_len > ctx:
        raise ConfigError(f"--seq-len {seq_len} exceeds the context of --hf-model {source.label} ({ctx})",
                          hint=f"Pass --seq-len {ctx} or less")
    cfg = dataclasses.replace(cfg, seq_len=seq_len)
    mesh = parallel.build_mesh(cfg.sharding, ws, device.type, shard_size=cfg.hybrid_shard_size)
    torch.manual_seed(cfg.seed)
    model = build(config, cfg, mesh, device, precision)
    parallel.quiet_mesh_pickling()  # async saves send the mesh to DCP's background process
    if fresh_start(cfg) and cfg.init_from is None:  # else loop loads a checkpoint or --init-from
        if source.weights is not None:
            load_weights(model, source.weights, tied_head=tied_head(config, model))
        else:
            random_init(model, cfg.seed)
    torch.manual_seed(cfg.seed)
    optimizer, scheduler = loop.optimizer_for(cfg, model)
    manifest_cfg = {**cfg.to_dict(), "precision": precision,
                    "hf_model": {"source": source.label, "class": type(model).__name__,
                                 "weights": source.weights is not None}}
    ckpt = Checkpointer(cfg.out, keep=cfg.keep, async_save=cfg.async_save, config=manifest_cfg,
                        hf_config=source.config_dict(), hf_assets=source.assets)
    data = batches(cfg, source, vocab_size(config), rank, ws)
    return loop._Run(cfg, model, optimizer, scheduler, data, loop.TrainState(), ckpt, device, precision)


__all__ = ["Source", "build", "count_params", "load_weights", "resolve", "setup"]
