"""The README's console examples are what the tool prints (issue 14, item 7).

Runs the demo (``ckptool train`` with no options) in a temporary folder that plays the
README's ``/home/you``, makes ``runs/broken/step_300`` (the demo's step_300 without
``__1_0.distcp``), then runs every ``$ ckptool ...`` line of every console block of README.md
and compares stdout + stderr with the lines under it; a line ``...`` stands for any lines.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

README = Path(__file__).resolve().parents[2] / "README.md"
HOME = "/home/you"


def console_examples(text: str) -> list[tuple[str, list[str]]]:
    """(command, expected lines) for every ``$ `` line inside a console block."""
    out: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                out.append((line[2:], []))
            elif out:
                out[-1][1].append(line)
    return out


def matches(expected: list[str], actual: list[str]) -> bool:
    """Line by line; ``...`` matches any run of lines (also none)."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and matches(expected[1:], actual[1:])


def test_matches_wildcards():
    assert matches(["a", "...", "d"], ["a", "b", "c", "d"]) and matches(["a", "..."], ["a"])
    assert not matches(["a", "d"], ["a", "b", "d"]) and not matches(["a"], ["a", "b"])


def test_readme_console_examples_are_true(tmp_path):
    examples = console_examples(README.read_text())
    assert len(examples) >= 3 and all(cmd.startswith("ckptool ") for cmd, _ in examples)
    demo = subprocess.run([sys.executable, "-m", "ckptool", "train"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr
    shutil.copytree(tmp_path / "runs/demo/step_300", tmp_path / "runs/broken/step_300")
    (tmp_path / "runs/broken/step_300/__1_0.distcp").unlink()
    for cmd, expected in examples:
        proc = subprocess.run([sys.executable, "-m", *shlex.split(cmd)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        actual = (proc.stdout + proc.stderr).replace(str(tmp_path), HOME).splitlines()
        assert matches(expected, actual), f"$ {cmd}\nREADME:\n" + "\n".join(expected) + "\nactual:\n" + \
            "\n".join(actual)
