"""``ckptool train`` before any rank starts (issue 14): errors that the options and the run
folder can tell are found in the launcher, without torch, one line naming the option, exit 2
for usage errors and 1 for a checkpoint of another model; what changes on resume is said.

Checkpoints here are real one-rank ``dcp.save`` folders with a real ``ckptool.json``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptool.errors import ConfigError
from ckptool.format import manifest as mf
from ckptool.storage import Storage
from ckptool.train.config import TrainConfig
from ckptool.train.preflight import Resume, model_mismatch, resume_notices

ROOT = Path(__file__).resolve().parents[2]


def _saved_run(tmp_path: Path, single_ckpt: Path, **overrides) -> Path:
    """``run/step_4``: a committed checkpoint whose manifest records a ``ckptool train`` config."""
    run = tmp_path / "run"
    shutil.copytree(single_ckpt, run / "step_4")
    cfg = TrainConfig(out=str(run), steps=8, **overrides)
    config = {**cfg.to_dict(), "model_config": cfg.model_config().to_dict(), "precision": "fp32"}
    storage = Storage.open(run / "step_4")
    mf.write_manifest(storage, mf.build_manifest(storage, step=4, world_size=2, config=config))
    return run


def _train(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``ckptool train ARGS`` in a fresh interpreter that fails if anything imported torch."""
    code = ("import sys; from ckptool.cli import main\n"
            "try:\n    main(['train', *sys.argv[1:]])\n"
            "finally:\n    assert 'torch' not in sys.modules, 'torch was imported'\n")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.lower().startswith("error:")]


# -- item 4: found before the ranks, one line naming the option, usage errors exit 2 ---------
def test_no_resume_on_a_used_folder_is_a_usage_error_before_any_rank(tmp_path, single_ckpt):
    run = _saved_run(tmp_path, single_ckpt)
    proc = _train("--out", str(run), "--no-resume")
    assert proc.returncode == 2, proc.stderr
    assert _error_lines(proc) == [f"Error: --no-resume: {run} already holds checkpoints (step_4). "
                                  "Pass a new --out, delete the folder, or drop --no-resume to continue it"]
    assert "Traceback" not in proc.stderr and "torch was imported" not in proc.stderr


def test_resume_from_a_missing_folder_says_so_once(tmp_path):
    proc = _train("--out", str(tmp_path / "run"), "--resume-from", "nope/", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert _error_lines(proc) == ["Error: --resume-from nope/: no such folder"]
    assert "validate" not in proc.stderr  # no advice to validate what does not exist
    assert not (tmp_path / "run").exists()


def test_resume_from_a_broken_checkpoint_names_the_problem(tmp_path, single_ckpt):
    run = _saved_run(tmp_path, single_ckpt)
    (run / "step_4" / "__0_0.distcp").unlink()
    proc = _train("--out", str(tmp_path / "new"), "--resume-from", str(run / "step_4"))
    assert proc.returncode == 2, proc.stderr
    [line] = _error_lines(proc)
    assert line.startswith(f"Error: --resume-from {run / 'step_4'} is not a loadable checkpoint: missing-file:")
    assert line.count("error") == 0 and line.endswith(f"'ckptool validate {run / 'step_4'}' lists every problem")


@pytest.mark.parametrize("args, message", [
    (["--save-every", "-1"], "--save-every must not be negative, got -1"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--keep", "-2"], "--keep must not be negative, got -2"),
    (["--lr", "0"], "--lr must be positive, got 0.0"),
    (["--grad-clip", "-1"], "--grad-clip must not be negative, got -1.0"),
    (["--warmup-steps", "-1"], "--warmup-steps must not be negative, got -1"),
    (["--layers", "0"], "--layers must be at least 1, got 0"),
    (["--d-model", "60", "--heads", "8"], "--d-model 60 is not divisible by --heads 8"),
    (["--vocab", "100"], "--vocab 100 is too small for byte-level tokens"),
    (["--nproc", "4", "--sharding", "hybrid", "--hybrid-shard-size", "3"],
     "--hybrid-shard-size 3 does not divide 4 ranks"),
    (["--batch-size", "3", "--nproc", "2"], "--batch-size 3 (the global batch) does not split over 2 ranks"),
])
def test_bad_values_name_their_option_and_exit_2(tmp_path, args, message):
    proc = _train("--out", str(tmp_path / "run"), *args)
    assert proc.returncode == 2, proc.stderr
    [line] = _error_lines(proc)
    assert line.startswith(f"Error: {message}"), line


def test_every_config_error_names_an_option():
    bad = [{"steps": 0}, {"save_every": -1}, {"keep": -1}, {"seed": -1}, {"log_every": 0}, {"grad_accum": 0},
           {"batch_size": 0}, {"nproc": 0}, {"seq_len": 0}, {"lr_decay_steps": 0}, {"lr": -1.0},
           {"weight_decay": -1.0}, {"sharding": "zero3"}, {"device": "tpu"}, {"mixed_precision": "fp16"},
           {"activation_checkpointing": "some"}, {"n_heads": 0}, {"d_ff": 0}, {"max_seq_len": 0},
           {"model": "huge"}, {"seq_len": 65}, {"resume": False, "resume_from": "x"}]
    for kw in bad:
        with pytest.raises(ConfigError) as e:
            TrainConfig(**kw)
        assert str(e.value).startswith("--"), (kw, str(e.value))


# -- item 3: another model is named field by field, before any rank ----------------------------
def test_resume_with_another_model_names_each_differing_option(tmp_path, single_ckpt):
    run = _saved_run(tmp_path, single_ckpt)  # tiny: --layers 4
    proc = _train("--out", str(run), "--layers", "2")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: cannot resume {run / 'step_4'}: it was saved with --layers 4, this run has --layers 2; "
        "pass the saved sizes to continue it, or a new --out to start over"]
    proc = _train("--out", str(run), "--model", "small")
    assert proc.returncode == 1
    assert ("it was saved with --model tiny (--d-model 64 --layers 4 --heads 4 --d-ff 256 --max-seq-len 64), "
            "this run has --model small (--d-model 256 --layers 6 --heads 8 --d-ff 1024 --max-seq-len 256)"
            ) in proc.stderr


def test_same_model_is_no_mismatch_and_no_manifest_is_no_verdict():
    cfg = TrainConfig(d_ff=256)  # the tiny preset's own width, spelled out
    saved = {"model": "tiny", "model_config": TrainConfig().model_config().to_dict()}
    assert model_mismatch(Resume("run/step_4", 2, saved), cfg) is None
    assert model_mismatch(Resume("run/step_4", None, None), TrainConfig(n_layers=1)) is None


# -- item 8: what changes on resume is said, one line each ---------------------------------------
def test_resume_notices_name_ranks_sharding_schedule_and_batch():
    saved_cfg = TrainConfig(steps=300, sharding="full", batch_size=16)
    saved = Resume("runs/x/step_100", 2, saved_cfg.to_dict())
    assert resume_notices(saved, TrainConfig(steps=300), 2) == []
    now = TrainConfig(steps=600, sharding="hybrid", hybrid_shard_size=2, batch_size=8)
    assert [n.text for n in resume_notices(saved, now, 4)] == [
        "step_100 was saved by 2 ranks, loading on 4 (DCP reshards on load)",
        "step_100 was trained with --sharding full; continuing with hybrid (--hybrid-shard-size 2)",
        "the LR schedule differs from step_100's: warmup 60 (was 30), cosine decay to step 600 (was 300); "
        "pass --lr-decay-steps 300 to keep it",
        "step_100 was trained with --batch-size 16; continuing with 8",
    ]
    # --lr-decay-steps pinned: more steps on the same schedule is no change.
    pinned = Resume("s/step_1", 1, TrainConfig(steps=300, lr_decay_steps=600).to_dict())
    assert resume_notices(pinned, TrainConfig(steps=600, lr_decay_steps=600), 1) == []
    assert [n.text for n in resume_notices(pinned, TrainConfig(steps=600, lr_decay_steps=600), 2)] == [
        "step_1 was saved by 1 rank, loading on 2 (DCP reshards on load)"]


def test_notices_reach_the_json_summary_field():
    from ckptool.train.loop import TrainResult

    assert "notes" in TrainResult.__dataclass_fields__


def test_config_file_may_use_the_command_line_names(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"layers": 2, "heads": 2, "save-every": 5}))
    from ckptool.train.config import read_config_file

    cfg = TrainConfig.from_dict(read_config_file(tmp_path / "c.json"))
    assert (cfg.n_layers, cfg.n_heads, cfg.save_every) == (2, 2, 5)
