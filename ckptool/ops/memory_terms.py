"""The byte accounting of ``ckptool estimate``: what one rank holds, term by term; torch-free.

Owns the formulas below and the ``Plan`` they are applied to (one validated set of options);
checking the options, the verdict and the suggestions are ``estimate.py``'s. The numbers
describe what ``ckptool train`` (FSDP2, ``train/parallel.py``) holds, and the persistent state
terms are checked against what its ranks measure (``parallel.state_bytes``) in ``tests/dist``.

State per parameter (the persistent terms)
    FSDP2 keeps every sharded parameter in fp32, with or without ``--mixed-precision bf16``:
    ``MixedPrecisionPolicy(param_dtype=bf16)`` only casts the all-gathered *compute copy*. So
    the shards ARE the fp32 master weights (4 B), gradients are reduced in fp32 into fp32
    shards (4 B), and AdamW adds ``exp_avg`` and ``exp_avg_sq`` (8 B) plus a 4-byte ``step``
    per tensor (SGD with momentum: one 4 B buffer). AdamW: 16 B/param -- the classic
    "2 (bf16 params) + 2 (bf16 grads) + 12 (fp32 master + two moments)" regrouped; the bf16
    copies are the transient gathered term below, not state.

What each strategy divides by (N ranks; ``s`` = ranks per shard group)
    full-shard (FULL_SHARD)   params, grads, optimizer state / N
    grad-op (SHARD_GRAD_OP)   grads, optimizer state / N; params are kept whole *as the compute
                              copy* from forward to backward (FSDP2 still stores the fp32
                              master shards / N, which is what a rank measures)
    hybrid (HYBRID_SHARD)     all three / s, replicated over N / s groups
    ddp (NO_SHARD)            nothing
    FSDP2 splits each tensor along dim 0 into ``ceil(dim0 / N)`` rows per rank (the last ranks
    get fewer or none, but storage is padded to the full chunk), so with a model shape every
    term is ``sum over tensors of ceil(dim0 / N) * rest``: exact for rank 0 and for the
    allocation of every rank. With ``--params`` alone it is ``ceil(P / N)``.
    ``--cpu-offload`` moves all of the state to host memory.

Gathered (transient, never sharded; c = bytes of the compute dtype, 2 for bf16)
    Units are the root (embeddings, final norm, head: R params) and each block (K params).
    full-shard/hybrid: (R + 2K) * c (root stays gathered, one block computes, the next is
    prefetched); grad-op/ddp: (R + L*K) * c (no unit is resharded after forward). Plus the
    unsharded gradients of the root and one block, (R + K) * c, and the fp32 reduce-scatter
    input of one block, 4K.

Activations per rank (b = ceil(batch / N) sequences of T tokens, n = b*T; fused attention)
    one block, saved for backward:  n * ((8d + 2f) * c + 4h + 16)
        8d: norm1 in/out, q/k/v (one 3d tensor), attention out (= proj input), norm2 in/out;
        2f: GELU in and out; 4h: attention log-sum-exp (fp32); 16: LayerNorm mean/rstd (fp32)
    a checkpointed block keeps only its input, n * d * c, and one block is recomputed at a
    time in backward (+ one full block); ``every-2`` checkpoints blocks 0, 2, 4, ...
    head: n * ((2d + V) * c + 4V + 24) + 8T: final norm in/out, logits, fp32 log-probs, norm
    stats, token ids and targets, position ids.

Estimated peak = state on the GPU + gathered + activations: a slight over-estimate (gradients
and activations never peak together) that leaves out the CUDA context and fragmentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckptool.train.sizes import ModelConfig

FP32 = 4
OPTIM_BYTES = {"adamw": 2 * FP32, "sgd": FP32}  # per parameter, besides AdamW's step scalars


@dataclass(frozen=True)
class Terms:
    """Bytes one rank holds under one strategy (rank 0, the largest shard)."""

    strategy: str
    shard_ranks: int
    """Ranks each tensor is split over: N, the hybrid group size, or 1."""
    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    state_bytes: int
    gpu_state_bytes: int
    host_state_bytes: int
    largest_block_bytes: int | None
    """Compute copy of the largest FSDP unit (a block or the root); None without a shape."""
    gathered_bytes: int | None
    activation_bytes: int | None
    peak_bytes: int
    """GPU bytes: state on the GPU + gathered + activations (unknown terms count 0)."""


@dataclass(frozen=True)
class Plan:
    """One run's options, checked (``estimate._plan``), with the model shape if known."""

    params: int
    ranks: int
    strategy: str
    shard_ranks: int
    precision: str
    optimizer: str
    cpu_offload: bool
    ac: str
    model: ModelConfig | None
    batch_size: int | None
    seq_len: int | None


def bytes_per_param(optimizer: str = "adamw") -> dict[str, int]:
    """Persistent bytes per parameter as FSDP2 holds them (see the module docstring)."""
    out = {"params": FP32, "grads": FP32, "optim": OPTIM_BYTES[optimizer]}
    return {**out, "total": sum(out.values())}


def hybrid_shard_size(ranks: int, requested: int | None = None) -> int:
    """Ranks per shard group, as ``train.parallel.hybrid_shard_size`` picks it on one node."""
    if requested is not None:
        return requested
    return ranks // 2 if ranks >= 4 and ranks % 2 == 0 else ranks


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``GPT(cfg)`` and its shape, in ``named_parameters()`` order."""
    d, f = cfg.d_model, cfg.ff
    shapes: dict[str, tuple[int, ...]] = {"tok_emb.weight": (cfg.vocab, d), "pos_emb.weight": (cfg.max_seq_len, d)}
    for i in range(cfg.n_layers):
        shapes.update({f"blocks.{i}.norm1.weight": (d,), f"blocks.{i}.attn.qkv.weight": (3 * d, d),
                       f"blocks.{i}.attn.proj.weight": (d, d), f"blocks.{i}.norm2.weight": (d,),
                       f"blocks.{i}.mlp.fc.weight": (f, d), f"blocks.{i}.mlp.proj.weight": (d, f)})
    shapes.update({"norm.weight": (d,), "head.weight": (cfg.vocab, d)})
    return shapes


def shard_numel(shape: tuple[int, ...], shard_ranks: int) -> int:
    """Elements of rank 0's FSDP2 shard (``Shard(0)``, ``ceil(dim0 / N)`` rows)."""
    return math.ceil(shape[0] / shard_ranks) * math.prod(shape[1:])


def activation_bytes(cfg: ModelConfig, *, micro_batch: int, seq_len: int, precision: str = "bf16",
                     checkpointing: str = "none") -> int:
    """Activation bytes one rank holds at the start of backward (module docstring formula)."""
    c = compute_bytes(precision)
    d, f, n = cfg.d_model, cfg.ff, micro_batch * seq_len
    full = n * ((8 * d + 2 * f) * c + 4 * cfg.n_heads + 16)
    every = {"none": 0, "every": 1, "every-2": 2}[checkpointing]
    wrapped = len(range(0, cfg.n_layers, every)) if every else 0
    blocks = wrapped * n * d * c + (cfg.n_layers - wrapped) * full + (full if wrapped else 0)
    head = n * ((2 * d + cfg.vocab) * c + 4 * cfg.vocab + 24) + 8 * seq_len
    return blocks + head


def compute_bytes(precision: str) -> int:
    """Bytes per element of the compute copy: 2 for bf16, 4 for fp32."""
    return 2 if precision == "bf16" else FP32


def micro_batch(plan: Plan) -> int | None:
    """Sequences per rank per micro-step (``ceil(batch / N)``); None without a batch."""
    return None if plan.batch_size is None else math.ceil(plan.batch_size / plan.ranks)


def rank_terms(plan: Plan) -> Terms:
    """Every term one rank (rank 0, the largest shard) holds under ``plan``."""
    s = plan.shard_ranks
    if plan.model is None:
        numel, tensors = math.ceil(plan.params / s), 0
    else:
        shapes = param_shapes(plan.model).values()
        numel, tensors = sum(shard_numel(sh, s) for sh in shapes), len(shapes)
    params, grads = numel * FP32, numel * FP32
    optim = numel * OPTIM_BYTES[plan.optimizer] + (tensors * FP32 if plan.optimizer == "adamw" else 0)
    state = params + grads + optim
    gpu_state, host_state = (0, state) if plan.cpu_offload else (state, 0)
    largest, gathered, acts = None, None, None
    if plan.model is not None:
        largest, gathered = gathered_bytes(plan)
        acts = activation_bytes(plan.model, micro_batch=micro_batch(plan) or 1, seq_len=plan.seq_len or 1,
                                precision=plan.precision, checkpointing=plan.ac)
    peak = gpu_state + (gathered or 0) + (acts or 0)
    return Terms(plan.strategy, s, params, grads, optim, state, gpu_state, host_state, largest,
                 gathered, acts, peak)


def gathered_bytes(plan: Plan) -> tuple[int, int]:
    """(largest unit's compute copy, all gathered bytes) -- see the module docstring."""
    cfg, c = plan.model, compute_bytes(plan.precision)
    assert cfg is not None
    d, f = cfg.d_model, cfg.ff
    block = 4 * d * d + 2 * d * f + 2 * d
    root = cfg.num_params() - cfg.n_layers * block
    kept = min(2, cfg.n_layers) if plan.strategy in ("full-shard", "hybrid") else cfg.n_layers
    gathered = (root + kept * block) * c + (root + block) * c + block * FP32
    return max(root, block) * c, gathered
