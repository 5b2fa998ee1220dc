"""Per-GPU memory of a training run, on paper, before launch (``ckptool estimate``, seed 000).

Owns checking the options, the verdict and its suggestions; torch-free (it imports only ``train/sizes.py``, so the estimate starts
instantly). It leaves rendering to ``cli/estimate.py``. The numbers describe what ``ckptool
train`` (FSDP2, ``train/parallel.py``) holds, and the persistent state terms are checked
against what its ranks measure (``parallel.state_bytes``) in ``tests/dist``.

The formulas, and what each term counts, are ``memory_terms.py``'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ckptool.errors import ConfigError
from ckptool.ops.memory_terms import (FP32, OPTIM_BYTES, Plan, Terms, activation_bytes, bytes_per_param,
                                      hybrid_shard_size, micro_batch, param_shapes, shard_numel, rank_terms)
from ckptool.train.sizes import ModelConfig, model_config

__all__ = ["ACTIVATION_CHECKPOINTING", "ALIASES", "FP32", "OPTIMIZERS", "OPTIM_BYTES", "PRECISIONS",
           "STRATEGIES", "Estimate", "Suggestion", "Terms", "Verdict", "activation_bytes",
           "bytes_per_param", "estimate", "fmt_bytes", "hybrid_shard_size", "param_shapes",
           "resolve_model", "shard_numel"]

STRATEGIES = ("full-shard", "grad-op", "ddp", "hybrid")
#: ``ckptool train --sharding`` names.
ALIASES = {"full": "full-shard", "none": "ddp"}
PRECISIONS = ("bf16", "fp32")
OPTIMIZERS = ("adamw", "sgd")
ACTIVATION_CHECKPOINTING = ("none", "every", "every-2")
DEFAULT_BATCH_SIZE = 16  # ckptool train's default global batch


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
    chosen = rank_terms(plan)
    ddp = rank_terms(dataclasses.replace(plan, strategy="ddp", shard_ranks=1, cpu_offload=False))
    whole = rank_terms(dataclasses.replace(plan, shard_ranks=1))
    verdict = _verdict(plan, chosen, gpu_memory) if gpu_memory is not None else None
    return Estimate(
        params=plan.params, ranks=plan.ranks, strategy=plan.strategy, shard_ranks=plan.shard_ranks,
        precision=plan.precision, optimizer=plan.optimizer, cpu_offload=plan.cpu_offload,
        activation_checkpointing=plan.ac, batch_size=plan.batch_size, micro_batch=micro_batch(plan),
        seq_len=plan.seq_len, model=plan.model, bytes_per_param=bytes_per_param(plan.optimizer),
        total_state_bytes=whole.state_bytes, per_rank_state_bytes=chosen.state_bytes,
        per_rank=chosen, ddp=ddp, verdict=verdict, notes=_notes(plan),
    )


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


def fmt_bytes(n: int | float) -> str:
    """Decimal units, as GPU memory is sold and as seed 000 counts: 112.0 GB, 6.3 MB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# -- internals --------------------------------------------------------------------------------


def _plan(params: int | None, model: ModelConfig | str | None, ranks: int, strategy: str,
          hybrid: int | None, precision: str, optimizer: str, cpu_offload: bool, ac: str,
          batch_size: int | None, seq_len: int | None) -> Plan:
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
    return Plan(params, ranks, strategy, shard, precision, optimizer, cpu_offload, ac, cfg,
                 batch_size, seq_len)


def _hybrid(ranks: int, requested: int | None) -> int:
    shard = hybrid_shard_size(ranks, requested)
    if shard < 1 or ranks % shard:
        raise ConfigError(f"hybrid shard size {shard} does not divide {ranks} ranks",
                          hint="Pass --hybrid-shard-size that divides --ranks")
    return shard


def _notes(plan: Plan) -> tuple[str, ...]:
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
                     f"(ckptool train needs a multiple); counted {micro_batch(plan)} per rank")
    return tuple(notes)


def _verdict(plan: Plan, terms: Terms, gpu_memory: int) -> Verdict:
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


def _rubric(plan: Plan, gpu_memory: int) -> list[Suggestion]:
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


def _suggest(options: str, plan: Plan, gpu_memory: int) -> Suggestion:
    peak = rank_terms(plan).peak_bytes
    return Suggestion(options, peak, peak <= gpu_memory)


def _with_ranks(plan: Plan, ranks: int) -> Plan:
    return dataclasses.replace(plan, ranks=ranks, shard_ranks=ranks)


def _ranks_that_fit(plan: Plan, gpu_memory: int, limit: int = 1 << 20) -> int | None:
    """Fewest full-shard ranks (more than now) that fit; None if none up to ``limit``."""
    hi = plan.ranks * 2
    while rank_terms(_with_ranks(plan, hi)).peak_bytes > gpu_memory:
        if hi >= limit:
            return None
        hi *= 2
    lo = max(plan.ranks, hi // 2)  # does not fit at lo (or lo is the current count)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if rank_terms(_with_ranks(plan, mid)).peak_bytes <= gpu_memory else (mid, hi)
    return hi
