"""Read-side commands on fsspec URLs: a real S3 API on loopback (moto server) and memory://."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ckptool.ops.inspect import inspect, list_run
from ckptool.ops.validate import validate


def _put(s3_server, local, remote):
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_server, skip_instance_cache=True)
    fs.put(str(local), remote, recursive=True)
    return fs


def test_validate_inspect_ls_on_s3(s3_server, s3_bucket, single_ckpt):
    _put(s3_server, single_ckpt, f"{s3_bucket}/run/step_7")
    url = f"s3://{s3_bucket}/run/step_7"
    report = validate(url, deep=True)
    assert report.ok, report.findings
    assert report.path == url
    s = inspect(url)
    assert s.step == 7 and s.world_size == 1 and s.count("model") == 3
    entries = list_run(f"s3://{s3_bucket}/run")
    assert [(e.name, e.status, e.latest_good) for e in entries] == [("step_7", "complete", True)]
    # the CLI in a fresh process, configured only through the environment
    proc = subprocess.run([sys.executable, "-m", "ckptool", "validate", "--deep", url],
                          capture_output=True, text=True, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    assert "is complete" in proc.stdout


def test_broken_checkpoint_on_s3_is_named(s3_server, s3_bucket, single_ckpt):
    fs = _put(s3_server, single_ckpt, f"{s3_bucket}/c")
    shard = next(p for p in fs.ls(f"{s3_bucket}/c") if p.endswith(".distcp"))
    fs.rm(shard)
    report = validate(f"s3://{s3_bucket}/c")
    assert [f.code for f in report.errors] == ["missing-file"]


def test_memory_url_json(single_ckpt):
    import fsspec
    from click.testing import CliRunner

    from ckptool.cli import cli

    fs = fsspec.filesystem("memory")
    for p in single_ckpt.iterdir():
        fs.pipe_file(f"/remote-run/step_3/{p.name}", p.read_bytes())
    res = CliRunner().invoke(cli, ["inspect", "memory://remote-run/step_3", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["step"] == 3
    with pytest.raises(Exception, match="does not exist"):
        inspect("memory://remote-run/step_404")
