"""Early writeback of what a writer has just written, started by one background thread.

A writer of a large file hands each block it has written to ``start_writeback``; a thread of
its own asks Linux to start writing those pages to disk (``POSIX_FADV_DONTNEED`` on dirty
pages starts their writeback, ``WB_SYNC_NONE``, and drops only pages already clean). The disk
then writes while the writers copy on, and each ``fsync`` at the end has the last blocks
left, not the whole file; left alone, the kernel starts writing at 10% of RAM dirty: not at
all for a 2 GB output here. Durability is still the ``fsync``'s.

The call is made on its own thread because it can block: it queues the pages' I/O, and
while the disk flushes its cache (an ``fsync`` of a finished file, other processes) the
queue is full. Made by the writers themselves, that stalled every copy for the length of a
flush (a disk trace of ``import`` showed 1.25 s with all 4 workers blocked and no I/O).
"""

from __future__ import annotations

import os
import queue
import threading

#: Ranges shorter than this are left to the kernel.
WRITEBACK_MIN = 1 << 20
#: Requests waiting for the thread at most (each holds a duplicated file descriptor); more
#: are declined until it catches up.
MAX_PENDING = 64
_ADVISE = hasattr(os, "posix_fadvise")


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Have the disk start writing these just-written bytes of ``fd``, without waiting.

    ``fd`` may be closed as soon as this returns (the request holds a duplicate of it).

    Returns:
        False when declined because ``MAX_PENDING`` requests are waiting (the disk is behind):
        a writer that appends may ask again later for the range extended; True otherwise
        (also for a range under ``WRITEBACK_MIN``, or a platform without ``posix_fadvise``,
        where nothing is done).
    """
    if length < WRITEBACK_MIN or not _ADVISE:
        return True
    return _THREAD.submit(fd, offset, length)


class _WritebackThread:
    """The process's one writeback thread, started on first use (again in a forked child)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._queue: queue.SimpleQueue[tuple[int, int, int]] = queue.SimpleQueue()
        self._slots = threading.Semaphore(MAX_PENDING)

    def submit(self, fd: int, offset: int, length: int) -> bool:
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: no thread here yet
                self._pid = os.getpid()
                self._queue, self._slots = queue.SimpleQueue(), threading.Semaphore(MAX_PENDING)
                threading.Thread(target=_run, args=(self._queue, self._slots), daemon=True,
                                 name="ckptool-writeback").start()
            if not self._slots.acquire(blocking=False):
                return False
            try:
                self._queue.put((os.dup(fd), offset, length))
            except OSError:  # out of file descriptors: leave this range to the fsync
                self._slots.release()
                return False
        return True


def _run(requests: queue.SimpleQueue[tuple[int, int, int]], slots: threading.Semaphore) -> None:
    while True:
        fd, offset, length = requests.get()
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)  # type: ignore[attr-defined]
        except OSError:  # a hint only: the fsync writes whatever it did not
            pass
        finally:
            os.close(fd)
            slots.release()


_THREAD = _WritebackThread()
