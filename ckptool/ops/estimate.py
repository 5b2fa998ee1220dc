"""Per-GPU memory of a training run, on paper, before launch (``ckptool estimate``, seed 000).

Owns the byte accounting; torch-free (it imports only ``train/sizes.py``, so the estimate starts
instantly). It leaves rendering to ``cli/estimate.py``. The numbers describe what ``ckptool
train`` (FSDP2, ``train/parallel.py``) holds, and the persistent state terms are checked
against what its ranks measure (``parallel.state_bytes``) in ``tests/dist``.

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

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ckptool.errors import ConfigError
from ckptool.train.sizes import ModelConfig, model_config

STRATEGIES = ("full-shard", "grad-op", "ddp", "hybrid")
#: ``ckptool train --sharding`` names.
ALIASES = {"full": "full-shard", "none": "ddp"}
PRECISIONS = ("bf16", "fp32")
OPTIMIZERS = ("adamw", "sgd")
ACTIVATION_CHECKPOINTING = ("none", "every", "every-2")
DEFAULT_BATCH_SIZE = 16  # ckptool train's default global batch
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
class Suggestion:
    """One step of the seed's rubric: the options to add and the peak they give."""

    options: str
    peak_bytes: int
    fits: bool


@dataclass(frozen=True)
class Verdict:
    fits: bool
    gpu_memory_bytes: int
    headroom_bytes: int
    """Negative when it does not fit."""
    message: str
    suggestions: tuple[Suggestion, ...] = ()


@dataclass(frozen=True)
class Estimate:
    """Result of ``estimate``. ``to_dict()`` is the ``--json`` form."""

    params: int
    ranks: int
    strategy: str
    shard_ranks: int
    precision: str
    optimizer: str
    cpu_offload: bool
    activation_checkpointing: str
    batch_size: int | None
    micro_batch: int | None
    seq_len: int | None
    model: ModelConfig | None
    bytes_per_param: dict[str, int]
    total_state_bytes: int
    """params + grads + optimizer state of the whole (unsharded) model."""
    per_rank_state_bytes: int
    per_rank: Terms
    ddp: Terms
    """The same run under DDP (NO_SHARD, no offload), for comparison."""
    verdict: Verdict | None
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        out = {"total_state_bytes": self.total_state_bytes,
               "per_rank_state_bytes": self.per_rank_state_bytes}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ModelConfig):
                value = value.to_dict()
            elif dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            out.setdefault(f.name, list(value) if isinstance(value, tuple) else value)
        return out


@dataclass(frozen=True)
class _Plan:
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


def estimate(*, params: int | None = None, model: ModelConfig | str | None = None, ranks: int = 1,
             strategy: str = "full-shard", hybrid_shard_size: int | None = None,
             precision: str = "bf16", optimizer: str = "adamw", cpu_offload: bool = False,
             activation_checkpointing: str = "none", batch_size: int | None = None,
             seq_len: int | None = None, gpu_memory: int | None = None) -> Estimate:
    """Estimate what each rank holds, for ``strategy`` and for DDP, and whether it fits.

    Args:
        params: parameter count (state terms only); exclusive with ``model``.
        model: a preset name or ``ModelConfig``: exact shapes, gathered and activation terms.
        ranks: world size N.
        strategy: full-shard, grad-op, ddp or hybrid (``full``/``none`` as in ckptool train).
        hybrid_shard_size: ranks per shard group (default as ckptool train: N // 2 for an
            even N >= 4, else N).
        precision: compute dtype, bf16 or fp32 (the state is fp32 either way).
        optimizer: adamw or sgd (with momentum).
        cpu_offload: sharded state lives in host memory.
        activation_checkpointing: none, every or every-2.
        batch_size: GLOBAL sequences per micro-step, as ``ckptool train --batch-size``
            (default 16 with a model); each rank holds ``ceil(batch_size / N)``.
        seq_len: tokens per sequence (default the model's ``max_seq_len``).
        gpu_memory: bytes per GPU; adds a ``Verdict``.

    Returns:
        An ``Estimate``.

    Raises:
        ConfigError: a bad value, both or neither of ``params``/``model``, or batch options
            without a model shape.

    Example:
        >>> estimate(params=7_000_000_000, ranks=8).per_rank_state_bytes
        14000000000
    """
    plan = _plan(params, model, ranks, strategy, hybrid_shard_size, precision, optimizer,
                 cpu_offload, activation_checkpointing, batch_size, seq_len)
    chosen = _terms(plan)
    ddp = _terms(dataclasses.replace(plan, strategy="ddp", shard_ranks=1, cpu_offload=False))
    whole = _terms(dataclasses.replace(plan, shard_ranks=1))
    verdict = _verdict(plan, chosen, gpu_memory) if gpu_memory is not None else None
    return Estimate(
        params=plan.params, ranks=plan.ranks, strategy=plan.strategy, shard_ranks=plan.shard_ranks,
        precision=plan.precision, optimizer=plan.optimizer, cpu_offload=plan.cpu_offload,
        activation_checkpointing=plan.ac, batch_size=plan.batch_size, micro_batch=_micro(plan),
        seq_len=plan.seq_len, model=plan.model, bytes_per_param=bytes_per_param(plan.optimizer),
        total_state_bytes=whole.state_bytes, per_rank_state_bytes=chosen.state_bytes,
        per_rank=chosen, ddp=ddp, verdict=verdict, notes=_notes(plan),
    )


def bytes_per_param(optimizer: str = "adamw") -> dict[str, int]:
    """Persistent bytes per parameter as FSDP2 holds them (see the module docstring)."""
    out = {"params": FP32, "grads": FP32, "optim": OPTIM_BYTES[optimizer]}
    return {**out, "total": sum(out.values())}


def resolve_model(name: str | None = None, **sizes: int | None) -> ModelConfig:
    """A preset with overrides, or a shape from ``d_model``, ``n_layers`` and ``vocab`` alone.

    Without a preset, ``n_heads`` defaults to ``d_model // 64`` (head size 64) when that
    divides, else 1, and ``max_seq_len`` to 2048 (the CLI passes ``--seq-len`` when given).

    Raises:
        ConfigError: unknown preset, missing sizes, or invalid sizes.
    """
    given = {k: v for k, v in sizes.items() if v is not None}
    if name is not None:
        return model_config(name, **given)
    missing = [k for k in ("d_model", "n_layers", "vocab") if k not in given]
    if missing:
        flags = ", ".join("--" + {"n_layers": "layers"}.get(k, k).replace("_", "-") for k in missing)
        raise ConfigError(f"a model shape without --model needs {flags}",
                          hint="Pass --d-model, --layers and --vocab, or --model NAME")
    d = given["d_model"]
    given.setdefault("n_heads", d // 64 if d >= 64 and d % 64 == 0 else 1)
    given.setdefault("max_seq_len", 2048)
    return ModelConfig(**given)


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
    c = _compute_bytes(precision)
    d, f, n = cfg.d_model, cfg.ff, micro_batch * seq_len
    full = n * ((8 * d + 2 * f) * c + 4 * cfg.n_heads + 16)
    every = {"none": 0, "every": 1, "every-2": 2}[checkpointing]
    wrapped = len(range(0, cfg.n_layers, every)) if every else 0
    blocks = wrapped * n * d * c + (cfg.n_layers - wrapped) * full + (full if wrapped else 0)
    head = n * ((2 * d + cfg.vocab) * c + 4 * cfg.vocab + 24) + 8 * seq_len
    return blocks + head


def fmt_bytes(n: int | float) -> str:
    """Decimal units, as GPU memory is sold and as seed 000 counts: 112.0 GB, 6.3 MB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# -- internals --------------------------------------------------------------------------------


def _plan(params: int | None, model: ModelConfig | str | None, ranks: int, strategy: str,
          hybrid: int | None, precision: str, optimizer: str, cpu_offload: bool, ac: str,
          batch_size: int | None, seq_len: int | None) -> _Plan:
    strategy = ALIASES.get(strategy, strategy)
    for name, value, allowed in (("strategy", strategy, STRATEGIES), ("precision", precision, PRECISIONS),
                                 ("optimizer", optimizer, OPTIMIZERS),
                                 ("activation checkpointing", ac, ACTIVATION_CHECKPOINTING)):
        if value not in allowed:
            raise ConfigError(f"{name} {value!r} is not one of {', '.join(allowed)}")
    if ranks < 1:
        raise ConfigError(f"ranks must be at least 1, got {ranks}")
    cfg = model_config(model) if isinstance(model, str) else model
    if (params is None) == (cfg is None):
        raise ConfigError("pass either a parameter count or a model shape, not both or neither",
                          hint="Use --params N, or --model NAME / --d-model, --layers and --vocab")
    if params is not None and params < 1:
        raise ConfigError(f"parameter count must be positive, got {params}", hint="Pass e.g. --params 7e9")
    if cfg is None and (batch_size is not None or seq_len is not None):
        raise ConfigError("--batch-size/--seq-len size activations, which need a model shape",
                          hint="Add --model NAME or --d-model, --layers and --vocab, or drop them")
    for name, value in (("batch size", batch_size), ("sequence length", seq_len)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    shard = {"full-shard": ranks, "grad-op": ranks, "ddp": 1}.get(strategy) or _hybrid(ranks, hybrid)
    if cfg is not None:
        params = cfg.num_params()
        batch_size = batch_size or DEFAULT_BATCH_SIZE
        seq_len = seq_len or cfg.max_seq_len
        if seq_len > cfg.max_seq_len:
            raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}",
                              hint="Lower --seq-len or raise --max-seq-len")
    assert params is not None  # exactly one of params / cfg, checked above
    return _Plan(params, ranks, strategy, shard, precision, optimizer, cpu_offload, ac, cfg,
                 batch_size, seq_len)


def _hybrid(ranks: int, requested: int | None) -> int:
    shard = hybrid_shard_size(ranks, requested)
    if shard < 1 or ranks % shard:
        raise ConfigError(f"hybrid shard size {shard} does not divide {ranks} ranks",
                          hint="Pass --hybrid-shard-size that divides --ranks")
    return shard


def _compute_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else FP32


def _micro(plan: _Plan) -> int | None:
    return None if plan.batch_size is None else math.ceil(plan.batch_size / plan.ranks)


def _terms(plan: _Plan) -> Terms:
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
        largest, gathered = _gathered(plan)
        acts = activation_bytes(plan.model, micro_batch=_micro(plan) or 1, seq_len=plan.seq_len or 1,
                                precision=plan.precision, checkpointing=plan.ac)
    peak = gpu_state + (gathered or 0) + (acts or 0)
    return Terms(plan.strategy, s, params, grads, optim, state, gpu_state, host_state, largest,
                 gathered, acts, peak)


def _gathered(plan: _Plan) -> tuple[int, int]:
    """(largest unit's compute copy, all gathered bytes) -- see the module docstring."""
    cfg, c = plan.model, _compute_bytes(plan.precision)
    assert cfg is not None
    d, f = cfg.d_model, cfg.ff
    block = 4 * d * d + 2 * d * f + 2 * d
    root = cfg.num_params() - cfg.n_layers * block
    kept = min(2, cfg.n_layers) if plan.strategy in ("full-shard", "hybrid") else cfg.n_layers
    gathered = (root + kept * block) * c + (root + block) * c + block * FP32
    return max(root, block) * c, gathered


def _notes(plan: _Plan) -> tuple[str, ...]:
    notes = []
    if plan.precision == "bf16":
        notes.append("bf16 under FSDP2: the fp32 parameter shards are the master weights and "
                     "gradients are reduced into fp32 shards; the bf16 copies are the gathered "
                     "term (the classic 2 + 2 + 12 B/param, regrouped)")
    if plan.model is None:
        notes.append("state only: add --model or --d-model/--layers/--vocab for the gathered "
                     "blocks and activations")
    if plan.batch_size is not None and plan.batch_size % plan.ranks:
        notes.append(f"--batch-size {plan.batch_size} does not split over {plan.ranks} ranks "
                     f"(ckptool train needs a multiple); counted {_micro(plan)} per rank")
    return tuple(notes)


def _verdict(plan: _Plan, terms: Terms, gpu_memory: int) -> Verdict:
    headroom = gpu_memory - terms.peak_bytes
    scope = " (state only)" if plan.model is None else ""
    if headroom >= 0:
        return Verdict(True, gpu_memory, headroom, f"fits with {fmt_bytes(headroom)} headroom "
                       f"of {fmt_bytes(gpu_memory)} per GPU{scope}")
    tries = _rubric(plan, gpu_memory)
    steps = ""
    for i, t in enumerate(tries):
        if i:
            steps += " or " if "--ranks" in t.options else ", then "
        steps += f"{t.options} ({fmt_bytes(t.peak_bytes)}{', fits' if t.fits else ''})"
    if not any(t.fits for t in tries):
        steps = (steps + "; even then " if steps else "") + "it does not fit: lower --batch-size or --seq-len"
    return Verdict(False, gpu_memory, headroom,
                   f"does not fit: needs {fmt_bytes(terms.peak_bytes)}{scope} of {fmt_bytes(gpu_memory)} "
                   f"per GPU, {fmt_bytes(-headroom)} over; try {steps}", tuple(tries))


def _rubric(plan: _Plan, gpu_memory: int) -> list[Suggestion]:
    """Seed 000's order, each step keeping the previous ones: full shard, then activation
    checkpointing (stopping at the first that fits), then CPU offload, or more ranks (the
    alternative that keeps throughput; on top of offload only if needed)."""
    out: list[Suggestion] = []
    for options, change in (("--strategy full-shard", {"strategy": "full-shard", "shard_ranks": plan.ranks}),
                            ("--activation-checkpointing every", {"ac": "every"})):
        if (plan.model is None and "ac" in change) or all(getattr(plan, k) == v for k, v in change.items()):
            continue
        plan = dataclasses.replace(plan, **change)
        out.append(_suggest(options, plan, gpu_memory))
        if out[-1].fits:
            return out
    offload = dataclasses.replace(plan, cpu_offload=True)
    if not plan.cpu_offload:
        out.append(_suggest("--cpu-offload", offload, gpu_memory))
    ranks, prefix = _ranks_that_fit(plan, gpu_memory), ""
    if ranks is None and not plan.cpu_offload and not out[-1].fits:
        ranks, plan, prefix = _ranks_that_fit(offload, gpu_memory), offload, "--cpu-offload "
    if ranks is not None:
        out.append(_suggest(f"{prefix}--ranks {ranks}", _with_ranks(plan, ranks), gpu_memory))
    return out


def _suggest(options: str, plan: _Plan, gpu_memory: int) -> Suggestion:
    peak = _terms(plan).peak_bytes
    return Suggestion(options, peak, peak <= gpu_memory)


def _with_ranks(plan: _Plan, ranks: int) -> _Plan:
    return dataclasses.replace(plan, ranks=ranks, shard_ranks=ranks)


def _ranks_that_fit(plan: _Plan, gpu_memory: int, limit: int = 1 << 20) -> int | None:
    """Fewest full-shard ranks (more than now) that fit; None if none up to ``limit``."""
    hi = plan.ranks * 2
    while _terms(_with_ranks(plan, hi)).peak_bytes > gpu_memory:
        if hi >= limit:
            return None
        hi *= 2
    lo = max(plan.ranks, hi // 2)  # does not fit at lo (or lo is the current count)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _terms(_with_ranks(plan, mid)).peak_bytes <= gpu_memory else (mid, hi)
    return hi
