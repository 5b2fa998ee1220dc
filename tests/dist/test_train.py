"""``ckptool train`` end to end on gloo: saves, resume equivalence, resharding, async, retention,
strategies, the wrap check, rank death. Real processes, real FSDP2 and DCP; tiny model.

Runs are grouped so the whole file stays well under two minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _dist import load_tensors, run_dist
from ckptool.format.manifest import read_manifest
from ckptool.storage import Storage
from ckptool.train.config import TrainConfig
from ckptool.train.launch import RankFailedError, launch

pytestmark = pytest.mark.dist

FULL_PARAM_BYTES = 234048 * 4  # tiny model, fp32


def _cfg(out: Path, **kw) -> TrainConfig:
    base = {"out": str(out), "nproc": 2, "steps": 8, "save_every": 4, "keep": 0, "log_every": 4,
            "lr_decay_steps": 8, "batch_size": 8, "seq_len": 32}
    return TrainConfig(**{**base, **kw})


def _model(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if k.startswith("model.")}


def test_save_resume_bitwise_and_reshard_2_1_2(tmp_path):
    # A: 8 steps straight on 2 ranks, checkpoints at 4 and 8.
    a = launch(_cfg(tmp_path / "a"))
    assert a.checkpoints == ["step_4", "step_8"] and len(a.losses) == 8
    assert a.losses[-1] < a.losses[0]
    a8 = load_tensors(tmp_path / "a/step_8")
    assert any(k.startswith("optim.state.") for k in a8) and "model.blocks.0.attn.qkv.weight" in a8
    assert a8["model.tok_emb.weight"].shape == (256, 64)
    m = read_manifest(Storage.open(tmp_path / "a/step_8"))
    assert (m.step, m.world_size, m.loss) == (8, 2, a.losses[-1])
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(m.files)

    # B: the run "dies" after step 4. Its folder holds the good step_4, a torn step_6 and a
    # committed-but-truncated step_7; a plain resume must pick step_4 and match A bitwise.
    shutil.copytree(tmp_path / "a/step_4", tmp_path / "b/step_4")
    (tmp_path / "b/step_6").mkdir()
    (tmp_path / "b/step_6/__0_0.distcp").write_bytes(b"torn")
    shutil.copytree(tmp_path / "a/step_4", tmp_path / "b/step_7")
    with open(tmp_path / "b/step_7/__1_0.distcp", "r+b") as f:
        f.truncate(100)
    b = launch(_cfg(tmp_path / "b"))
    assert b.resumed_from.endswith("step_4") and b.start_step == 4
    assert b.losses == a.losses[4:]
    b8 = load_tensors(tmp_path / "b/step_8")
    assert a8.keys() == b8.keys()
    assert all(torch.equal(a8[k], b8[k]) for k in a8)  # model AND optimizer state
    assert not (tmp_path / "b/step_6").exists()  # torn and older than the newest good one

    # C: 2 -> 1 rank from A's step_4 (load-time resharding), saving at 6 and 8.
    c = launch(_cfg(tmp_path / "c", nproc=1, save_every=2, resume_from=str(tmp_path / "a/step_4")))
    torch.testing.assert_close(torch.tensor(c.losses), torch.tensor(a.losses[4:]), rtol=1e-3, atol=0)
    c8 = _model(load_tensors(tmp_path / "c/step_8"))
    for k, v in c8.items():
        torch.testing.assert_close(v, a8[k], rtol=1e-3, atol=1e-5)
    assert c.state_bytes == [{"params": FULL_PARAM_BYTES, "grads": FULL_PARAM_BYTES,
                              "optim": 2 * FULL_PARAM_BYTES + 28 * 4}]

    # D: 1 -> 2 ranks from C's step_6.
    d = launch(_cfg(tmp_path / "d", resume_from=str(tmp_path / "c/step_6")))
    torch.testing.assert_close(torch.tensor(d.losses), torch.tensor(a.losses[6:]), rtol=1e-3, atol=0)
    d8 = _model(load_tensors(tmp_path / "d/step_8"))
    for k, v in d8.items():
        torch.testing.assert_close(v, a8[k], rtol=1e-3, atol=1e-5)
    assert [s["params"] for s in d.state_bytes] == [FULL_PARAM_BYTES // 2] * 2  # 1/N sharding


def test_async_save_matches_sync_and_retention_keeps_two(tmp_path):
    # Through the CLI (--config, --json): same run saved synchronously and asynchronously.
    (tmp_path / "c.yaml").write_text("steps: 6\nsave-every: 2\nkeep: 2\nbatch-size: 8\nseq-len: 32\nnproc: 2\n")
    for name in ("sync", "async"):
        run = tmp_path / name
        (run / "step_1").mkdir(parents=True)  # torn, older than any good one: removed
        (run / "step_99").mkdir()  # torn, newer than the newest good one: may be in flight, kept
        cmd = [sys.executable, "-c", "from ckptool.cli import main; main()", "train", "--out", str(run),
               "--config", str(tmp_path / "c.yaml"), "--json"] + (["--async-save"] if name == "async" else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
        assert "root - INFO" not in proc.stderr  # DCP's async-save process chatter is filtered
        summary = json.loads(proc.stdout)
        assert summary["checkpoints"] == ["step_4", "step_6"] and summary["saves"] == 3
        assert sorted(os.listdir(run)) == ["step_4", "step_6", "step_99"]
        assert read_manifest(Storage.open(run / "step_6")).step == 6
    sync, asy = load_tensors(tmp_path / "sync/step_6"), load_tensors(tmp_path / "async/step_6")
    assert sync.keys() == asy.keys() and len(sync) > 50
    assert all(torch.equal(sync[k], asy[k]) for k in sync)


def _variants_worker(rank: int, world_size: int, out: str, variants: list) -> list:
    from ckptool.errors import ConfigError
    from ckptool.train import parallel
    from ckptool.train.loop import train
    from ckptool.train.model import GPT, PRESETS

    results = []
    for i, v in enumerate(variants):
        cfg = TrainConfig(out=f"{out}/{i}", steps=6, save_every=6, log_every=6, batch_size=8, seq_len=32, **v)
        r = train(cfg)
        if rank == 0:
            results.append((v, r.losses, r.state_bytes))
    # The seed's failure modes, caught at start-up.
    model = GPT(PRESETS["tiny"])
    mesh = parallel.build_mesh("full", world_size, "cpu")
    parallel.shard_model(model, mesh, wrap_blocks=False)
    errors = []
    try:
        parallel.check_wrapping(model)
    except ConfigError as e:
        errors.append(str(e))
    model = GPT(PRESETS["tiny"]).to(torch.bfloat16)  # bf16 masters: mixed precision misconfigured
    parallel.shard_model(model, mesh, precision="bf16")
    try:
        parallel.check_wrapping(model)
    except ConfigError as e:
        errors.append(str(e))
    return [results, errors]


def test_strategies_and_activation_checkpointing_train(tmp_path):
    text = tmp_path / "text.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    variants = [
        {"sharding": "grad-op", "activation_checkpointing": "every"},
        {"sharding": "none", "activation_checkpointing": "every-2"},
        {"sharding": "hybrid", "mixed_precision": "bf16"},
        {"sharding": "full", "cpu_offload": True},
        {"sharding": "full", "data": str(text), "grad_accum": 2, "final_model_only": True},
    ]
    results, errors = run_dist(_variants_worker, 2, str(tmp_path), variants)[0]
    assert len(results) == len(variants)
    for variant, losses, sizes in results:
        assert all(torch.isfinite(torch.tensor(losses))), variant
        assert losses[-1] < losses[0] - 0.5, (variant, losses)
        # NO_SHARD replicates the parameters; every other strategy holds half on each rank.
        per_rank = FULL_PARAM_BYTES if variant["sharding"] == "none" else FULL_PARAM_BYTES // 2
        assert [s["params"] for s in sizes] == [per_rank] * 2, variant
        assert [s["grads"] for s in sizes] == [per_rank] * 2, variant
    assert errors[0].startswith("no transformer block is its own FSDP unit (0 of 4)")
    assert "expected torch.float32 master weights" in errors[1]
    # Every variant's checkpoint loads: the AC wrapper does not leak into the keys.
    keys = {k for k in load_tensors(tmp_path / "0/step_6") if k.startswith("model.")}
    assert keys == {k for k in load_tensors(tmp_path / "3/step_6") if k.startswith("model.")}
    assert "model.blocks.0.attn.qkv.weight" in keys
    final = load_tensors(tmp_path / "4/final_model")  # --final-model-only: weights, no optimizer
    assert set(final) == keys
    assert torch.equal(final["model.head.weight"], load_tensors(tmp_path / "4/step_6")["model.head.weight"])


def test_dead_rank_is_named_and_nothing_is_left_running(tmp_path, monkeypatch):
    import multiprocessing

    monkeypatch.setenv("CKPTOOL_TEST_KILL", "1:3")
    with pytest.raises(RankFailedError) as e:
        launch(_cfg(tmp_path / "k", steps=20))
    assert e.value.rank == 1 and e.value.exit_code == -9
    assert str(e.value).startswith("rank 1 was killed by SIGKILL")
    assert multiprocessing.active_children() == []


def test_cli_output_in_a_pipe_is_ours_only_and_scaling_uses_the_same_steps(tmp_path):
    # Issue 14: an async save of a 2-D (hybrid) mesh logged torch's DeviceMesh PG-lookup warning
    # from every rank's background process; the 1-rank baseline of --scaling-check ran at most
    # 12 steps (11.6x "speedup" at --steps 10). Run from tmp_path so paths print short.
    cmd = [sys.executable, "-m", "ckptool", "train", "--out", "run", "--nproc", "2", "--sharding", "hybrid",
           "--async-save", "--steps", "6", "--save-every", "2", "--log-every", "2", "--batch-size", "8",
           "--seq-len", "32", "--scaling-check"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ours = re.compile(r"(training \d[\d,]* parameters on 2 ranks: .*|fresh start: steps 1\.\.6"
                      r"|saving run/step_[246] \(training blocked \d+\.\d\d s\)"
                      r"|step [246]/6  loss \d\.\d{4}  [\d,]+ tok/s  \d+ ms/step)")
    foreign = [ln for ln in proc.stderr.splitlines() if not ours.fullmatch(ln)]
    assert foreign == [], proc.stderr  # no DeviceMesh warnings, no DCP daemon chatter
    lines = proc.stdout.splitlines()
    assert all(len(ln) <= 80 for ln in proc.stderr.splitlines() + lines), proc.stdout
    scaling = [ln for ln in lines if ln.startswith("scaling: ")]
    assert len(scaling) == 1, proc.stdout
    assert re.fullmatch(r"scaling: \d+\.\d\dx on 2 ranks, \d+% efficiency \(same batch, 5 timed steps\)",
                        scaling[0]), scaling
