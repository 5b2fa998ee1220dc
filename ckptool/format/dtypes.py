"""Tensor dtypes as plain data: torch name <-> item size <-> safetensors code <-> numpy.

Torch-free. ``DTYPES`` is the allow-list: a dtype not in it is refused by the readers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str            # torch attribute name: "float32", "bfloat16", ...
    itemsize: int
    safetensors: str     # safetensors header code: "F32", "BF16", ...
    storage: str         # legacy torch storage class name used inside torch.save records
    is_floating: bool

    def __str__(self) -> str:
        return self.name


_TABLE = [
    DType("float64", 8, "F64", "DoubleStorage", True),
    DType("float32", 4, "F32", "FloatStorage", True),
    DType("float16", 2, "F16", "HalfStorage", True),
    DType("bfloat16", 2, "BF16", "BFloat16Storage", True),
    DType("float8_e4m3fn", 1, "F8_E4M3", "Float8_e4m3fnStorage", True),
    DType("float8_e5m2", 1, "F8_E5M2", "Float8_e5m2Storage", True),
    DType("int64", 8, "I64", "LongStorage", False),
    DType("int32", 4, "I32", "IntStorage", False),
    DType("int16", 2, "I16", "ShortStorage", False),
    DType("int8", 1, "I8", "CharStorage", False),
    DType("uint8", 1, "U8", "ByteStorage", False),
    DType("uint16", 2, "U16", "UInt16Storage", False),
    DType("uint32", 4, "U32", "UInt32Storage", False),
    DType("uint64", 8, "U64", "UInt64Storage", False),
    DType("bool", 1, "BOOL", "BoolStorage", False),
    DType("complex64", 8, "C64", "ComplexFloatStorage", False),
]

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}
# torch also exposes aliases (torch.float is torch.float32, ...); pickles use the canonical name,
# but accept the aliases so hand-made files read too.
_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64",
            "int": "int32", "short": "int16", "cfloat": "complex64"}
for _alias, _canon in _ALIASES.items():
    DTYPES[_alias] = DTYPES[_canon]
BY_STORAGE: dict[str, DType] = {d.storage: d for d in _TABLE}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _TABLE}

# Floating dtypes a user may cast to on export.
CAST_TARGETS = ("float32", "bfloat16", "float16")


def numpy_dtype(d: DType):  # -> numpy.dtype; bf16 has no numpy dtype, returns uint16 view
    import numpy as np

    special = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8,
               "bool": np.bool_}
    if d.name in special:
        return np.dtype(special[d.name])
    return np.dtype(d.name)
