"""validate on a real 3-rank FSDP2 checkpoint and on every broken variant of it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from ckptool.cli import cli
from ckptool.ops.validate import validate

pytestmark = pytest.mark.dist

# variant -> (finding code validate must report, words the message must contain, needs --deep)
EXPECTED = {
    "no-metadata": ("incomplete", "save was interrupted", False),
    "missing-shard": ("missing-file", "is missing", False),
    "truncated-shard": ("truncated-file", "was truncated", False),
    "chunk-gap": ("chunk-gap", "first missing region", False),
    "chunk-overlap": ("chunk-overlap", "is saved twice", False),
    "path-traversal": ("path-outside", "../../etc/passwd", False),
    "flipped-byte": ("crc-mismatch", "CRC-32 mismatch", True),
    "empty-folder": ("empty", "holds no checkpoint", False),
    "hostile-pickle": ("unsafe-pickle", "refused", False),
    "empty-metadata": ("bad-metadata", "is empty", False),
    "truncated-metadata": ("bad-metadata", "not a readable DCP index", False),
}


def test_good_checkpoint_is_complete(fsdp3):
    ckpt, _ = fsdp3
    for deep in (False, True):
        report = validate(ckpt, deep=deep)
        assert report.ok, report.findings
        assert report.findings == ()
        assert report.world_size == 3
        assert report.tensors > 10
    runner = CliRunner()
    for args in ([str(ckpt)], [str(ckpt), "--deep"], [str(ckpt), "--world-size", "3"]):
        res = runner.invoke(cli, ["validate", *args])
        assert res.exit_code == 0, res.output
        assert "is complete" in res.output


@pytest.mark.parametrize("variant", sorted(EXPECTED))
def test_broken_variant_is_named(fsdp3, tmp_path, variant, monkeypatch):
    from factory import break_checkpoint

    monkeypatch.setenv("CKPTOOL_PWNED", str(tmp_path / "pwned"))
    ckpt, _ = fsdp3
    bad = break_checkpoint(ckpt, tmp_path / "step_1", variant)
    code, words, deep = EXPECTED[variant]
    report = validate(bad, deep=True)
    assert not report.ok
    codes = [f.code for f in report.errors]
    assert code in codes, report.findings
    assert any(words in f.message for f in report.errors if f.code == code), report.findings
    if not deep:  # structural checks alone must already find it
        assert code in [f.code for f in validate(bad).errors]
    # the CLI: exit 1, one line per problem, no traceback, nothing executed
    args = ["validate", str(bad)] + (["--deep"] if deep else [])
    proc = subprocess.run([sys.executable, "-m", "ckptool", *args], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert code in proc.stderr
    assert not (tmp_path / "pwned").exists()


def test_wrong_world_size(fsdp3):
    ckpt, _ = fsdp3
    report = validate(ckpt, world_size=4)
    assert [f.code for f in report.errors] == ["world-size"]
    assert "saved by 3 ranks, expected 4" in report.errors[0].message
    res = CliRunner().invoke(cli, ["validate", str(ckpt), "--world-size", "4"])
    assert res.exit_code == 1


def test_unreferenced_shard_is_a_warning(fsdp3, tmp_path):
    import shutil

    ckpt, _ = fsdp3
    dst = tmp_path / "c"
    shutil.copytree(ckpt, dst)
    (dst / "__9_0.distcp").write_bytes(b"stale")
    report = validate(dst)
    assert report.ok
    assert [f.code for f in report.findings] == ["unreferenced-file"]


def test_inspect_and_ls(fsdp3, tmp_path):
    import json
    import shutil

    ckpt, _ = fsdp3
    run = tmp_path / "run"
    shutil.copytree(ckpt, run / "step_1")
    shutil.copytree(ckpt, run / "step_2")
    (run / "step_2" / ".metadata").unlink()          # torn
    shutil.copytree(ckpt, run / "step_3")
    (run / "step_3" / "__0_0.distcp").unlink()       # committed but broken
    runner = CliRunner()
    res = runner.invoke(cli, ["ls", str(run), "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.output)}
    assert rows["step_1"]["status"] == "complete" and rows["step_1"]["latest_good"]
    assert rows["step_2"]["status"] == "incomplete"
    assert rows["step_3"]["status"] == "invalid" and not rows["step_3"]["latest_good"]
    res = runner.invoke(cli, ["inspect", str(run / "step_1"), "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    assert s["world_size"] == 3 and s["step"] == 1
    model = {k["fqn"]: k for k in s["groups"]["model"]}
    assert model["model.emb.weight"]["shape"] == [13, 6]
    assert model["model.emb.weight"]["chunks"] == 3
    assert model["model.emb.weight"]["bytes"] == 13 * 6 * 4
    assert any(k["fqn"].startswith("optim.state.") for k in s["groups"]["optimizer"])
    assert [k["fqn"] for k in s["groups"]["other"]] == ["step"]
    text = runner.invoke(cli, ["inspect", str(run / "step_1")]).output
    assert "model.emb.weight" in text and "13x6" in text
