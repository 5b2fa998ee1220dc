"""What ``ckptool train`` can check before it starts any rank, without importing torch.

Owns the questions a run's options and its run folder answer on their own: does
``--no-resume`` meet a folder that already holds checkpoints, is ``--resume-from`` a loadable
checkpoint, does the checkpoint to resume hold the same model (its ``ckptool.json`` manifest
records the model config), and what changes on resume (rank count, sharding, LR schedule,
batch). Starting ranks costs seconds (a torch import per rank); these answers cost
milliseconds, so the launcher asks them first and the loop asks the model question again on
rank 0 when an external launcher started it. Loading itself is ``ckptool.checkpoint``'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ckptool.errors import CkptError, ConfigError, IncompatibleCheckpointError
from ckptool.train.config import TrainConfig
from ckptool.train.sizes import FLAGS as MODEL_FLAGS



@dataclass(frozen=True)
class Notice:
    """Something the user should know before training starts (printed as one line)."""

    text: str


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run will continue from, and what its manifest says (None: no manifest)."""

    path: str
    world_size: int | None
    config: dict[str, Any] | None


def plan_resume(cfg: TrainConfig) -> Resume | None:
    """The checkpoint ``cfg`` resumes from (None: a fresh start), checked as far as possible.
    ``Resume.path`` is the checkpoint folder itself, also when ``--resume-from`` names a run.

    Raises:
        ConfigError: ``--no-resume`` on a folder with checkpoints, or a ``--resume-from`` that
            is missing or not a loadable checkpoint (usage errors: the fix is an option).
        IncompatibleCheckpointError: its manifest records another model than ``cfg`` builds.
    """
    from ckptool.checkpoint import latest_valid

    if not cfg.resume:
        check_fresh_out(cfg.out)
        return None
    if cfg.resume_from is not None:
        path = check_resume_from(cfg.resume_from)
    else:
        latest = latest_valid(cfg.out)
        if latest is None:
            return None
        path = str(latest.url)
    resume = read_resume(path)
    mismatch = model_mismatch(resume, cfg)
    if mismatch:
        raise IncompatibleCheckpointError(mismatch, path=path)
    return resume


def check_fresh_out(out: str) -> None:
    """``--no-resume``: refuse a run folder that already holds checkpoints.

    Raises:
        ConfigError: it does.
    """
    from ckptool.checkpoint import step_checkpoints

    found = step_checkpoints(out)
    if found:
        raise ConfigError(f"--no-resume: {out} already holds checkpoints ({found[-1].name})", path=out,
                          hint="Pass a new --out, delete the folder, or drop --no-resume to continue it")


def check_resume_from(path: str) -> str:
    """The checkpoint ``--resume-from PATH`` names (a run folder stands for its newest
    committed checkpoint), checked by ``validate``.

    Raises:
        ConfigError: missing, holding no checkpoint, or not loadable; one line naming the option.
    """
    from ckptool.format.checkpoint_dirs import resolve_checkpoint
    from ckptool.ops.validate import validate
    from ckptool.storage import is_url

    if not is_url(path) and not os.path.exists(path):
        raise ConfigError(f"--resume-from {path}: no such folder")
    try:
        ckpt = resolve_checkpoint(path)
        report = validate(ckpt)
    except CkptError as e:
        raise ConfigError(f"--resume-from {path}: {e}") from None
    if not report.ok:
        first = report.errors[0]
        more = f" (and {len(report.errors) - 1} more)" if len(report.errors) > 1 else ""
        raise ConfigError(f"--resume-from {path} is not a loadable checkpoint: {first.code}: "
                          f"{first.message}{more}; 'ckptool validate {path}' lists every problem")
    return str(ckpt.url)


def read_resume(path: str) -> Resume:
    """The manifest facts of the checkpoint at ``path`` (an unreadable manifest counts as none)."""
    from ckptool.format.manifest import read_manifest
    from ckptool.storage import Storage

    try:
        m = read_manifest(Storage.open(path))
    except CkptError:
        m = None
    if m is None:
        return Resume(path, None, None)
    return Resume(path, m.world_size, m.config or None)


def model_mismatch(resume: Resume, cfg: TrainConfig) -> str | None:
    """One line naming every model option that differs from the saved run's, or None.

    Example:
        >>> model_mismatch(Resume("run/step_8", 2, {"model": "tiny", "model_config": {"n_layers": 4}}),
        ...                TrainConfig(n_layers=2))
        'cannot resume run/step_8: it was saved with --layers 4, this run has --layers 2; ...'
    """
    saved = (resume.config or {}).get("model_config")
    if not isinstance(saved, dict):
        return None
    now = cfg.model_config().to_dict()
    diff = [k for k in MODEL_FLAGS if k in saved and saved[k] != now[k]]
    if not diff:
        return None
    was = " ".join(f"{MODEL_FLAGS[k]} {saved[k]}" for k in diff)
    has = " ".join(f"{MODEL_FLAGS[k]} {now[k]}" for k in diff)
    preset = resume.config.get("model")
    if preset and preset != cfg.model:
        was, has = f"--model {preset} ({was})", f"--model {cfg.model} ({has})"
    return (f"cannot resume {resume.path}: it was saved with {was}, this run has {has}; "
            f"pass the saved sizes to continue it, or a new --out to start over")


def resume_notices(resume: Resume | None, cfg: TrainConfig, world_size: int) -> list[Notice]:
    """One line per thing that differs from the saved run and changes how training goes on."""
    if resume is None or resume.config is None:
        return []
    saved, name = resume.config, os.path.basename(resume.path.rstrip("/"))
    out = []
    if resume.world_size and resume.world_size != world_size:
        out.append(f"{name} was saved by {_ranks(resume.world_size)}, loading on {world_size} "
                   f"(DCP reshards on load)")
    was_sharding = _describe_sharding(saved.get("sharding"), saved.get("hybrid_shard_size"))
    now_sharding = _describe_sharding(cfg.sharding, cfg.hybrid_shard_size)
    if saved.get("sharding") and was_sharding != now_sharding:
        out.append(f"{name} was trained with --sharding {was_sharding}; continuing with {now_sharding}")
    was_lr, now_lr = _schedule(saved), _schedule(cfg.to_dict())
    if was_lr is not None and was_lr != now_lr:
        changed = ", ".join(f"{what} {now} (was {then})"
                            for what, then, now in zip(("peak LR", "warmup", "cosine decay to step"), was_lr, now_lr)
                            if then != now)
        keep = f"; pass --lr-decay-steps {was_lr[2]} to keep it" if was_lr[2] != now_lr[2] else ""
        out.append(f"the LR schedule differs from {name}'s: {changed}{keep}")
    for key, flag in (("batch_size", "--batch-size"), ("grad_accum", "--grad-accum"), ("seq_len", "--seq-len")):
        if key in saved and saved[key] != getattr(cfg, key):
            out.append(f"{name} was trained with {flag} {saved[key]}; continuing with {getattr(cfg, key)}")
    return [Notice(t) for t in out]


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _describe_sharding(sharding: Any, shard_size: Any) -> str:
    return f"{sharding} (--hybrid-shard-size {shard_size})" if sharding == "hybrid" and shard_size else str(sharding)


def _schedule(c: dict[str, Any]) -> tuple[float, int, int] | None:
    """(peak LR, warmup steps, decay end) as ``TrainConfig`` resolves them, from a config dict."""
    try:
        decay = c["lr_decay_steps"] if c.get("lr_decay_steps") is not None else int(c["steps"])
        warmup = c["warmup_steps"] if c.get("warmup_steps") is not None else min(100, decay // 10)
        return float(c["lr"]), int(warmup), int(decay)
    except (KeyError, TypeError, ValueError):
        return None
