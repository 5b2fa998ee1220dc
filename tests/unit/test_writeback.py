"""storage/writeback.py: early writeback is started on its own thread, so a writer never
waits on the disk's queue; it never holds more than MAX_PENDING requests, and a writer whose
request is declined asks again for the range grown, so nothing is skipped."""

from __future__ import annotations

import os
import threading

from ckptool.format import dcp_writer
from ckptool.format.dcp_writer import DistcpFile
from ckptool.storage import BLOCK, writeback
from ckptool.storage.writeback import MAX_PENDING, WRITEBACK_MIN, start_writeback


def _blocking_fadvise(monkeypatch):
    """A fresh writeback thread whose posix_fadvise records its calls (and the thread making
    them) and waits for ``release`` (a disk that is busy)."""
    calls, release, started = [], threading.Event(), threading.Event()

    def fadvise(fd, offset, length, advice):
        calls.append((os.fstat(fd).st_ino, offset, length, advice, threading.current_thread()))
        started.set()
        release.wait(10)

    monkeypatch.setattr(writeback.os, "posix_fadvise", fadvise)
    monkeypatch.setattr(writeback, "_THREAD", writeback._WritebackThread())
    return calls, release, started


def test_the_writer_does_not_wait_and_may_close_its_file_at_once(tmp_path, monkeypatch):
    calls, release, started = _blocking_fadvise(monkeypatch)
    path = tmp_path / "f"
    path.write_bytes(b"x" * WRITEBACK_MIN)
    fd = os.open(path, os.O_RDONLY)
    ino = os.fstat(fd).st_ino
    assert start_writeback(fd, 0, WRITEBACK_MIN) is True  # returns while the disk is busy
    os.close(fd)
    assert started.wait(10)
    release.set()
    assert calls[0][:4] == (ino, 0, WRITEBACK_MIN, os.POSIX_FADV_DONTNEED)  # on its duplicate
    assert calls[0][4] is not threading.current_thread()


def test_requests_beyond_max_pending_are_declined_until_it_catches_up(tmp_path, monkeypatch):
    calls, release, started = _blocking_fadvise(monkeypatch)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        assert start_writeback(fd, 0, WRITEBACK_MIN)
        assert started.wait(10)  # the thread holds one; MAX_PENDING - 1 more may wait
        accepted = [start_writeback(fd, i, WRITEBACK_MIN) for i in range(MAX_PENDING + 5)]
        assert accepted == [True] * (MAX_PENDING - 1) + [False] * 6
        assert start_writeback(fd, 0, WRITEBACK_MIN - 1) is True  # too short: left alone
        release.set()
        deadline = threading.Event()
        while len(calls) < MAX_PENDING and not deadline.wait(0.01):
            pass
        assert start_writeback(fd, 7, WRITEBACK_MIN)  # caught up: accepted again
    finally:
        release.set()
        os.close(fd)


def test_a_declined_range_is_asked_again_grown(tmp_path, monkeypatch):
    asked: list[tuple[int, int, bool]] = []

    def every_other(fd, offset, length):
        ok = len(asked) % 2 == 1
        asked.append((offset, length, ok))
        return ok

    monkeypatch.setattr(dcp_writer, "start_writeback", every_other)
    with DistcpFile(tmp_path / "f.distcp") as f:
        for _ in range(9):
            f.write(b"\1" * (BLOCK // 2 + 3))
    accepted = [(o, n) for o, n, ok in asked if ok]
    assert accepted and accepted[0][0] == 0
    for (o1, n1), (o2, _) in zip(accepted, accepted[1:]):
        assert o2 == o1 + n1  # no gap: a declined range is part of the next one asked
    assert all(o == 0 for o, _, ok in asked[:2])  # the first, declined, asked again from 0
