"""The ``data.pkl`` of a ``torch.save`` record of one contiguous tensor, written without torch.

``tensor_pickle`` emits the protocol-2 pickle that torch's pickler writes for a tensor whose
storage holds exactly its elements (``_rebuild_tensor_v2`` with a typed storage class), byte
for byte: ``tests/unit/test_reshard_format.py`` compares whole records with ``torch.save``.
Used by ``dcp_writer.TensorRecord``.
"""

from __future__ import annotations

import math
import struct

from ckptool.format.dtypes import DType
from ckptool.format.torch_records import contiguous_strides


def _pkl_int(v: int) -> bytes:
    """An int as pickle's C/Python pickler writes it at protocol 2."""
    if 0 <= v <= 0xFF:
        return b"K" + bytes([v])
    if 0 <= v <= 0xFFFF:
        return b"M" + struct.pack("<H", v)
    if -0x80000000 <= v <= 0x7FFFFFFF:
        return b"J" + struct.pack("<i", v)
    raw = v.to_bytes((v.bit_length() >> 3) + 1, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _pkl_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(raw)) + raw


class _Memo:
    def __init__(self) -> None:
        self.n = 0

    def put(self) -> bytes:
        self.n += 1
        return b"q" + bytes([self.n - 1])


def _pkl_tuple(values: tuple[int, ...], memo: _Memo) -> bytes:
    if not values:
        return b")"  # pickle never memoizes the empty tuple
    body = b"".join(_pkl_int(v) for v in values)
    code = {1: b"\x85", 2: b"\x86", 3: b"\x87"}.get(len(values))
    return (body + code if code else b"(" + body + b"t") + memo.put()


def tensor_pickle(dtype: DType, shape: tuple[int, ...]) -> bytes:
    """``data.pkl`` of a contiguous tensor whose storage holds exactly its elements.

    Args:
        dtype: one of ``V2_DTYPES`` (its legacy storage class names the element type).
        shape: the tensor's shape (``()`` for a 0-dim tensor).

    Returns:
        The protocol-2 pickle ``torch.save`` writes: ``_rebuild_tensor_v2(storage, 0, shape,
        strides, False, OrderedDict())`` with storage persistent id ``('storage', <type>, '0',
        'cpu', numel)``.

    Example:
        >>> tensor_pickle(DTYPES["float32"], (2, 3))[:37]
        b'\\x80\\x02ctorch._utils\\n_rebuild_tensor_v2\\nq\\x00'
    """
    memo = _Memo()
    strides = contiguous_strides(shape)
    out = [b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n", memo.put(), b"((", _pkl_str("storage"),
           memo.put(), f"ctorch\n{dtype.storage}\n".encode(), memo.put(), _pkl_str("0"),
           memo.put(), _pkl_str("cpu"), memo.put(), _pkl_int(math.prod(shape)), b"t",
           memo.put(), b"Q", _pkl_int(0), _pkl_tuple(shape, memo), _pkl_tuple(strides, memo),
           b"\x89ccollections\nOrderedDict\n", memo.put(), b")R", memo.put(), b"t", memo.put(),
           b"R", memo.put(), b"."]
    return b"".join(out)


__all__ = ["tensor_pickle"]
