"""Element conversion between float dtypes on raw little-endian bytes (numpy, torch-free).

Owns ``cast_bytes``: bit-exact with torch's ``.to()`` for every non-NaN value, used by
consolidate (``--dtype``) and import to write another dtype than the source holds.
"""

from __future__ import annotations

from typing import Any

from ckptool.format.dtypes import DType


#: Dtypes ``cast_bytes`` converts between.
CASTABLE = ("float64", "float32", "float16", "bfloat16")


def cast_bytes(raw: bytes | memoryview, src: DType, dst: DType) -> memoryview:
    """Convert little-endian ``src`` elements to ``dst`` (both in ``CASTABLE``), torch-free.

    Rounding is round-to-nearest-even, as torch does; float64 goes through float32 first,
    as torch's double -> half/bfloat16 kernels do. NaN becomes a quiet NaN: 0x7FC0 for
    bfloat16 (c10's reference conversion; torch's AVX2/AVX-512 kernels give 0xFFFF) and the
    F16C pattern (sign, quiet bit, top payload bits) for float16, as torch's kernels give.

    Args:
        raw: whole elements of ``src``.
        src, dst: source and target dtypes.

    Returns:
        The converted elements as bytes (``raw`` itself when ``src == dst``).

    Example:
        >>> bytes(cast_bytes(struct.pack("<f", 1.0), DTYPES["float32"], DTYPES["bfloat16"]))
        b'\\x80?'
    """
    if src == dst:
        return memoryview(raw)
    import numpy as np

    x = _to_float32(np, raw, src)
    if dst.name == "float32":
        out = x
    elif dst.name == "bfloat16":
        u = x.view(np.uint32)
        out = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
        out[np.isnan(x)] = 0x7FC0
    else:
        with np.errstate(over="ignore"):
            out = x.astype(np.float16).view(np.uint16)
        nan = np.isnan(x)
        if nan.any():
            u = x.view(np.uint32)[nan]
            out[nan] = ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF)
    return memoryview(np.ascontiguousarray(out)).cast("B")


def _to_float32(np: Any, raw: bytes | memoryview, src: DType) -> Any:
    if src.name == "bfloat16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    if src.name == "float32":
        return np.frombuffer(raw, np.float32)
    if src.name == "float16":
        return np.frombuffer(raw, np.float16).astype(np.float32)
    with np.errstate(over="ignore"):
        return np.frombuffer(raw, np.float64).astype(np.float32)
