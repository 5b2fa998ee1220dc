"""What a training run reports: the events rank 0 sends while it runs, and its summary.

Owns the records ``loop.train`` passes to its ``on_event`` callback (``RunStarted``,
``StepReport``, ``SaveReport``) and returns (``TrainResult``, JSON-able through
``dataclasses.asdict``). Rendering them is ``cli/train.py``'s. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunStarted:
    """Sent once, after resume, before the first step."""

    world_size: int
    device: str
    precision: str
    sharding: str
    model_params: int
    start_step: int
    steps: int
    resumed_from: str | None


@dataclass(frozen=True)
class StepReport:
    """Sent every ``log_every`` steps (and at the last one)."""

    step: int
    steps: int
    loss: float
    lr: float
    tokens_per_s: float
    step_seconds: float
    state_bytes: list[dict[str, int]]
    peak_memory_bytes: list[int] | None
    save_seconds: float
    blocked_seconds: float


@dataclass(frozen=True)
class SaveReport:
    """Sent after each ``save`` call returned (for an async save: once it is in flight)."""

    step: int
    path: str
    blocked_seconds: float
    is_async: bool


@dataclass
class TrainResult:
    """Summary of a run (JSON-able through ``dataclasses.asdict``)."""

    out: str
    world_size: int
    device: str
    precision: str
    sharding: str
    model_params: int
    start_step: int
    steps: int
    resumed_from: str | None
    first_loss: float | None
    final_loss: float | None
    losses: list[float]
    wall_seconds: float
    tokens_per_s: float
    samples_per_s: float
    state_bytes: list[dict[str, int]]
    peak_memory_bytes: list[int] | None
    saves: int
    save_seconds: float
    blocked_seconds: float
    checkpoints: list[str] = field(default_factory=list)
    latest: str | None = None
    scaling: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)
    """What differs from the checkpoint resumed (rank count, sharding, LR schedule, batch)."""
