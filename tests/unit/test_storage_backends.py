"""The two storage backends (local, fsspec) answer alike, and remote ranged reads are
thread-safe. ``memory://`` is a real fsspec file system, so nothing here is mocked."""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckptool.errors import CheckpointNotFoundError
from ckptool.run_folder import remove_checkpoint, step_checkpoints
from ckptool.storage import BLOCK, RangeReader, Storage

DATA = bytes(range(256)) * 4096 + b"tail"  # 1 MiB + 4 bytes, every offset distinguishable


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path) -> Storage:
    if request.param == "local":
        return Storage.open(tmp_path / "root")
    return Storage.open(f"memory://h1-{uuid.uuid4().hex}/root")


def _fill(st: Storage) -> None:
    st.makedirs("sub")
    st.write_bytes("a.bin", DATA)
    st.write_bytes("sub/b.txt", b"hello")


def test_backend_chosen_once_and_inherited(root):
    assert root.child("x").backend is root.backend and root.parent().backend is root.backend
    assert root.is_local == (root.fs is None) == root.atomic_rename


def test_same_answers_on_both_backends(root):
    _fill(root)
    assert [(e.name, e.is_dir) for e in root.listdir()] == [("a.bin", False), ("sub", True)]
    assert [(e.name, e.size) for e in root.listdir("sub")] == [("b.txt", 5)]
    assert root.exists() and root.isdir() and root.exists("sub/b.txt") and not root.exists("nope")
    assert root.isfile("a.bin") and not root.isfile("sub") and root.isdir("sub")
    assert root.size("a.bin") == len(DATA) and root.read_bytes("sub/b.txt") == b"hello"
    assert root.read_range("a.bin", 1000, 10) == DATA[1000:1010]
    assert root.read_range("a.bin", len(DATA) - 2, 10) == b"il"  # short only at the end
    assert root.read_range("a.bin", len(DATA) + 5, 10) == b""
    assert root.realpath_inside("sub/b.txt") and not root.realpath_inside("../x")
    assert root.url_of("sub") == f"{root.url}/sub" and root.child("sub").name == "sub"


def test_rename_remove_and_fsync(root):
    _fill(root)
    root.rename("sub", "moved")
    assert not root.exists("sub") and root.read_bytes("moved/b.txt") == b"hello"
    root.fsync("moved")  # a folder: real on disk, a no-op remotely
    root.fsync("a.bin")
    root.remove("moved/b.txt")
    root.remove("moved/b.txt")  # a missing file is no error
    assert not root.exists("moved/b.txt")
    root.remove_tree("moved")
    root.remove_tree("moved")
    assert [e.name for e in root.listdir()] == ["a.bin"]
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        root.listdir("gone")


def test_concurrent_remote_pread_returns_the_right_bytes():
    st = Storage.open(f"memory://h1-{uuid.uuid4().hex}")
    big = os.urandom(2 * BLOCK + 12345)
    st.write_bytes("f", big)
    # Small reads go through the kept block, large ones straight through: mix both.
    jobs = [((i * 7919) % len(big), 1 + (i * 104729) % (BLOCK + 99)) for i in range(400)]
    r = RangeReader(st, "f")
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda j: r.pread(*j), jobs))
    finally:
        r.close()
    assert got == [big[o:o + n] for o, n in jobs]
    assert r.fileno is None


def test_remove_checkpoint_leaves_nothing_that_looks_committed(root):
    for step in (1, 2):
        root.makedirs(f"step_{step}")
        root.write_bytes(f"step_{step}/__0_0.distcp", b"x")
        root.write_bytes(f"step_{step}/.metadata", b"m")
    remove_checkpoint(root, "step_1")
    remove_checkpoint(root, "step_9")  # missing: nothing to do
    assert [e.name for e in root.listdir()] == ["step_2"]  # no hidden leftover either
    assert step_checkpoints(root.child("absent")) == []


def test_remote_reads_across_the_kept_block_and_one_shot_reads():
    st = Storage.open(f"memory://h1-{uuid.uuid4().hex}")
    big = os.urandom(BLOCK + 5000)
    st.write_bytes("f", big)
    with st.reader("f") as r:
        assert r.pread(10, 4) == big[10:14]  # keeps BLOCK bytes from offset 10
        assert r.pread(BLOCK, 100) == big[BLOCK:BLOCK + 100]  # starts inside it, ends past it
        assert r.pread(BLOCK + 4990, 100) == big[BLOCK + 4990:]
    assert st.read_range("f", 3, 5) == big[3:8]
