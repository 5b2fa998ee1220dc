"""storage/readahead.py: the whole source is asked for front to back, on a thread of its own,
only when it fits the memory budget."""

from __future__ import annotations

import os
import threading

import pytest

from ckptool.storage import readahead
from ckptool.storage.readahead import STEP, available_memory, read_ahead

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")


def _recording(monkeypatch):
    calls, done = [], threading.Event()

    def fadvise(fd, offset, length, advice):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice,
                      threading.current_thread().name))

    real_advise = readahead._advise

    def advise(paths):
        try:
            real_advise(paths)
        finally:
            done.set()

    monkeypatch.setattr(readahead.os, "posix_fadvise", fadvise)
    monkeypatch.setattr(readahead, "_advise", advise)
    return calls, done


def test_files_are_asked_for_whole_and_in_order_on_a_thread(tmp_path, monkeypatch):
    calls, done = _recording(monkeypatch)
    a, b = tmp_path / "b.bin", tmp_path / "a.bin"  # the order given, not the names'
    with open(a, "wb") as f:
        f.truncate(STEP * 2 + 5)
    b.write_bytes(b"x" * 10)
    assert read_ahead([str(a), str(b)], budget=STEP * 3) is True
    assert done.wait(10)
    ra, rb = os.path.realpath(a), os.path.realpath(b)
    assert [c[:4] for c in calls] == [
        (ra, 0, STEP, os.POSIX_FADV_WILLNEED), (ra, STEP, STEP, os.POSIX_FADV_WILLNEED),
        (ra, 2 * STEP, 5, os.POSIX_FADV_WILLNEED), (rb, 0, 10, os.POSIX_FADV_WILLNEED)]
    assert {c[4] for c in calls} == {"ckptool-readahead"}


def test_files_over_the_budget_are_left_to_be_read_as_they_go(tmp_path, monkeypatch):
    calls, done = _recording(monkeypatch)
    p = tmp_path / "big.bin"
    p.write_bytes(b"x" * 100)
    assert read_ahead([str(p)], budget=99) is False
    assert not done.wait(0.2) and calls == []


def test_the_default_budget_is_half_the_available_memory(tmp_path, monkeypatch):
    calls, done = _recording(monkeypatch)
    p = tmp_path / "f.bin"
    p.write_bytes(b"x" * 100)
    monkeypatch.setattr(readahead, "available_memory", lambda: 199)
    assert read_ahead([str(p)]) is False
    monkeypatch.setattr(readahead, "available_memory", lambda: 200)
    assert read_ahead([str(p)]) is True
    assert done.wait(10)


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux only")
def test_available_memory_reads_meminfo():
    assert available_memory() > 0


def test_reshard_and_import_read_their_whole_local_source_ahead(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from safetensors.numpy import save_file

    from ckptool.ops import import_hf as imp
    from ckptool.ops import reshard as rs
    from tests.unit.test_reshard import make_source

    asked = []
    monkeypatch.setattr(rs, "read_ahead", lambda paths: asked.append(list(paths)) or True)
    monkeypatch.setattr(imp, "read_ahead", lambda paths: asked.append(list(paths)) or True)
    make_source(tmp_path / "src", 3)
    rs.reshard(tmp_path / "src", tmp_path / "out", world_size=2)
    assert asked.pop() == [str(tmp_path / "src" / f"__{r}_0.distcp") for r in range(3)]
    import numpy as np

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": np.ones((4, 2), np.float32)}, str(hf / "model.safetensors"))
    imp.import_hf(hf, tmp_path / "imp", world_size=2)
    assert [os.path.basename(p) for p in asked.pop()] == ["model.safetensors"]
