"""consolidate's local in-kernel copies run in one lane, beside the CRC checks.

Copies into one output file queue on its inode lock; two threads copying at once spun on it
(11% of consolidate's CPU on a 2.2 GB, 8-file checkpoint). Whatever the worker count, at most
one ``copy_file_range`` runs at a time, while the source's CRC-32s are still checked, and
the export stays exact.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from ckptool.format.safetensors_writer import OutputFile  # noqa: E402
from ckptool.ops.consolidate import consolidate  # noqa: E402
from ckptool.ops.reshard import reshard  # noqa: E402
from factory import make_single_checkpoint  # noqa: E402


def test_one_copy_at_a_time_checks_still_run_and_the_export_is_exact(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(11)
    tensors = {f"w{i}": torch.randn(96, 32, generator=g) for i in range(4)}
    make_single_checkpoint(tmp_path / "one", tensors)
    src = reshard(tmp_path / "one", tmp_path / "four", world_size=4).destination

    lock, running, most = threading.Lock(), [0], [0]
    original = OutputFile.copy_from

    def counted(self, *args):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.002)  # long enough for a second lane to overlap, if there were one
        try:
            return original(self, *args)
        finally:
            with lock:
                running[0] -= 1

    checked = []
    from ckptool.ops import chunk_copier

    original_check = chunk_copier.Copier._check_crc
    monkeypatch.setattr(chunk_copier.Copier, "_check_crc",
                        lambda self, *a: (checked.append(1), original_check(self, *a))[1])
    monkeypatch.setattr(OutputFile, "copy_from", counted)
    consolidate(src, tmp_path / "out.safetensors", workers=4)
    assert most[0] == 1
    assert len(checked) == 4 * len(tensors)  # every source record's CRC-32
    got = load_file(tmp_path / "out.safetensors")
    for k, v in tensors.items():
        assert torch.equal(got[k], v), k
