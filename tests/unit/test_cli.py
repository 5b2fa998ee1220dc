"""The CLI boundary: fast start-up, exit codes, one-line errors, tracebacks only on request."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from click.testing import CliRunner

from ckptool import __version__
from ckptool.cli import cli


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ckptool", *args], capture_output=True,
                          text=True, env=full_env)


def test_version_and_help_do_not_import_torch():
    code = ("import sys; from ckptool.cli import cli; from click.testing import CliRunner; "
            "r = CliRunner().invoke(cli, ['--help']); assert r.exit_code == 0, r.output; "
            "r = CliRunner().invoke(cli, ['--version']); assert r.exit_code == 0; "
            "[CliRunner().invoke(cli, [c, '--help']) for c in ('validate', 'inspect', 'ls')]; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
    res = CliRunner().invoke(cli, ["--version"])
    assert res.output.strip() == f"ckptool, version {__version__}"


def test_structural_validate_loads_only_what_it_uses(single_ckpt):
    """``validate`` without --deep starts without the deep check's threads and mappings, or
    the file removal a reading command never does (start-up time)."""
    code = textwrap.dedent(f"""
        import sys
        from ckptool.cli import main
        sys.argv = ["ckptool", "validate", {str(single_ckpt)!r}]
        try:
            main()
        except SystemExit as e:
            assert e.code == 0, e.code
        loaded = [m for m in ("ckptool.ops.deep_check", "concurrent.futures", "mmap", "shutil",
                              "torch") if m in sys.modules]
        assert not loaded, loaded
        """)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ckpt_error_is_one_line_exit_1(tmp_path):
    proc = _run("inspect", str(tmp_path / "nope"))
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: ") and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_debug_env_shows_traceback(tmp_path):
    proc = _run("inspect", str(tmp_path / "nope"), env={"CKPTOOL_DEBUG": "1"})
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "CheckpointNotFoundError" in proc.stderr


def test_usage_error_exit_2():
    proc = _run("validate", "--no-such-flag", "x")
    assert proc.returncode == 2
    assert "No such option" in proc.stderr
    assert _run("no-such-command").returncode == 2


def test_run_folder_means_latest_committed(single_ckpt, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(single_ckpt, run / "step_10")
    shutil.copytree(single_ckpt, run / "step_20")
    (run / "step_30").mkdir()  # torn save: ignored
    res = CliRunner().invoke(cli, ["validate", str(run)])
    assert res.exit_code == 0, res.output
    assert "step_20 is complete" in res.output
    res = CliRunner().invoke(cli, ["ls", str(run)])
    lines = res.output.splitlines()
    assert any(line.startswith("* step_20") for line in lines)
    assert any("step_30" in line and "incomplete" in line for line in lines)


def test_empty_run_folder_ls_exit_1(tmp_path):
    res = CliRunner().invoke(cli, ["ls", str(tmp_path)])
    assert res.exit_code == 1


def test_ls_of_a_checkpoint_lists_it_and_takes_the_step_from_the_manifest(single_ckpt, tmp_path):
    """`ls runs/demo/step_300` used to say "no checkpoints"; `final_model` showed step "-"."""
    import json
    import shutil

    from ckptool.format import manifest as mf
    from ckptool.storage import Storage

    run = tmp_path / "run"
    shutil.copytree(single_ckpt, run / "step_10")
    shutil.copytree(single_ckpt, run / "final_model")
    st = Storage.open(run / "final_model")
    mf.write_manifest(st, mf.build_manifest(st, step=12, world_size=1))
    r = CliRunner().invoke(cli, ["ls", str(run / "step_10"), "--json"])
    assert r.exit_code == 0, r.output
    assert [(e["name"], e["step"], e["status"]) for e in json.loads(r.output)] == \
        [("step_10", 10, "complete")]
    r = CliRunner().invoke(cli, ["ls", str(run), "--json"])
    assert {e["name"]: e["step"] for e in json.loads(r.output)} == {"step_10": 10, "final_model": 12}


def test_validate_deep_reports_progress(single_ckpt):
    from ckptool.ops.validate import validate

    seen: list[tuple[int, int]] = []
    report = validate(single_ckpt, deep=True, progress=lambda d, t: seen.append((d, t)))
    assert report.ok and seen
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # never goes back
    total = sum(p.stat().st_size for p in single_ckpt.glob("*.distcp"))
    assert seen[-1] == (total, total)
