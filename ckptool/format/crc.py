"""CRC-32, the checksum of every entry of a ``torch.save`` record (and so of every DCP item).

``crc32`` is ISA-L's (about 5x zlib's speed here, same values); ``crc32_combine`` joins the
CRCs of adjacent pieces without reading them again (zlib's, which Python's zlib does not
expose), so a copy checks a source record it reads in pieces, and a verification derives a
whole tensor's CRC from its records'.
"""

from __future__ import annotations

import functools

try:  # ISA-L's CRC-32 is ~5x faster than zlib's here (docs/BENCHMARKS.md); same values
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency, but stay usable without it
    from zlib import crc32

__all__ = ["crc32", "crc32_combine"]


_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


@functools.lru_cache(maxsize=4096)
def _x8nmodp(n: int) -> int:
    """x^(8n) mod P: the operator that shifts a CRC over n zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's algorithm).

    Args:
        crc1, crc2: CRC-32 of the first and second piece.
        len2: length of the second piece in bytes.

    Returns:
        ``zlib.crc32(A + B)``, without reading either piece.

    Example:
        >>> crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b"cd"), 2) == zlib.crc32(b"abcd")
        True
    """
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2
