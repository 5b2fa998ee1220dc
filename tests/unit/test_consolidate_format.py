"""The safetensors writer and the numpy casts: byte-exact with safetensors, bit-exact with torch."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from ckptool.errors import CkptError, CorruptCheckpointError
from ckptool.format.dtypes import DTYPES
from ckptool.format.safetensors_source import read_header
from ckptool.storage import Storage
from ckptool.format.safetensors_writer import (OutputFile, TensorSpec, cast_bytes, index_json,
                                               plan_file, shard_filenames,
                                               split_shards)

F32, BF16, F16, F64 = (DTYPES[n] for n in ("float32", "bfloat16", "float16", "float64"))


def test_header_is_byte_identical_to_safetensors():
    from safetensors.torch import save

    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    lay = plan_file("x", [TensorSpec("w", F32, (2, 3))], {"format": "pt"})
    assert lay.header + t.numpy().tobytes() == save({"w": t}, metadata={"format": "pt"})
    assert lay.offsets == {"w": len(lay.header)} and len(lay.header) % 8 == 0


def test_output_file_places_tensors_in_any_order(tmp_path):
    from safetensors import safe_open

    specs = [TensorSpec("a", F32, (3,)), TensorSpec("empty", F32, (0, 4)),
                  TensorSpec("s", BF16, ()), TensorSpec("b", DTYPES["int64"], (2, 2))]
    lay = plan_file("m.safetensors", specs, {"format": "pt", "source_step": "7"})
    vals = {"a": torch.tensor([1.0, 2.0, 3.0]), "empty": torch.zeros(0, 4),
            "s": torch.tensor(1.5, dtype=torch.bfloat16), "b": torch.arange(4).reshape(2, 2)}
    path = tmp_path / "m.safetensors"
    with OutputFile(path, lay, track=True) as out:
        for name in ("b", "s", "a"):  # reverse order: positions come from the plan
            out.pwrite(vals[name].view(-1).view(torch.uint8).numpy().tobytes(), lay.offsets[name])
    out.verify()
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt", "source_step": "7"}
        for name, v in vals.items():
            assert torch.equal(f.get_tensor(name), v)
    header = read_header(Storage.open(path.parent), path.name)
    assert header.header_bytes % 8 == 0 and header.tensors["a"].start == header.header_bytes


def test_verify_catches_bytes_changed_on_disk(tmp_path):
    lay = plan_file("m", [TensorSpec("a", F32, (4,))])
    path = tmp_path / "m.safetensors"
    with OutputFile(path, lay, track=True) as out:
        out.pwrite(b"\x01" * 16, lay.offsets["a"])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CkptError, match="verify failed"):
        out.verify()


def test_plan_refuses_duplicates_and_non_string_metadata():
    with pytest.raises(CkptError, match="appears twice"):
        plan_file("m", [TensorSpec("a", F32, (1,)), TensorSpec("a", F32, (1,))])
    with pytest.raises(CkptError, match="str to str"):
        plan_file("m", [TensorSpec("a", F32, (1,))], {"step": 3})  # type: ignore[dict-item]


def test_split_shards_follows_huggingface_rule():
    sizes = [40, 40, 30, 250, 10, 10]  # uint8 elements, so also bytes
    specs = [TensorSpec(f"t{i}", DTYPES["uint8"], (n,)) for i, n in enumerate(sizes)]
    groups = split_shards(specs, 100)
    assert [[t.name for t in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert shard_filenames(1) == ["model.safetensors"]
    assert shard_filenames(3)[1] == "model-00002-of-00003.safetensors"
    lays = [plan_file(n, g) for n, g in zip(shard_filenames(len(groups)), groups)]
    index = json.loads(index_json(lays))
    assert index["metadata"] == {"total_size": sum(sizes)}
    assert index["weight_map"]["t3"] == "model-00003-of-00004.safetensors"


# ---------------------------------------------------------------------------------------------
# Casts


def _f32_patterns(n: int = 1 << 20) -> np.ndarray:
    """Random bit patterns plus the cases rounding gets wrong: ties, carries, inf, NaN, subnormals."""
    rng = np.random.default_rng(0)
    special = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
               0xFF812345, 0x7FFFFFFF, 0x00000001, 0x807FFFFF, 0x00008000, 0x00018000,
               0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0x7F7F8000, 0x477FF000,
               0x477FE000, 0x33800000, 0x33000001, 0x38800000, 0x387FC000]
    u = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 1 << 16, size=4096, dtype=np.uint32) << 16) | 0x8000
    return np.concatenate([np.array(special, np.uint32), u, ties]).view(np.float32)


def _same(ours: np.ndarray, theirs: np.ndarray, as_float: np.dtype) -> None:
    """Bitwise equal everywhere except NaN, where both must be NaN (torch's own NaN bits differ
    between its scalar and SIMD kernels)."""
    nan = np.isnan(theirs.view(as_float).astype(np.float32))
    assert np.array_equal(np.isnan(ours.view(as_float).astype(np.float32)), nan)
    assert np.array_equal(ours[~nan], theirs[~nan])


def _torch_bits(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    t = torch.from_numpy(x.copy()).to(dtype)
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()


def _bf16_as_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_float32_to_bfloat16_and_float16_match_torch_bit_for_bit():
    x = _f32_patterns()
    bf = np.frombuffer(cast_bytes(x.tobytes(), F32, BF16), np.int16)
    theirs = _torch_bits(x, torch.bfloat16)
    nan = np.isnan(x)
    assert np.array_equal(bf[~nan], theirs[~nan]) and np.all(np.isnan(_bf16_as_f32(bf[nan])))
    h = np.frombuffer(cast_bytes(x.tobytes(), F32, F16), np.int16)
    _same(h, _torch_bits(x, torch.float16), np.float16)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_other_casts_match_torch():
    x = _f32_patterns(1 << 16)
    bf_bits = _torch_bits(x, torch.bfloat16)
    f16_bits = _torch_bits(x, torch.float16)
    bf_t = torch.from_numpy(bf_bits.copy()).view(torch.bfloat16)
    f16_t = torch.from_numpy(f16_bits.copy()).view(torch.float16)
    cases = [(bf_bits, BF16, F32, bf_t, torch.float32), (bf_bits, BF16, F16, bf_t, torch.float16),
             (f16_bits, F16, F32, f16_t, torch.float32), (f16_bits, F16, BF16, f16_t, torch.bfloat16)]
    for raw, src, dst, t, tdt in cases:
        ours = np.frombuffer(cast_bytes(raw.tobytes(), src, dst), np.int32 if dst == F32 else np.int16)
        theirs = t.to(tdt).view(torch.int32 if dst == F32 else torch.int16).numpy()
        nan = np.isnan(t.float().numpy())
        assert np.array_equal(ours[~nan], theirs[~nan]), (src, dst)
    rng = np.random.default_rng(1)
    d = rng.standard_normal(1 << 16) * np.exp(rng.uniform(-100, 100, 1 << 16))
    d[:3] = [1 + 2**-24 + 2**-60, 65520.0, 1.0000000596046448]  # double-rounding traps
    for dst, tdt in ((F32, torch.float32), (BF16, torch.bfloat16), (F16, torch.float16)):
        ours = np.frombuffer(cast_bytes(d.tobytes(), F64, dst), np.int32 if dst == F32 else np.int16)
        theirs = torch.from_numpy(d).to(tdt).view(torch.int32 if dst == F32 else torch.int16).numpy()
        assert np.array_equal(ours, theirs), dst


def test_cast_to_same_dtype_is_the_identity():
    raw = struct.pack("<3f", 1.0, 2.0, 3.0)
    assert bytes(cast_bytes(raw, F32, F32)) == raw


@pytest.mark.parametrize("errno_name", ["EXDEV", "ENOSYS", None])
def test_copy_from_falls_back_to_buffered_copy(tmp_path, monkeypatch, errno_name):
    import errno
    import os

    if errno_name is not None:  # the kernel or file system refuses in-kernel copies
        def refuse(*_args, **_kwargs):
            raise OSError(getattr(errno, errno_name), os.strerror(getattr(errno, errno_name)))
        monkeypatch.setattr(os, "copy_file_range", refuse)
    payload = bytes(range(256)) * 40_000  # ~10 MB: more than one 8 MiB block
    src = tmp_path / "src.bin"
    src.write_bytes(b"junk" + payload)
    lay = plan_file("m", [TensorSpec("a", DTYPES["uint8"], (len(payload),))])
    fd = os.open(src, os.O_RDONLY)
    try:
        with OutputFile(tmp_path / "m.safetensors", lay) as out:
            out.copy_from(fd, 4, len(payload), lay.offsets["a"])
            with pytest.raises(CorruptCheckpointError, match="source ends"):
                out.copy_from(fd, 4, len(payload) + 10, lay.offsets["a"])
    finally:
        os.close(fd)
    assert (tmp_path / "m.safetensors").read_bytes() == lay.header + payload
