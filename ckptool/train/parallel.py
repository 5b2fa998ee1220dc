"""FSDP2 for the built-in model: device mesh, activation checkpointing, ``fully_shard``, checks.

Owns how the model is split over ranks (seeds 000 and 004): each ``Block`` is its own FSDP unit
(innermost first), then the root; ``reshard_after_forward`` on for every block but the last;
activation checkpointing applied *before* ``fully_shard``; one ``MixedPrecisionPolicy`` for
every unit. It also measures what each rank holds (``state_bytes``). It leaves the training
step to ``loop.py`` and saving to ``ckptool.checkpoint``.

Strategies (``--sharding``), on a world of ``ws`` ranks:

==========  =====================  ==========================================================
full        FULL_SHARD             1-D mesh (ws,); params, grads, optimizer state 1/ws each
grad-op     SHARD_GRAD_OP          1-D mesh; params stay gathered between forward and backward
none        NO_SHARD (DDP-like)    2-D mesh (ws, 1): replicate over ws, shard over 1 (HSDP)
hybrid      HYBRID_SHARD (HSDP)    2-D mesh (ws / s, s): shard within groups of s, replicate
==========  =====================  ==========================================================
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ckptool.errors import ConfigError

logger = logging.getLogger(__name__)


def hybrid_shard_size(world_size: int, requested: int | None = None) -> int:
    """Ranks per shard group for HSDP: ``requested``, else the ranks of one node when the job
    spans several nodes, else ``world_size // 2`` for an even world of 4 or more, else all."""
    if requested is not None:
        return requested
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if 0 < local < world_size and world_size % local == 0:
        return local
    if world_size >= 4 and world_size % 2 == 0:
        return world_size // 2
    return world_size


def build_mesh(sharding: str, world_size: int, device_type: str, *,
               shard_size: int | None = None) -> DeviceMesh:
    """The device mesh for a strategy (called on all ranks).

    Raises:
        ConfigError: ``shard_size`` does not divide the world size.
    """
    if sharding in ("full", "grad-op"):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    shard = 1 if sharding == "none" else hybrid_shard_size(world_size, shard_size)
    if world_size % shard:
        raise ConfigError(f"--hybrid-shard-size {shard} does not divide {world_size} ranks",
                          hint="Pass --hybrid-shard-size that divides --nproc")
    return init_device_mesh(device_type, (world_size // shard, shard),
                            mesh_dim_names=("replicate", "shard"))


# -- DeviceMesh across processes ------------------------------------------------------------
# An async save pickles the staged state (DTensors, hence their DeviceMesh) into DCP's
# background process, where DeviceMesh.__setstate__ looks up the mesh's process groups by
# name. The sub-groups of a 2-D (hybrid / none) mesh do not exist there, so torch logs "It
# seems like pickling/unpickling of the DeviceMesh occurred before the PGs were created" once
# per mesh dimension, per rank, per save: harmless there (that process only writes the local
# shards), but 8 lines per save on 4 ranks. Meshes sent to another process are rebuilt with
# that one message dropped; every other log record passes.
_PG_WARNING = "It seems like pickling/unpickling of the DeviceMesh occurred before the PGs were created"


class _DropPgLookupWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_PG_WARNING)


def _rebuild_mesh(cls: type, state: dict[str, Any]) -> DeviceMesh:
    mesh = cls.__new__(cls)
    mesh_logger = logging.getLogger("torch.distributed.device_mesh")
    quiet = _DropPgLookupWarning()
    mesh_logger.addFilter(quiet)
    try:
        mesh.__setstate__(state)
    finally:
        mesh_logger.removeFilter(quiet)
    return mesh


def _reduce_mesh(mesh: DeviceMesh) -> tuple[Any, tuple[Any, ...]]:
    return _rebuild_mesh, (type(mesh), mesh.__getstate__())


def quiet_mesh_pickling() -> None:
    """Send ``DeviceMesh`` objects to other processes (``multiprocessing`` pipes and queues,
    e.g. DCP's async-save process) so that unpickling them there logs no PG-lookup warning.
    Idempotent; affects only pickles made by ``multiprocessing``'s ``ForkingPickler``."""
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler.register(DeviceMesh, _reduce_mesh)


def mp_policy(precision: str) -> MixedPrecisionPolicy:
    """bf16: compute in bfloat16, reduce gradients in float32 (fp32 master weights stay
    sharded); fp32: no casts."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap blocks in ``checkpoint_wrapper`` (non-reentrant); must run before ``fully_shard``.

    ``every`` wraps every block, ``every-2`` blocks 0, 2, 4, ...; ``none`` does nothing. The
    wrapper does not change ``state_dict()`` keys, so checkpoints load with any setting.
    """
    if mode == "none":
        return
    from ckptool.train.torch_private import checkpoint_wrapped

    step = 1 if mode == "every" else 2
    for i in range(0, len(model.blocks), step):
        model.blocks[i] = checkpoint_wrapped(model.blocks[i])


def shard_model(model: nn.Module, mesh: DeviceMesh, *, sharding: str = "full", precision: str = "fp32",
                cpu_offload: bool = False, wrap_blocks: bool = True,
                blocks: list[nn.Module] | None = None) -> None:
    """``fully_shard`` every block, then the root (called on all ranks).

    Args:
        model: a model with ``model.blocks`` (an ``nn.ModuleList``), possibly AC-wrapped.
        mesh: from ``build_mesh``.
        sharding: full, grad-op, none or hybrid.
        precision: bf16 or fp32 (one policy for every unit, so they cannot disagree).
        cpu_offload: ``CPUOffloadPolicy`` for every unit.
        wrap_blocks: False wraps only the root; exists so ``check_wrapping`` can be tested.
        blocks: the blocks of a model without ``model.blocks`` (the decoder layers of a
            transformers model, ``hf_model.py``), in order.

    Example:
        >>> mesh = build_mesh("full", 2, "cpu")
        >>> shard_model(model, mesh)
        >>> check_wrapping(model)
    """
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    kw: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy(precision), "offload_policy": offload}
    blocks = list(model.blocks) if blocks is None else blocks
    last = len(blocks) - 1
    if wrap_blocks:
        for i, block in enumerate(blocks):
            # The last block is gathered again right away by backward: keep it resident.
            reshard = sharding in ("full", "hybrid") and i < last
            fully_shard(block, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=False, **kw)


def check_wrapping(model: nn.Module, blocks: list[nn.Module] | None = None) -> None:
    """Fail fast on the configuration mistakes of seed 000 (called on all ranks).

    Raises:
        ConfigError: no block is its own FSDP unit (only the root was wrapped, so every
            parameter is gathered at once and sharding saves nothing), or the sharded
            parameters are not float32 (the master copy must stay fp32; bf16 belongs in the
            mixed-precision policy).
    """
    blocks = list(getattr(model, "blocks", [])) if blocks is None else blocks
    units = sum(isinstance(b, FSDPModule) for b in blocks)
    if units == 0:
        raise ConfigError(
            f"no transformer block is its own FSDP unit (0 of {len(blocks)}): only the root is "
            "wrapped, so all parameters are gathered at once and sharding saves no memory",
            hint="Call fully_shard on each block of model.blocks before the root",
        )
    if not isinstance(model, FSDPModule):
        raise ConfigError("the root module is not wrapped by fully_shard",
                          hint="Call fully_shard(model) after the blocks")
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise ConfigError(
            f"sharded parameters are {sorted(map(str, dtypes))}, expected torch.float32 master weights",
            hint="Keep the model in fp32 and use --mixed-precision bf16 for bf16 compute",
        )


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state that THIS rank holds (local shards).

    Exact sums of ``numel * element_size`` over local shards; gradients count only where
    they exist (call after backward, before ``zero_grad``).
    """
    params = list(model.parameters())
    out = {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optim": 0,
    }
    if optimizer is not None:
        out["optim"] = sum(_local_bytes(v) for st in optimizer.state.values()
                           for v in st.values() if isinstance(v, torch.Tensor))
    return out
