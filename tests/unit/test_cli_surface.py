"""The CLI surface is frozen: every command's --help is compared with tests/golden/.

A deliberate change: run ``python -m pytest tests/unit/test_cli_surface.py --update-golden``
and add a CHANGELOG.md entry.
"""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from ckptool.cli import COMMANDS, cli

GOLDEN = Path(__file__).parent.parent / "golden" / "cli_surface.txt"


def _surface() -> str:
    runner = CliRunner()
    parts = []
    for args in ([], *([name] for name in COMMANDS)):
        res = runner.invoke(cli, [*args, "--help"], terminal_width=100, env={"COLUMNS": "100"})
        assert res.exit_code == 0, res.output
        parts.append(f"$ ckptool {' '.join(args)} --help\n{res.output}")
    return "\n".join(parts)


def test_cli_surface_matches_golden(update_golden):
    text = _surface()
    if update_golden or not GOLDEN.exists():
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), (
        "the CLI surface changed: review, then run with --update-golden and add a CHANGELOG entry")
