"""write_rank_files(prefetch=...): each file's writer asks for the sources of its next items
ahead of copying them (a cold source is then read while earlier items copy), every item
before it is written, and no more than PREFETCH_AHEAD bytes ahead."""

from __future__ import annotations

import json
import os
import struct

import pytest

from ckptool.format.copy_engine import Ticker
from ckptool.format.dcp_output import PREFETCH_AHEAD, write_rank_files, write_tensor
from ckptool.format.dtypes import DTYPES

F32 = DTYPES["float32"]
SIZE = PREFETCH_AHEAD * 3 // 8  # what each item's source is said to hold: 3 items fill it


def test_items_are_asked_for_ahead_within_the_budget(tmp_path):
    events = []

    def write(f, item, buf):
        events.append(("write", item))
        write_tensor(f, F32, (1,), [[struct.pack("<f", item)]], lambda n: None, buf)

    def prefetch(item):
        events.append(("ask", item))
        return SIZE

    items = list(range(10))
    write_rank_files(tmp_path, [items], write, ticker=Ticker(None, 0), workers=1,
                     prefetch=prefetch)
    asked = [i for e, i in events if e == "ask"]
    assert asked == items  # each once, in order
    for k in items:
        at = events.index(("write", k))
        ahead = [i for e, i in events[:at] if e == "ask" and i > k]
        assert k in [i for e, i in events[:at] if e == "ask"]  # asked before it is written
        # asked and not yet written, item k included: PREFETCH_AHEAD bytes, less than an
        # item more
        want = min(len(items) - k - 1, -(-PREFETCH_AHEAD // SIZE) - 1)
        assert len(ahead) == want


def test_import_asks_for_every_rank_s_rows_before_copying(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from ckptool.ops import import_hf as imp

    src = tmp_path / "m"
    src.mkdir()
    tensors = {f"w{i}": torch.randn(16, 8) for i in range(3)}
    save_file(tensors, src / "model.safetensors")
    asked = []
    real = os.posix_fadvise

    def record(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(imp.os, "posix_fadvise", record)
    monkeypatch.setattr(imp, "read_ahead", lambda paths: False)  # as for a source too big
    imp.import_hf(src, tmp_path / "out", world_size=4, dtype="keep")
    blob = (src / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(blob[:8], "little")
    meta = json.loads(blob[8:header])
    path = os.path.realpath(src / "model.safetensors")
    for name in tensors:
        lo, hi = meta[name]["data_offsets"]
        rows = [(path, header + lo + r * (hi - lo) // 4, (hi - lo) // 4) for r in range(4)]
        assert all(r in asked for r in rows), name


def test_import_never_asks_for_an_empty_shard_s_rows(tmp_path, monkeypatch):
    # posix_fadvise with a length of 0 means "to the end of the file"
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from ckptool.ops import import_hf as imp

    src = tmp_path / "m"
    src.mkdir()
    save_file({"small": torch.randn(2, 4), "big": torch.randn(64, 4)}, src / "model.safetensors")
    lengths = []
    real = os.posix_fadvise

    def record(fd, offset, length, advice):
        lengths.append(length)
        real(fd, offset, length, advice)

    monkeypatch.setattr(imp.os, "posix_fadvise", record)
    monkeypatch.setattr(imp, "read_ahead", lambda paths: False)  # the per-rank prefetch only
    imp.import_hf(src, tmp_path / "out", world_size=4, dtype="keep")  # ranks 2, 3: no rows of small
    assert lengths and 0 not in lengths


@pytest.mark.parametrize("whole", [True, False])
def test_import_prefetches_per_rank_only_when_the_source_is_not_read_whole(tmp_path, monkeypatch,
                                                                         whole):
    import numpy as np
    from safetensors.numpy import save_file

    from ckptool.ops import import_hf as imp

    src = tmp_path / "m"
    src.mkdir()
    save_file({"w": np.ones((8, 2), np.float32)}, str(src / "model.safetensors"))
    seen = []
    real = imp.write_rank_files

    def spy(*args, **kwargs):
        seen.append(kwargs["prefetch"])
        return real(*args, **kwargs)

    monkeypatch.setattr(imp, "read_ahead", lambda paths: whole)
    monkeypatch.setattr(imp, "write_rank_files", spy)
    imp.import_hf(src, tmp_path / "out", world_size=2)
    assert (seen[0] is None) is whole
