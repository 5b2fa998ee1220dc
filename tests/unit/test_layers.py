"""Imports only point down (DESIGN.md): a module never imports a layer above its own.

Every ``import``/``from ... import`` in the package is read with ``ast``, those inside
functions included (a lazy import still makes a cycle of layers).
"""

from __future__ import annotations

import ast
from pathlib import Path

import ckptool

ROOT = Path(ckptool.__file__).parent

# layer -> layers it may import (besides itself). Top to bottom: cli, ops/train, checkpoint,
# format, storage/errors. ops may use train.sizes (the torch-free model description).
ALLOWED = {
    "cli": {"ops", "train", "checkpoint", "run_folder", "format", "storage", "errors", "_version"},
    "ops": {"ops", "format", "storage", "errors", "_version", "train.sizes"},
    "train": {"train", "checkpoint", "run_folder", "ops", "format", "storage", "errors",
              "_version"},
    "checkpoint": {"run_folder", "ops", "format", "storage", "errors", "_version"},
    "run_folder": {"ops", "format", "storage", "errors"},
    "format": {"format", "storage", "errors", "_version"},
    "storage": {"errors"},
    "errors": set(),
}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return [(n, m) for n, m in out if m == "ckptool" or m.startswith("ckptool.")]


def test_no_module_imports_a_layer_above_it():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        own = rel.parts[0].removesuffix(".py")
        if own not in ALLOWED:
            continue
        for line, module in _imports(path):
            target = _layer(module)
            dotted = ".".join(module.split(".")[1:3])
            if target and target != own and target not in ALLOWED[own] \
                    and dotted not in ALLOWED[own]:
                bad.append(f"{rel}:{line} imports {module}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import(tmp_path):
    """The rule above can fail: a format module importing ops is caught."""
    fake = tmp_path / "x.py"
    fake.write_text("def f():\n    from ckptool.ops.validate import validate\n")
    assert _imports(fake) == [(2, "ckptool.ops.validate")]
    assert _layer("ckptool.ops.validate") not in ALLOWED["format"]
