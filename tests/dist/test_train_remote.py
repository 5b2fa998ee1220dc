"""``ckptool train --out s3://...`` end to end against a real S3 API on loopback (moto server):
commit order, retention, resume, async saving, and the read-side commands on the result.

The CLI runs as a subprocess, so the ranks get the endpoint and credentials from the
environment (``s3_server`` sets them), exactly as a user's shell would pass them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from _dist import load_tensors
from ckptool.checkpoint import retention_victims, step_checkpoints
from ckptool.run_folder import remove_remote as _remove_remote
from ckptool.cli import cli
from ckptool.errors import ConfigError
from ckptool.format.manifest import read_manifest
from ckptool.storage import Storage
from ckptool.train.loop import check_fresh_out

pytestmark = pytest.mark.dist

TINY = ["--nproc", "2", "--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16",
        "--batch-size", "4", "--save-every", "2", "--keep", "2"]
STEP_FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "ckptool.json"]


def _fs(endpoint: str):
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)


def _train(url: str, steps: int, *flags: str) -> dict:
    cmd = [sys.executable, "-m", "ckptool", "train", "--out", url, *TINY, "--steps", str(steps),
           "--json", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _tree(fs, prefix: str) -> dict[str, list[str]]:
    """{step folder: sorted file names} of everything under ``prefix`` (hidden folders too)."""
    out: dict[str, list[str]] = {}
    for key in fs.find(prefix):
        folder, name = key[len(prefix) + 1:].split("/", 1)
        out.setdefault(folder, []).append(name)
    return {k: sorted(v) for k, v in out.items()}


def test_train_to_s3_then_validate_consolidate_reshard_and_resume(s3_server, s3_bucket, tmp_path):
    from safetensors.torch import load_file

    fs = _fs(s3_server)
    url = f"s3://{s3_bucket}/run"
    fs.pipe_file(f"{s3_bucket}/run/step_1/__0_0.distcp", b"torn")  # older than any good save: removed
    fs.pipe_file(f"{s3_bucket}/run/step_6/__5_0.distcp", b"stale")  # replaced by the new step_6

    first = _train(url, 6)
    assert first["checkpoints"] == ["step_4", "step_6"] and first["saves"] == 3
    assert first["latest"] == f"{url}/step_6" and first["resumed_from"] is None
    # Retention left the 2 newest, nothing else (no torn step_1, no temporary files).
    assert _tree(fs, f"{s3_bucket}/run") == {"step_4": STEP_FILES, "step_6": STEP_FILES}
    m = read_manifest(Storage.open(f"{url}/step_6"))
    assert (m.step, m.world_size, m.loss) == (6, 2, first["final_loss"])
    with pytest.raises(ConfigError, match=r"--no-resume: .* already holds checkpoints \(step_6\)"):
        check_fresh_out(url)

    runner = CliRunner()
    res = runner.invoke(cli, ["validate", "--deep", f"{url}/step_6"])
    assert res.exit_code == 0 and "is complete" in res.output, res.output
    res = runner.invoke(cli, ["consolidate", f"{url}/step_6", str(tmp_path / "model.safetensors")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["reshard", f"{url}/step_6", str(tmp_path / "ws1"), "--to", "1"])
    assert res.exit_code == 0, res.output

    fs.get(f"{s3_bucket}/run/step_6", str(tmp_path / "step_6"), recursive=True)
    saved = load_tensors(tmp_path / "step_6")
    resharded = load_tensors(tmp_path / "ws1")
    assert saved.keys() == resharded.keys() and all(torch.equal(saved[k], resharded[k]) for k in saved)
    weights = load_file(tmp_path / "model.safetensors")
    assert {f"model.{k}" for k in weights} == {k for k in saved if k.startswith("model.")}
    assert all(torch.equal(v, saved[f"model.{k}"]) for k, v in weights.items())

    second = _train(url, 8)
    assert second["resumed_from"] == f"{url}/step_6"
    assert (second["start_step"], second["steps"], len(second["losses"])) == (6, 8, 2)
    assert second["checkpoints"] == ["step_6", "step_8"]
    assert _tree(fs, f"{s3_bucket}/run") == {"step_6": STEP_FILES, "step_8": STEP_FILES}


def test_async_save_to_s3(s3_server, s3_bucket):
    fs = _fs(s3_server)
    url = f"s3://{s3_bucket}/async"
    result = _train(url, 4, "--async-save")
    assert result["checkpoints"] == ["step_2", "step_4"] and result["saves"] == 2
    assert _tree(fs, f"{s3_bucket}/async") == {"step_2": STEP_FILES, "step_4": STEP_FILES}
    assert read_manifest(Storage.open(f"{url}/step_4")).step == 4


def test_remote_removal_uncommits_first(s3_server, s3_bucket, single_ckpt, monkeypatch):
    fs = _fs(s3_server)
    for step in (1, 2):
        fs.put(str(single_ckpt), f"{s3_bucket}/r/step_{step}", recursive=True)
    run = f"s3://{s3_bucket}/r"
    assert [c.committed for c in step_checkpoints(run)] == [True, True]

    # A crash right after the first delete: step_1 must read as torn, not as committed.
    real_remove, calls = Storage.remove_tree, []

    def remove_then_crash(self, rel=""):
        if calls:
            raise RuntimeError("crash")
        calls.append(self.path(rel))
        return real_remove(self, rel)

    monkeypatch.setattr(Storage, "remove_tree", remove_then_crash)
    with pytest.raises(RuntimeError, match="crash"):
        _remove_remote(run, "step_1")
    assert calls == [f"{s3_bucket}/r/step_1/.metadata"]
    monkeypatch.setattr(Storage, "remove_tree", real_remove)
    found = step_checkpoints(run)
    assert [(c.name, c.committed) for c in found] == [("step_1", False), ("step_2", True)]
    assert [c.name for c in retention_victims(found, keep=1)] == ["step_1"]  # the next pass removes it
    _remove_remote(run, "step_1")
    assert [c.name for c in step_checkpoints(run)] == ["step_2"]


def test_remote_listing_sees_writes_from_other_clients(s3_server, s3_bucket, single_ckpt):
    run = Storage.open(f"s3://{s3_bucket}/l")
    _fs(s3_server).put(str(single_ckpt), f"{s3_bucket}/l/step_1", recursive=True)
    assert [e.name for e in run.listdir()] == ["step_1"]  # now in this client's listing cache
    _fs(s3_server).put(str(single_ckpt), f"{s3_bucket}/l/step_2", recursive=True)  # another client
    assert [e.name for e in run.listdir()] == ["step_1", "step_2"]
    assert run.exists("step_2/.metadata")
