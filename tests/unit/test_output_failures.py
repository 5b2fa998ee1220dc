"""Output paths that fail (issue 7): a full disk and a read-only destination, for
``ckptool consolidate`` and ``ckptool reshard``. Either way: exit 1, one clear ``error:`` line,
no traceback, and nothing left that looks like valid output.

The full disk is a real 64 KiB tmpfs (ENOSPC) when this process may mount one (root), and a
file-size limit (``RLIMIT_FSIZE`` with SIGXFSZ ignored: EFBIG) everywhere. The read-only
destination is a tmpfs mounted ``ro`` (root ignores permission bits), else a ``chmod 555`` folder.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from factory import make_single_checkpoint

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory) -> Path:
    """A checkpoint whose weights (~1 MiB) cannot fit in ``LIMIT`` bytes."""
    import torch

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(512, 256, generator=g), "b": torch.randn(256, generator=g)}
    return make_single_checkpoint(tmp_path_factory.mktemp("big") / "step_1", tensors)


@contextlib.contextmanager
def _tmpfs(where: Path, options: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _commands(src: Path, dest_dir: Path) -> dict[str, list[str]]:
    return {
        "consolidate-file": ["consolidate", str(src), str(dest_dir / "model.safetensors")],
        "consolidate-folder": ["consolidate", str(src), str(dest_dir / "hf"), "--max-shard-size", "300KB"],
        "reshard": ["reshard", str(src), str(dest_dir / "resharded"), "--to", "2"],
    }


def _run(args: list[str], *, fsize: int | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "ckptool", *args], capture_output=True, text=True,
                          env=env, timeout=120, preexec_fn=limit if fsize else None)


def _assert_clean_failure(proc: subprocess.CompletedProcess, dest_dir: Path, *words: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert any(w in proc.stderr for w in words), proc.stderr
    leftovers = sorted(os.listdir(dest_dir)) if dest_dir.exists() else []
    assert leftovers == [], f"output left behind after a failed write: {leftovers}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines and lines[0].startswith("error: "), proc.stderr
    assert len([ln for ln in lines if ln.startswith("error: ")]) == 1, proc.stderr


CASES = ("consolidate-file", "consolidate-folder", "reshard")


@pytest.mark.parametrize("case", CASES)
def test_full_disk_enospc(big_ckpt, tmp_path, case):
    with _tmpfs(tmp_path / "full", f"size={LIMIT}") as dest:
        proc = _run(_commands(big_ckpt, dest)[case])
        _assert_clean_failure(proc, dest, "No space left", "ENOSPC", "space")


@pytest.mark.parametrize("case", CASES)
def test_file_size_limit_efbig(big_ckpt, tmp_path, case):
    dest = tmp_path / "out"
    dest.mkdir()
    proc = _run(_commands(big_ckpt, dest)[case], fsize=LIMIT)
    _assert_clean_failure(proc, dest, "File too large", "EFBIG", "too large")


@pytest.mark.parametrize("case", CASES)
def test_read_only_destination(big_ckpt, tmp_path, case):
    if os.geteuid() == 0:
        ctx = _tmpfs(tmp_path / "ro", "ro,size=1m")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        ctx = contextlib.nullcontext(ro)
    with ctx as dest:
        proc = _run(_commands(big_ckpt, dest)[case])
        _assert_clean_failure(proc, dest, "Read-only", "read-only", "Permission denied", "not writable")
