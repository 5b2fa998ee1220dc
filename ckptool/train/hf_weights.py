"""The weights of an ``--hf-model`` run: each rank reads its own rows of the safetensors files.

Owns the model's own tensor names (activation-checkpoint wrapper segments dropped), the tied
head, copying this rank's ``torch.chunk`` rows of every tensor from the file byte ranges
(8 MiB reads, cast to the parameter dtype on the way; peak memory: the shard plus one buffer)
and the random init when there are no weights. Headers are checked by ``format/hf_source.py``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ckptool.errors import ConfigError, IncompatibleCheckpointError
from ckptool.format.hf_source import HFSource, SourceTensor
from ckptool.train.torch_private import AC_SEGMENT as _AC_SEGMENT
from ckptool.train.torch_private import persistent_buffers, shard_offset

_BLOCK = 8 << 20


def model_names(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own names (wrapper segments dropped) of every parameter (a tied one once,
    under its first name) and persistent buffer."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name.replace(_AC_SEGMENT, "")] = p
    for mod_name, module in model.named_modules():
        for b_name, b in persistent_buffers(module):
            out[f"{mod_name}.{b_name}".lstrip(".").replace(_AC_SEGMENT, "")] = b
    return out


def _local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of ``t`` and the global index of its first row (dim-0 shards only)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.data, 0
    if any(not (p.is_replicate() or (p.is_shard() and p.dim == 0)) for p in t.placements):
        raise ConfigError(f"placements {t.placements} are not dim-0 shards; cannot read rows directly")
    offset = shard_offset(t)
    return t.to_local(), (offset[0] if offset else 0)


@torch.no_grad()
def load_weights(model: nn.Module, weights: HFSource, *, tied_head: str | None = None) -> int:
    """Copy this rank's rows of every tensor from the safetensors files (all ranks, no
    collective). Returns the bytes read by this rank.

    Raises:
        IncompatibleCheckpointError: a tensor the model has is missing, or its shape or dtype
            kind differs.
    """
    names = model_names(model)
    missing = [n for n in names if n not in weights.tensors and n != tied_head]
    if missing:
        raise IncompatibleCheckpointError(
            f"{weights.root} lacks {len(missing)} tensor(s) of {type(model).__name__}: {', '.join(missing[:5])}",
            path=weights.root, hint="Give the folder save_pretrained wrote for this architecture")
    done = 0
    for name, target in names.items():
        st = weights.tensors.get(name)
        if st is None:
            continue  # the tied head: it is the embedding's parameter
        if tuple(st.shape) != tuple(target.shape) or st.dtype.is_floating != target.dtype.is_floating_point:
            raise IncompatibleCheckpointError(
                f"{weights.root}: {name} is {st.dtype} {list(st.shape)}, the model's is "
                f"{str(target.dtype).removeprefix('torch.')} {list(target.shape)}", path=weights.root)
        local, row0 = _local_rows(target)
        done += _read_rows(st, row0, local)
    return done


def _read_rows(st: SourceTensor, row0: int, local: torch.Tensor) -> int:
    """Rows ``row0 ..`` of ``st`` into ``local`` (a contiguous row block), in 8 MiB reads."""
    if local.numel() == 0:
        return 0
    if not local.is_contiguous():
        raise ConfigError(f"{st.name}: the local shard is not contiguous")
    row_bytes = st.nbytes // st.shape[0] if st.shape else st.nbytes
    start = st.offset + row0 * row_bytes
    src_dtype = getattr(torch, st.dtype.name)
    flat = local.view(-1)
    raw = torch.empty(_BLOCK, dtype=torch.uint8)
    view = memoryview(raw.numpy())
    total = flat.numel() * st.dtype.itemsize
    fd = os.open(st.path, os.O_RDONLY)
    try:
        done = 0
        while done < total:
            want = min(_BLOCK, total - done)
            got = 0
            while got < want:
                n = os.preadv(fd, [view[got:want]], start + done + got)
                if n <= 0:
                    raise IncompatibleCheckpointError(f"{st.path} ended while reading {st.name} (changed meanwhile?)",
                                                      path=st.path)
                got += n
            items = want // st.dtype.itemsize
            first = done // st.dtype.itemsize
            flat[first:first + items].copy_(raw[:want].view(src_dtype))
            done += want
    finally:
        os.close(fd)
    return total


def tied_head(config: Any, model: nn.Module) -> str | None:
    """The name of the output embedding when it is tied to the input one (files store it once)."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or out.weight is not inp.weight:
        return None
    for name, module in model.named_modules():
        if module is out:
            return f"{name}.weight".replace(_AC_SEGMENT, "")
    return None


@torch.no_grad()
def random_init(model: nn.Module, seed: int) -> None:
    """The model's own ``_init_weights`` on every module, shard by shard.

    On CPU meshes DTensor random ops draw from each rank's generator: seeded here by the shard
    coordinate so that shards differ (identical rows would never learn apart) while
    replicas (HSDP) stay equal."""
    mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
    shard = mesh.get_local_rank(mesh.ndim - 1) if mesh is not None else 0
    torch.manual_seed(seed * 1_000_003 + shard)
    init = getattr(model, "_init_weights", None)
    for module in model.modules():
        if init is not None:
            init(module)
    torch.manual_seed(seed)
