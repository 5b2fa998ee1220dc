"""Other producers' FSDP2 checkpoints, written by the producers themselves on 2 gloo ranks.

* Hugging Face ``LlamaForCausalLM`` (tied and untied embeddings) sharded with ``fully_shard``
  per decoder layer, saved three ways: model-only (``get_model_state_dict``),
  ``{"model", "optim"}`` (``get_state_dict``) and the PyTorch DCP recipe
  ``{"app": AppState(model, optimizer)}``;
* DDP (``module.`` names);
* torchtitan's own ``CheckpointManager`` (full checkpoint: model flattened to the top level
  beside ``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state``; and its model-only
  last-step save).

For each: ``validate --deep`` passes, ``inspect`` groups are right, ``consolidate`` names are
the model's own ``state_dict()`` names with every tensor ``torch.equal`` to the gathered
reference, HF exports load with ``from_pretrained`` (no missing or unexpected key), and
``reshard --to 3`` loads back exactly with ``dcp.load``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from _dist import load_tensors, run_dist  # noqa: E402
from ckptool.cli import cli  # noqa: E402
from ckptool.ops.consolidate import consolidate  # noqa: E402
from ckptool.ops.inspect import inspect  # noqa: E402
from ckptool.ops.reshard import reshard  # noqa: E402

HF_KINDS = ("model_only", "model_optim", "appstate")


def _llama_config(tie: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                       tie_word_embeddings=tie)


class AppState:
    """The Stateful of the PyTorch DCP recipe, as users copy it."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):  # pragma: no cover - not loaded here
        raise NotImplementedError


def _full_model_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _hf_worker(rank: int, world_size: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaForCausalLM

    mesh = init_device_mesh("cpu", (world_size,))
    for tie in (True, False):
        torch.manual_seed(10 + tie)
        model = LlamaForCausalLM(_llama_config(tie))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
        model(ids).logits.pow(2).mean().backward()
        opt.step()
        out = Path(root) / ("tied" if tie else "untied")
        msd, osd = get_state_dict(model, opt)
        dcp.save(get_model_state_dict(model), checkpoint_id=str(out / "model_only"))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / "model_optim"))
        dcp.save({"app": AppState(model, opt)}, checkpoint_id=str(out / "appstate"))
        full = _full_model_state(model)
        if rank == 0:
            torch.save(full, out / "reference.pt")
            model.config.save_pretrained(out / "config")
        dist.barrier()
    # DDP: every name gains a leading "module."
    torch.manual_seed(5)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)))
    dcp.save({"model": ddp.state_dict()}, checkpoint_id=str(Path(root) / "ddp"))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in ddp.module.state_dict().items()},
                   Path(root) / "ddp_reference.pt")


@pytest.fixture(scope="module")
def hf_ckpts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("producers_hf")
    run_dist(_hf_worker, 2, str(root), timeout=300)
    return root


def _export(ckpt: Path, out: Path, **kw) -> dict:
    consolidate(ckpt, out, **kw)
    got = {}
    for f in (sorted(out.glob("*.safetensors")) if out.is_dir() else [out]):
        got.update(load_file(f))
    return got


def _assert_exact(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _deep_valid(path: Path) -> None:
    r = CliRunner().invoke(cli, ["validate", str(path), "--deep"])
    assert r.exit_code == 0, r.output


def _reshard_loads_back(src: Path, dst: Path) -> None:
    reshard(src, dst, world_size=3)
    _deep_valid(dst)
    before, after = load_tensors(src), load_tensors(dst)
    assert sorted(before) == sorted(after)
    for k in before:
        assert torch.equal(before[k], after[k]), k


@pytest.mark.parametrize("tie", ["tied", "untied"])
@pytest.mark.parametrize("kind", HF_KINDS)
def test_hf_llama_fsdp2(hf_ckpts, tie, kind, tmp_path):
    from transformers import LlamaForCausalLM

    ckpt = hf_ckpts / tie / kind
    ref = torch.load(hf_ckpts / tie / "reference.pt")
    _deep_valid(ckpt)
    s = inspect(ckpt)
    prefix = {"model_only": "", "model_optim": "model.", "appstate": "app.model."}[kind]
    assert {k.fqn for k in s.groups["model"]} == {prefix + k for k in ref}
    assert bool(s.groups["optimizer"]) == (kind != "model_only")
    assert not s.groups["other"]
    out = tmp_path / "hf"
    _assert_exact(_export(ckpt, out), ref)
    for f in (hf_ckpts / tie / "config").iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    loaded, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == (tie == "tied")
    if kind != "model_optim":  # one reshard per layout is enough (same byte path)
        _reshard_loads_back(ckpt, tmp_path / "resharded")


def test_ddp_module_prefix_is_dropped(hf_ckpts, tmp_path):
    ref = torch.load(hf_ckpts / "ddp_reference.pt")
    _deep_valid(hf_ckpts / "ddp")
    _assert_exact(_export(hf_ckpts / "ddp", tmp_path / "o.safetensors"), ref)
    kept = _export(hf_ckpts / "ddp", tmp_path / "k.safetensors", keep_wrappers=True)
    assert sorted(kept) == sorted(f"module.{k}" for k in ref)


# ---------------------------------------------------------------------------------------------
# torchtitan's own CheckpointManager


class _TrainState:
    """What torchtitan's trainer saves as ``train_state`` (step, tokens seen)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": 1000 * self.step}

    def load_state_dict(self, sd):  # pragma: no cover
        self.step = sd["step"]


class _Loader:
    """torchtitan's ParallelAwareDataloader saves pickled bytes per data-parallel rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self):
        return {f"dp_rank_{self.rank}": io.BytesIO(b"position 7").getvalue(), "world_size": 2}

    def load_state_dict(self, sd):  # pragma: no cover
        pass


def _titan_worker(rank: int, world_size: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, default_adamw

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Embedding(13, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 13, bias=False))
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    ocfg = default_adamw(lr=1e-2)
    ocfg.implementation = "for-loop"
    opts = OptimizersContainer(ocfg, model_parts=[model])
    scheds = LRSchedulersContainer(opts, lambda step: 1.0)
    mgr = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0,
                                 last_save_model_only=True),
        dataloader=_Loader(rank), model_parts=[model], optimizers=opts, lr_schedulers=scheds,
        states={"train_state": _TrainState(1)}, sd_adapter=None, base_folder=root)
    for step in (1, 2):
        model(torch.randint(0, 13, (2, 5))).pow(2).mean().backward()
        opts.step()
        scheds.step()
        opts.zero_grad()
        mgr.save(curr_step=step, last_step=step == 2)
    full = _full_model_state(model)
    if rank == 0:
        torch.save(full, Path(root) / "reference.pt")
    dist.barrier()
    mgr.close()


@pytest.fixture(scope="module")
def titan_run(tmp_path_factory) -> Path:
    pytest.importorskip("torchtitan")
    root = tmp_path_factory.mktemp("producers_titan")
    run_dist(_titan_worker, 2, str(root), timeout=300)
    return root


def test_torchtitan_full_checkpoint(titan_run, tmp_path):
    ckpt = titan_run / "checkpoint" / "step-1"
    _deep_valid(ckpt)
    s = inspect(ckpt)
    model = {k.fqn for k in s.groups["model"]}
    assert model == {"0.weight", "1.weight", "1.bias", "2.weight"}
    assert s.groups["optimizer"] and all(k.fqn.startswith("optimizer.") for k in s.groups["optimizer"])
    other = {k.fqn.split(".")[0] for k in s.groups["other"]}
    assert other == {"lr_scheduler", "dataloader", "train_state"}
    got = _export(ckpt, tmp_path / "o.safetensors")
    assert sorted(got) == sorted(model)
    _reshard_loads_back(ckpt, tmp_path / "resharded")


def test_torchtitan_last_step_model_only_is_latest_and_exact(titan_run, tmp_path):
    run = titan_run / "checkpoint"
    ref = torch.load(titan_run / "reference.pt")
    r = CliRunner().invoke(cli, ["ls", str(run), "--json"])
    assert r.exit_code == 0, r.output
    latest = [e for e in json.loads(r.output) if e["latest_good"]]
    assert [e["name"] for e in latest] == ["step-2"]
    _assert_exact(_export(run, tmp_path / "o.safetensors"), ref)  # the run folder = step-2
    s = inspect(run / "step-2")
    assert not s.groups["optimizer"] and not s.groups["other"]
