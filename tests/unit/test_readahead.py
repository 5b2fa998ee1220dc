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


def test_parts_of_files_are_asked_for_as_given(tmp_path, monkeypatch):
    calls, done = _recording(monkeypatch)
    p = tmp_path / "f.bin"
    with open(p, "wb") as f:
        f.truncate(STEP * 3)
    assert read_ahead([(str(p), 10, STEP + 1), (str(p), 2 * STEP + 7, 3)], budget=STEP + 4) is True
    assert done.wait(10)
    rp = os.path.realpath(p)
    assert [c[:3] for c in calls] == [(rp, 10, STEP), (rp, STEP + 10, 1), (rp, 2 * STEP + 7, 3)]
    assert read_ahead([(str(p), 0, STEP + 5)], budget=STEP + 4) is False  # parts count, not files


def test_merged_joins_close_parts_of_one_file_in_order():
    spans = [("a", 0, 10), ("a", 12, 3), ("a", 20, 5), ("b", 25, 1), ("b", 0, 4), ("a", 25, 1)]
    assert readahead.merged(spans, gap=2) == [
        ("a", 0, 15), ("a", 20, 5), ("b", 25, 1), ("b", 0, 4), ("a", 25, 1)]
    assert readahead.merged(spans, gap=5) == [
        ("a", 0, 25), ("b", 25, 1), ("b", 0, 4), ("a", 25, 1)]
    assert readahead.merged([], gap=5) == []


def test_consolidate_reads_ahead_its_model_records_only(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from ckptool.format.metadata import read_metadata
    from ckptool.ops import chunk_copier
    from ckptool.ops.consolidate import consolidate
    from ckptool.storage import Storage
    from tests.unit.test_consolidate import _model, _save
    import torch

    ck = _save(tmp_path / "step_1", {"model": _model(), "optim": {"m": torch.ones(64, 64)}})
    asked = []
    monkeypatch.setattr(chunk_copier, "read_ahead", lambda spans: asked.append(spans) or True)
    monkeypatch.setattr(chunk_copier, "_GAP", 0)  # records joined only where they touch
    consolidate(ck, tmp_path / "m.safetensors")
    meta = read_metadata(Storage(str(ck)))
    ranges = {fqn: [(ck / c.storage.relative_path, c.storage.offset, c.storage.length)
                    for c in t.chunks if c.storage is not None and c.numel]  # (empty: not read)
              for fqn, t in meta.tensors.items()}
    [spans] = asked

    def covered(parts):
        return {(str(p), b) for p, o, n in parts for b in range(o, o + n)}

    model = covered(r for fqn, rs in ranges.items() if fqn.startswith("model.") for r in rs)
    assert covered(spans) == model and model
    assert not covered(ranges["optim.m"]) & covered(spans)
