"""``ckptool train --hf-model SRC``: FSDP2 fine-tuning of a transformers causal LM.

Owns turning SRC (a Hugging Face model folder, a Hub repo id ``org/name[@rev]``, or a
``config.json`` alone for a random init) into what the loop trains: the sharded model, its
batches and a ``Checkpointer`` that records the HF config and asset files. The loop itself,
resume and saving are ``loop.py``'s and ``ckptool.checkpoint``'s, unchanged. Resolving SRC to its files
is ``hf_resolve.py``'s; reading the weights into the shards ``hf_weights.py``'s.

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
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptool.errors import ConfigError
from ckptool.train import parallel
from ckptool.train.config import TrainConfig
from ckptool.train.data import TokenBatches, demo_corpus
from ckptool.train.hf_resolve import TOKENIZER_FILES, Source, from_rank0, resolve, this_rank
from ckptool.train.hf_weights import load_weights, model_names, random_init, tied_head
from ckptool.train.torch_private import checkpoint_wrapped, set_buffer

logger = logging.getLogger(__name__)

#: Sequence length when --seq-len is not given: this, or the model's context if shorter.
DEFAULT_SEQ_LEN = 512


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
    step = 1 if mode == "every" else 2
    out = []
    for i, (name, module) in enumerate(layers):
        if i % step == 0:
            module = checkpoint_wrapped(module)
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
        set_buffer(model.get_submodule(owner) if owner else model, attr, value.to(device))
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


def fresh_start(cfg: TrainConfig) -> bool:
    """True when the loop will not resume (so the pretrained weights are needed): rank 0
    looks, as ``loop._resume`` will, and tells the others."""
    if cfg.resume_from is not None:
        return False
    if not cfg.resume:
        return True
    from ckptool.checkpoint import latest_valid

    return bool(from_rank0(latest_valid(cfg.out) is None if this_rank() == 0 else None))


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


__all__ = ["TOKENIZER_FILES", "Source", "build", "count_params", "load_weights", "model_names", "random_init",
           "resolve", "setup", "tied_head"]
