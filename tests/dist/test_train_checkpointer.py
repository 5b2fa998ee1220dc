"""The library ``Checkpointer``: retention rules, single-process use, and the FSDP2 example
script under ``torchrun`` (the ``dist`` tests)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from ckptool.checkpoint import Checkpointer, retention_victims, step_checkpoints
from ckptool.errors import ConfigError, CorruptCheckpointError

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, spec: str) -> Path:
    """Folders from a spec like 'c1 t2 c3': c = committed (.metadata), t = torn."""
    run = tmp_path / "run"
    for item in spec.split():
        d = run / f"step_{item[1:]}"
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"x")
        if item[0] == "c":
            (d / ".metadata").write_bytes(b"m")
    (run / "final_model").mkdir()  # not a step_N folder: never counted nor deleted
    (run / "final_model/.metadata").write_bytes(b"m")
    return run


@pytest.mark.parametrize("spec, keep, inflight, deleted", [
    ("c1 c2 c3 c4", 2, None, ["step_1", "step_2"]),
    ("c1 c2 c3 c4", 0, None, []),
    ("c1 t2 c3 t4", 1, None, ["step_1", "step_2"]),  # t4 is newer than the newest good one
    ("t1 c2 t3 c4 t5", 5, 3, ["step_1"]),  # step 3 is in flight
    ("t1 t2", 1, None, []),  # nothing committed: delete nothing
    ("c1 c2", 1, None, ["step_1"]),  # the newest good one always stays
])
def test_retention_rules(tmp_path, spec, keep, inflight, deleted):
    found = step_checkpoints(_run(tmp_path, spec))
    assert [c.name for c in retention_victims(found, keep, inflight=inflight)] == deleted


def test_no_resume_refuses_a_used_run_folder(tmp_path):
    from ckptool.train.loop import check_fresh_out

    check_fresh_out(str(tmp_path / "missing"))
    run = _run(tmp_path, "t5")
    with pytest.raises(ConfigError, match=r"--no-resume: .* already holds checkpoints \(step_5\)"):
        check_fresh_out(str(run))


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _step(model, opt):
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_checkpointer_in_one_process(tmp_path):
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ckpt = Checkpointer(tmp_path / "run", keep=2, config={"note": "unit"})
    assert ckpt.load_latest(model, opt) is None and ckpt.latest() is None
    for step in (1, 2, 3):
        _step(model, opt)
        sched.step()
        ckpt.save(step, model, opt, extra={"lr_scheduler": sched, "meta": {"step": step}}, loss=0.5)
    assert [c.name for c in ckpt.list()] == ["step_2", "step_3"]
    assert (tmp_path / "run/step_3/ckptool.json").exists() and ckpt.stats.saves == 3
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    model2 = _tiny()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    extra = {"lr_scheduler": sched2, "meta": {"step": 0}}
    assert ckpt.load_latest(model2, opt2, extra=extra) == 3
    assert extra["meta"]["step"] == 3 and sched2.last_epoch == 3
    assert all(torch.equal(v, model2.state_dict()[k]) for k, v in expected.items())
    assert opt2.state_dict()["state"][0]["step"] == 3
    with pytest.raises(ConfigError, match="reserved keys"):
        ckpt.save(4, model, opt, extra={"model": 1})

    # A checkpoint that fails validation is never handed to torch's unpickler.
    bad = tmp_path / "run/step_3/__0_0.distcp"
    bad.write_bytes(bad.read_bytes()[:50])
    with pytest.raises(CorruptCheckpointError, match="is not a loadable checkpoint"):
        ckpt.load(tmp_path / "run/step_3", model2, opt2)
    assert ckpt.latest().name == "step_2"


@pytest.mark.dist
def test_example_script_under_torchrun(tmp_path):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    out = tmp_path / "ex"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "examples/train_fsdp2.py")

    def run(nproc: int, steps: int, *flags: str) -> str:
        cmd = [torchrun, "--standalone", f"--nproc_per_node={nproc}", script,
               "--out", str(out), "--steps", str(steps), *flags]
        # Own session: on a timeout the whole tree (torchrun, ranks, save processes) goes.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 0, stdout + stderr
        return stdout

    first = run(2, 6, "--async-save")
    assert "fresh start" in first and "checkpoints: ['step_5', 'step_6']" in first
    second = run(1, 8)  # another rank count: DCP reshards on load
    assert "resumed from step 6" in second and "checkpoints: ['step_6', 'step_8']" in second
