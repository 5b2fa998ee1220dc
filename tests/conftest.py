"""Shared fixtures: real checkpoints, made once per test session (no mocks of DCP or FSDP)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/factory.py, tests/_dist.py

os.environ.setdefault("OMP_NUM_THREADS", "1")  # many small ranks on 2 cores


@pytest.fixture(scope="session")
def fsdp3(tmp_path_factory) -> tuple[Path, Path]:
    """A 3-rank FSDP2 checkpoint (model + AdamW, uneven first dims) and its full reference state."""
    from factory import make_fsdp_checkpoint

    root = tmp_path_factory.mktemp("fsdp3")
    ref = root / "full.pt"
    ckpt = make_fsdp_checkpoint(root / "step_1", 3, ref=str(ref))
    return ckpt, ref


@pytest.fixture(scope="session")
def single_ckpt(tmp_path_factory) -> Path:
    """A one-rank in-process ``dcp.save`` checkpoint."""
    from factory import make_single_checkpoint

    return make_single_checkpoint(tmp_path_factory.mktemp("single") / "ckpt")
