"""DCP's safetensors storage written by 2 FSDP2 ranks (gloo), read by ckptool, loaded back.

Producers, all real: ``dcp.save(..., storage_writer=HuggingFaceStorageWriter(...,
save_distributed=True))`` with and without ``enable_consolidation``, with an
``fqn_to_index_mapping`` (two output files); and torchtitan's own ``CheckpointManager`` with
``last_save_in_hf=True`` on CPU: a DCP ``step-10`` then the final HF ``step-20`` (its
``sharded/`` save plus ``consolidate_safetensors_files_on_every_rank``). Only the optimizer and
LR scheduler containers are stand-ins (empty ``Stateful``s): the final HF save is model-only.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from _dist import run_dist
from ckptool.cli import main

pytestmark = pytest.mark.dist

VARIANTS = ("distributed", "consolidated", "torchtitan")


def _model():
    import torch.nn as nn

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(3, 1))  # 5 rows: ragged; 1: empty shard
    m.register_buffer("scale", torch.linspace(0.5, 2.0, 3))  # replicated: saved once
    return m


def _hf(name: str) -> str:
    return f"model.layers.{name}"


def _fmap(names) -> dict[str, int]:
    return {n: 1 if n.startswith("model.layers.0.") else 2 for n in names}


def _save_all(rank: int, world_size: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

    mesh = init_device_mesh("cpu", (world_size,))
    m = _model()
    fully_shard(m, mesh=mesh)
    sd = {_hf(k): v for k, v in m.state_dict().items()}
    for name, cons in (("distributed", False), ("consolidated", True)):
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(
            f"{root}/{name}", save_distributed=True, enable_consolidation=cons,
            fqn_to_index_mapping=_fmap(sd)))

    class Adapter(BaseStateDictAdapter):
        def __init__(self) -> None:
            self.fqn_to_index_mapping = _fmap(sd)
            self.hf_assets_path = None

        def to_hf(self, state_dict):
            return {_hf(k): v for k, v in state_dict.items()}

        def from_hf(self, hf_state_dict):
            return {k[len("model.layers."):]: v for k, v in hf_state_dict.items()}

        def get_hf_storage_reader(self, path, from_quantized=False):
            raise NotImplementedError

    class Empty:  # stands in for torchtitan's optimizer / LR scheduler containers
        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    cfg = CheckpointManager.Config(enable=True, folder=f"{root}/torchtitan", interval=10,
                                   last_save_in_hf=True, last_save_model_only=True,
                                   export_dtype="float32", keep_latest_k=0)
    cm = CheckpointManager(cfg, dataloader=None, model_parts=[m], optimizers=Empty(),
                           lr_schedulers=Empty(), states={}, sd_adapter=Adapter())
    first = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in sd.items()}
    cm.save(curr_step=10)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(-2.0)  # the last step differs from step 10
    cm.save(curr_step=20, last_step=True)
    cm.close()
    last = {_hf(k): v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
            for k, v in m.state_dict().items()}
    return {"distributed": first, "consolidated": first, "torchtitan": last}


def _load_all(rank: int, world_size: int, folders: dict[str, str]) -> dict[str, dict]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    for variant, folder in folders.items():
        m = _model()
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
        fully_shard(m, mesh=init_device_mesh("cpu", (world_size,)))
        sd = {_hf(k): v for k, v in m.state_dict().items()}
        dcp.load(sd, checkpoint_id=folder)
        out[variant] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
                        for k, v in sd.items()}
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[dict[str, Path], dict[str, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("hfdist")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = run_dist(_save_all, 2, str(root))[0]
    paths = {"distributed": root / "distributed", "consolidated": root / "consolidated",
             "torchtitan": root / "torchtitan"}
    return paths, ref


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_layouts_are_the_producers(saved):
    paths, _ = saved
    files = {v: sorted(str(p.relative_to(paths[v])) for p in paths[v].rglob("*") if p.is_file())
             for v in VARIANTS}
    assert files["distributed"] == [f"shard-0000{r}-model-0000{i}-of-00002.safetensors"
                                    for r in (1, 2) for i in (1, 2)]
    for consolidated in (files["consolidated"], [f[len("step-20/"):] for f in files["torchtitan"]
                                                 if f.startswith("step-20/")]):
        assert consolidated[:3] == ["model-00001-of-00002.safetensors",
                                    "model-00002-of-00002.safetensors",
                                    "model.safetensors.index.json"]
        assert len([f for f in consolidated if f.startswith("sharded/shard-")]) == 4
    assert "step-10/.metadata" in files["torchtitan"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_validate_inspect_consolidate(saved, variant, tmp_path, capsys):
    from safetensors.torch import load_file

    paths, ref = saved
    src = paths[variant]  # for torchtitan: the run folder, whose newest checkpoint is HF
    want = ref[variant]
    code, out, err = _cli(capsys, "validate", "--deep", str(src))
    assert code == 0, err
    assert "carry no checksum" in out and "copy-differs" not in out
    if variant == "torchtitan":
        assert "step-20 is complete" in out
    else:
        assert "world size 2" in out  # the shards say how many ranks wrote them
    code, out, _ = _cli(capsys, "inspect", "--json", str(src))
    summary = json.loads(out)
    assert sorted(k["fqn"] for k in summary["groups"]["model"]) == sorted(want)
    dst = tmp_path / "hf"
    code, _, err = _cli(capsys, "consolidate", str(src), str(dst), "--max-shard-size", "100B")
    assert code == 0, err
    got = {}
    for f in sorted(dst.glob("*.safetensors")):
        got.update(load_file(f))
    assert len(list(dst.glob("*.safetensors"))) > 1 and sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_ls_marks_the_hf_step_latest(saved, capsys):
    paths, _ = saved
    code, out, _ = _cli(capsys, "ls", str(paths["torchtitan"]))
    assert code == 0
    lines = [ln for ln in out.splitlines() if "step-" in ln]
    assert lines[0].split()[:3] == ["step-10", "10", "complete"]
    assert lines[1].split()[:4] == ["*", "step-20", "20", "complete"]


def test_reshard_to_two_then_fsdp2_load(saved, tmp_path, capsys):
    paths, ref = saved
    folders = {}
    for variant in VARIANTS:
        dst = tmp_path / variant
        code, _, err = _cli(capsys, "reshard", str(paths[variant]), str(dst), "--to", "2")
        assert code == 0, err
        folders[variant] = str(dst)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = run_dist(_load_all, 2, folders)
    for variant in VARIANTS:
        for rank in (0, 1):
            got = loaded[rank][variant]
            assert sorted(got) == sorted(ref[variant])
            for k, v in ref[variant].items():
                assert torch.equal(got[k], v), (variant, k)


def test_missing_rank_shard_is_refused(saved, tmp_path, capsys):
    import shutil

    src = shutil.copytree(saved[0]["distributed"], tmp_path / "c")
    (src / "shard-00002-model-00001-of-00002.safetensors").unlink()
    # Rank 1's part of layers.0 is gone; nothing records the shape, so without this check the
    # shards left would read as a whole 3-row tensor (torch's own HF reader does just that).
    code, _, err = _cli(capsys, "validate", str(src))
    assert code == 1 and err.count("\n") == 1
    assert "missing-file" in err and "shard-00002-model-00001-of-00002.safetensors is missing" in err
    code, _, err = _cli(capsys, "consolidate", str(src), str(tmp_path / "o.safetensors"))
    assert code == 1 and "is missing" in err and not (tmp_path / "o.safetensors").exists()
