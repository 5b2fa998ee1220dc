"""``ckptool import`` output loaded into real FSDP2 ``LlamaForCausalLM`` models on gloo ranks.

A tiny Llama is saved with ``save_pretrained`` (tied and untied, bf16 sharded and fp32 one
file), imported for 2 ranks, then loaded on 2 and on 3 ranks three ways: ``dcp.load`` +
``set_model_state_dict``, ``Checkpointer.load_pretrained`` of the checkpoint, and
``Checkpointer.load_pretrained`` of the HF folder itself (imported on the fly). Every
parameter must be ``torch.equal`` to the HF weights (fp32) and the logits equal to
``from_pretrained``'s. On 2 ranks the model is then saved with ``dcp.save`` and its index
compared with the import's: same keys, dtypes, shapes, chunks and files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _dist import run_dist

pytestmark = pytest.mark.dist

IDS = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3]]


def tiny_config(tie: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=67, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                       tie_word_embeddings=tie)


def _fsdp_llama(ws: int, tie: bool):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(1234)  # weights unlike the saved ones
    model = LlamaForCausalLM(tiny_config(tie))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _check(model, ref: dict) -> tuple[list[str], object]:
    """Parameters that differ from ``ref`` (full tensors) and the logits (all ranks run it)."""
    import torch

    bad = [n for n, p in model.state_dict().items()
           if not torch.equal(p.full_tensor(), ref[n])]
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits
    return bad, logits


def _worker(rank: int, ws: int, cases: list[tuple[bool, str, str]], tmp: str,
            save_to: str | None) -> list:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from ckptool.checkpoint import Checkpointer

    out = []
    for i, (tie, hf, ck) in enumerate(cases):
        ref = {}
        for f in sorted(Path(hf).glob("*.safetensors")):
            ref.update({k: v.float() for k, v in load_file(f).items()})
        if tie:
            ref["lm_head.weight"] = ref["model.embed_tokens.weight"]
        results = {}
        model = _fsdp_llama(ws, tie)
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=ck)
        set_model_state_dict(model, state["model"])
        results["dcp.load"] = _check(model, ref)
        if save_to is not None and i == 0:
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=save_to)
        for name, path in (("load_pretrained(ckpt)", ck), ("load_pretrained(hf)", hf)):
            model = _fsdp_llama(ws, tie)
            Checkpointer(f"{tmp}/run").load_pretrained(model, path, tmp_dir=tmp)
            results[name] = _check(model, ref)
        out.append(results)
    return out


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    import torch
    from transformers import LlamaForCausalLM

    from ckptool.ops.import_hf import import_hf

    root = tmp_path_factory.mktemp("imp")
    cases = []
    for tie, dtype, shard in ((True, torch.bfloat16, "12KB"), (False, torch.float32, "5GB")):
        torch.manual_seed(0)
        hf = root / f"hf-{tie}"
        LlamaForCausalLM(tiny_config(tie)).to(dtype).save_pretrained(hf, max_shard_size=shard)
        ck = root / f"ck-{tie}"
        assert import_hf(hf, ck, world_size=2).verified
        with torch.no_grad():
            ref = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32)(torch.tensor(IDS)).logits
        cases.append(((tie, str(hf), str(ck)), ref))
    return root, cases


@pytest.mark.parametrize("ws", [2, 3])
def test_fsdp2_loads_import_exactly(imported, ws, tmp_path):
    import torch

    from ckptool.format.metadata import read_metadata
    from ckptool.storage import Storage

    _, cases = imported
    save_to = str(tmp_path / "fsdp_save") if ws == 2 else None
    results = run_dist(_worker, ws, [c for c, _ in cases], str(tmp_path), save_to, timeout=300)
    for rank, per_case in enumerate(results):
        for (case, ref_logits), routes in zip(cases, per_case):
            assert set(routes) == {"dcp.load", "load_pretrained(ckpt)", "load_pretrained(hf)"}
            for route, (bad, logits) in routes.items():
                assert bad == [], f"rank {rank} {route} tie={case[0]}: {bad}"
                assert torch.equal(logits, ref_logits), f"rank {rank} {route} tie={case[0]}"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("ckptool-pretrained-")]
    if save_to is None:
        return
    ours = read_metadata(Storage.open(cases[0][0][2]))
    theirs = read_metadata(Storage.open(save_to))  # what FSDP2 + dcp.save wrote on 2 ranks
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    assert ours.planner_data == theirs.planner_data
    for fqn, t in theirs.tensors.items():
        o = ours.tensors[fqn]
        assert (o.dtype, o.shape) == (t.dtype, t.shape), fqn
        assert [(c.offsets, c.sizes, c.storage.relative_path) for c in o.chunks] == \
            [(c.offsets, c.sizes, c.storage.relative_path) for c in t.chunks], fqn


def test_train_init_from_checkpoint_and_hf_export(tmp_path):
    """``ckptool train --init-from``: a fresh run starts from another run's weights (its DCP
    ``final_model``, or that exported to safetensors and imported on the fly). Run A moves its
    weights far (lr 3e-2); one AdamW step of the new run (lr 1e-4) moves none of them by more
    than 1e-4, so it must have started from A's final weights, not from the seed's."""
    from ckptool.ops.consolidate import consolidate
    from ckptool.train.config import TrainConfig
    from ckptool.train.launch import launch

    from _dist import load_tensors

    base = {"nproc": 2, "keep": 0, "log_every": 1, "batch_size": 8, "seq_len": 32,
            "warmup_steps": 0}
    launch(TrainConfig(out=str(tmp_path / "a"), steps=4, save_every=1, final_model_only=True,
                       lr=3e-2, **base))
    a = {k: v for k, v in load_tensors(tmp_path / "a/final_model").items() if k.startswith("model.")}
    a1 = load_tensors(tmp_path / "a/step_1")  # about where a fresh run with this seed starts
    assert max((a1[k] - a[k]).abs().max().item() for k in a) > 0.03
    consolidate(tmp_path / "a/final_model", tmp_path / "hf")  # HF-style folder of the weights
    for name, init in (("b", tmp_path / "a/final_model"), ("c", tmp_path / "hf")):
        launch(TrainConfig(out=str(tmp_path / name), steps=1, save_every=1, init_from=str(init),
                           lr=1e-4, **base))
        b = load_tensors(tmp_path / name / "step_1")
        worst = max((b[k] - a[k]).abs().max().item() for k in a)
        assert worst <= 1e-4 * 1.001, f"{name}: {worst}"
