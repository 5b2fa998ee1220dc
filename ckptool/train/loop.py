"""The training loop of ``ckptool train``: build, resume, step, save, report.

Owns one run on one rank (called on all ranks of an initialized process group). It builds the
model (``model.py``), shards it (``parallel.py``), reads batches (``data.py``) and saves and
resumes through ``ckptool.checkpoint.Checkpointer`` -- the same class a user script would use.
Spawning the ranks is ``launch.py``'s job; printing is the CLI's (rank 0 passes events to the
``on_event`` callback and returns a ``TrainResult``; both are ``events.py``'s).

Testing hook: ``CKPTOOL_TEST_KILL=RANK:STEP`` in the environment makes that rank kill itself
with SIGKILL when it reaches that step (to test rank-death handling end to end).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ckptool.checkpoint import Checkpointer
from ckptool.errors import ConfigError, IncompatibleCheckpointError
from ckptool.train import parallel
from ckptool.train.config import TrainConfig
from ckptool.train.data import TokenBatches
from ckptool.train.events import RunStarted, SaveReport, StepReport, TrainResult
from ckptool.train.model import GPT
from ckptool.train.preflight import Notice, check_fresh_out, check_resume_from, model_mismatch, read_resume, resume_notices

logger = logging.getLogger(__name__)


class TrainState:
    """Step counter and CPU RNG state, saved as the ``train`` entry (DCP ``Stateful``).

    Only the CPU generator is kept: the loop draws no random numbers on the GPU (no dropout;
    batches come from their own seeded generators), and a CUDA state would make a checkpoint
    saved on CPU unloadable on GPU (a key the template has and the file lacks).
    """

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rng_cpu": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        torch.set_rng_state(state["rng_cpu"])


def lr_schedule(warmup: int, total: int) -> Callable[[int], float]:
    """Multiplier of the peak LR: linear warmup, then cosine decay to 0.1 at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def pick_device(name: str) -> torch.device:
    """auto -> this rank's GPU when CUDA is available, else CPU."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but CUDA is not available", hint="Use --device cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def build(cfg: TrainConfig, world_size: int, device: torch.device, precision: str) -> tuple[Any, Any, Any]:
    """Model (sharded, checked), AdamW and its LR scheduler (called on all ranks)."""
    torch.manual_seed(cfg.seed)  # identical full weights on every rank before sharding
    model = GPT(cfg.model_config())
    parallel.apply_activation_checkpointing(model, cfg.activation_checkpointing)
    mesh = parallel.build_mesh(cfg.sharding, world_size, device.type, shard_size=cfg.hybrid_shard_size)
    parallel.shard_model(model, mesh, sharding=cfg.sharding, precision=precision, cpu_offload=cfg.cpu_offload)
    parallel.check_wrapping(model)
    optimizer, scheduler = optimizer_for(cfg, model)
    return model, optimizer, scheduler


def optimizer_for(cfg: TrainConfig, model: Any) -> tuple[Any, Any]:
    """AdamW over the (sharded) model and its LR scheduler."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay)
    schedule = lr_schedule(cfg.effective_warmup(), cfg.effective_decay())
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def model_params(model: Any) -> int:
    """Parameters of the (sharded) model, counted in full; a tied embedding counts once."""
    return sum(p.numel() for p in model.parameters())


def train_step(model: Any, optimizer: Any, data: TokenBatches, index: int, cfg: TrainConfig,
               device: torch.device) -> torch.Tensor:
    """Forward/backward over ``grad_accum`` micro-batches, clip, optimizer step; the local
    mean loss (gradients are left in place so their size can be measured)."""
    total = torch.zeros((), device=device)
    for micro in range(cfg.grad_accum):
        batch = data.get(index, micro)
        logits = model(batch.inputs.to(device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.to(device).flatten())
        (loss / cfg.grad_accum).backward()
        total += loss.detach() / cfg.grad_accum
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    return total


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _memory(model: Any, optimizer: Any, device: torch.device) -> tuple[list[dict[str, int]], list[int] | None]:
    sizes = _gather(parallel.state_bytes(model, optimizer))
    peak = _gather(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return sizes, peak


def _maybe_die(step: int) -> None:
    spec = os.environ.get("CKPTOOL_TEST_KILL")
    if spec and spec == f"{dist.get_rank()}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class _Run:
    """What one rank trains with."""

    cfg: TrainConfig
    model: Any
    optimizer: Any
    scheduler: Any
    data: TokenBatches
    state: TrainState
    ckpt: Checkpointer
    device: torch.device
    precision: str

    @property
    def extra(self) -> dict[str, Any]:
        """Checkpointed beside ``model.*`` and ``optim.*``."""
        return {"lr_scheduler": self.scheduler, "data": self.data, "train": self.state}


@dataclass
class _Meter:
    """Losses, timings and memory as the loop goes."""

    losses: list[float] = field(default_factory=list)
    compute_s: float = 0.0  # step time after the first step (which pays for warm-up)
    window_s: float = 0.0
    window_steps: int = 0
    wall_s: float = 0.0
    sizes: list[dict[str, int]] = field(default_factory=list)
    peak: list[int] | None = None


def setup(cfg: TrainConfig) -> _Run:
    """Model, optimizer, data and checkpointer for this rank (called on all ranks)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    cfg.check_world_size(ws)
    device = pick_device(cfg.device)
    precision = cfg.mixed_precision or ("bf16" if device.type == "cuda" else "fp32")
    if cfg.hf_model is not None:  # a transformers model (hf_model.py), trained by this same loop
        from ckptool.train import hf_model

        return hf_model.setup(cfg, rank, ws, device, precision)
    model, optimizer, scheduler = build(cfg, ws, device, precision)
    parallel.quiet_mesh_pickling()  # async saves send the mesh to DCP's background process
    manifest_cfg = {**cfg.to_dict(), "model_config": cfg.model_config().to_dict(), "precision": precision}
    ckpt = Checkpointer(cfg.out, keep=cfg.keep, async_save=cfg.async_save, config=manifest_cfg)
    return _Run(cfg, model, optimizer, scheduler, _data(cfg, rank, ws), TrainState(), ckpt, device, precision)


def train(cfg: TrainConfig, *, on_event: Callable[[Any], None] | None = None) -> TrainResult | None:
    """Run (or continue) training to ``cfg.steps`` (called on all ranks).

    Args:
        cfg: the options.
        on_event: rank 0 only: receives ``RunStarted``, ``StepReport`` and ``SaveReport``.

    Returns:
        The ``TrainResult`` on rank 0, None on the other ranks.

    Raises:
        ConfigError: bad options for this world size, or ``--no-resume`` on a used folder.
        CkptError: a checkpoint could not be loaded or saved.
    """
    rank, ws = dist.get_rank(), dist.get_world_size()
    emit = on_event if (on_event is not None and rank == 0) else (lambda _e: None)
    run = setup(cfg)
    try:
        resumed, notes = _resume(run)
        if resumed is None and run.cfg.init_from is not None:  # weights only, then a fresh run
            run.ckpt.load_pretrained(run.model, run.cfg.init_from)
        for note in notes:
            emit(Notice(note))
        start = run.state.step
        emit(RunStarted(ws, str(run.device), run.precision, cfg.sharding, model_params(run.model),
                        start, cfg.steps, resumed))
        meter = run_steps(run, emit)
        run.ckpt.wait()
        if cfg.final_model_only:
            run.ckpt.save_model(run.model, step=run.state.step, loss=meter.losses[-1] if meter.losses else None)
    finally:
        run.ckpt.close()
    if rank != 0:
        return None
    result = _result(run, meter, start, resumed)
    result.notes = notes
    return result


def run_steps(run: _Run, emit: Callable[[Any], None]) -> _Meter:
    """The loop: step, report, save, from the current step to ``cfg.steps`` (all ranks)."""
    cfg, model, optimizer, ckpt = run.cfg, run.model, run.optimizer, run.ckpt
    meter, start, ws = _Meter(), run.state.step, dist.get_world_size()
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.effective_seq_len()
    meter.sizes, meter.peak = _memory(model, optimizer, run.device)
    t_run = time.perf_counter()
    for step in range(start + 1, cfg.steps + 1):
        _maybe_die(step)
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, run.data, step - 1, cfg, run.device)
        dist.all_reduce(loss)  # SUM (gloo has no AVG); for reporting only
        meter.losses.append(loss.item() / ws)
        report = step % cfg.log_every == 0 or step == cfg.steps
        if report:
            meter.sizes, meter.peak = _memory(model, optimizer, run.device)  # grads still allocated
        lr = run.scheduler.get_last_lr()[0]
        run.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        took = time.perf_counter() - t0
        meter.compute_s += took if step > start + 1 else 0.0
        meter.window_s, meter.window_steps = meter.window_s + took, meter.window_steps + 1
        run.state.step = run.data.position = step
        if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
            path = ckpt.save(step, model, optimizer, extra=run.extra, loss=meter.losses[-1])
            emit(SaveReport(step, str(path), ckpt.stats.last_blocked_seconds, cfg.async_save))
        if report:
            emit(StepReport(step, cfg.steps, meter.losses[-1], lr,
                            tokens_per_step * meter.window_steps / meter.window_s,
                            meter.window_s / meter.window_steps, meter.sizes, meter.peak,
                            ckpt.stats.save_seconds, ckpt.stats.blocked_seconds))
            meter.window_s, meter.window_steps = 0.0, 0
    meter.wall_s = time.perf_counter() - t_run
    return meter


def _result(run: _Run, meter: _Meter, start: int, resumed: str | None) -> TrainResult:
    cfg, stats, losses = run.cfg, run.ckpt.stats, meter.losses
    committed = [c for c in run.ckpt.list() if c.committed]
    samples = cfg.batch_size * cfg.grad_accum * max(0, len(losses) - 1)  # timed steps only
    rate = samples / meter.compute_s if meter.compute_s else 0.0
    return TrainResult(
        out=cfg.out, world_size=dist.get_world_size(), device=str(run.device), precision=run.precision,
        sharding=cfg.sharding, model_params=model_params(run.model), start_step=start,
        steps=run.state.step, resumed_from=resumed, first_loss=losses[0] if losses else None,
        final_loss=losses[-1] if losses else None, losses=losses, wall_seconds=meter.wall_s,
        tokens_per_s=rate * cfg.effective_seq_len(), samples_per_s=rate, state_bytes=meter.sizes,
        peak_memory_bytes=meter.peak, saves=stats.saves, save_seconds=stats.save_seconds,
        blocked_seconds=stats.blocked_seconds, checkpoints=[c.name for c in committed],
        latest=committed[-1].url if committed else None,
    )


def _data(cfg: TrainConfig, rank: int, ws: int) -> TokenBatches:
    kw = {"seq_len": cfg.effective_seq_len(), "global_batch": cfg.batch_size, "seed": cfg.seed,
          "rank": rank, "world_size": ws}
    return TokenBatches.from_file(cfg.data, **kw) if cfg.data else TokenBatches.demo(**kw)


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _try(fn: Callable[[str], str], arg: str) -> tuple[str | None, str | None]:
    """``(fn(arg), None)``, or ``(None, message)`` of the ``ConfigError`` it raised."""
    try:
        return fn(arg), None
    except ConfigError as e:
        return None, str(e)


def _resume(run: _Run) -> tuple[str | None, list[str]]:
    """Load the checkpoint the options ask for (all ranks). Returns the path loaded (None for
    a fresh start) and, on rank 0, one line per thing that differs from the saved run."""
    cfg, ckpt = run.cfg, run.ckpt
    if cfg.resume_from is None and not cfg.resume:
        check_fresh_out(cfg.out)
        return None, []
    path = cfg.resume_from
    if path is not None:  # checked (and a run folder resolved) on rank 0; every rank hears why
        checked = _try(check_resume_from, path) if dist.get_rank() == 0 else None
        path, error = _broadcast(checked)
        if error is not None:
            raise ConfigError(error)
    else:
        found = ckpt.latest() if dist.get_rank() == 0 else None
        path = _broadcast(str(found.url) if found is not None else None)
        if path is None:
            return None, []
    # The manifest names the saved model: say which option differs instead of DCP's error
    # (or, for a model that is a prefix of the saved one, a silent partial load).
    problem, notes = None, []
    if dist.get_rank() == 0:
        saved = read_resume(path)
        problem = model_mismatch(saved, cfg)
        notes = [n.text for n in resume_notices(saved, cfg, dist.get_world_size())]
    problem = _broadcast(problem)
    if problem:
        raise IncompatibleCheckpointError(problem, path=path)
    ckpt.load(path, run.model, run.optimizer, extra=run.extra, check=False)
    logger.info("resumed from %s", ckpt.last_loaded)
    return ckpt.last_loaded, notes
