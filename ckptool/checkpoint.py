"""``Checkpointer``: save, resume and retention for an FSDP2 training script, over DCP.

Owns the life of checkpoints in one run folder: ``step_N/`` written with ``dcp.save`` (or
``dcp.async_save`` in a background process), the ``ckptool.json`` manifest written by rank 0
only after the save has committed, retention of the last K committed checkpoints, and loading
the latest valid one (with load-time resharding, so the rank count may change). It leaves the
on-disk format to ``ckptool.format`` and validity to ``ckptool.ops.validate``.

The run folder may be an fsspec URL (``s3://bucket/run``): DCP then writes through its
``FsspecWriter`` (still ``.metadata`` last), and retention, which cannot rename a folder
atomically there, deletes a checkpoint's ``.metadata`` before its other files.

Keys in a checkpoint: ``model.*`` and ``optim.*`` (from ``get_state_dict``), plus whatever the
caller passes as ``extra`` (e.g. ``lr_scheduler``, ``train``, ``data``).

Example (on every rank, after ``fully_shard``)::

    ckpt = Checkpointer("runs/x", keep=3, async_save=True)
    start = ckpt.load_latest(model, optimizer, extra={"lr_scheduler": sched}) or 0
    for step in range(start + 1, steps + 1):
        ...
        if step % 100 == 0:
            ckpt.save(step, model, optimizer, extra={"lr_scheduler": sched}, loss=loss.item())
    ckpt.close()
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptool.errors import CkptError, ConfigError, CorruptCheckpointError, IncompatibleCheckpointError
from ckptool.format import checkpoint_dirs as layout
from ckptool.format import manifest as mf
from ckptool.run_folder import (deleting_leftovers, fsync_dir, latest_valid, remove_local,
                                remove_remote, retention_victims, step_checkpoints,
                                validation_problem)
from ckptool.storage import Storage, is_url

logger = logging.getLogger(__name__)

RESERVED = ("model", "optim")
#: Where a checkpoint keeps its Hugging Face asset files (as ``ckptool import`` writes them).
ASSETS_DIR = "hf_assets"


@dataclass
class SaveStats:
    """Seconds spent saving. ``blocked_seconds`` is what training waited for; for a
    synchronous save it equals ``save_seconds``, for an async one it is the staging copy
    (plus waiting for the previous save, if it was still running)."""

    saves: int = 0
    save_seconds: float = 0.0
    blocked_seconds: float = 0.0
    last_save_seconds: float = 0.0
    last_blocked_seconds: float = 0.0


@dataclass
class _Pending:
    step: int
    path: Path | str
    loss: float | None
    started: float
    future: Any
    stager: Any
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def _world_size() -> int:
    d = _dist()
    return d.get_world_size() if d else 1


def _barrier() -> None:
    d = _dist()
    if d:
        d.barrier()


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    d = _dist()
    if not d:
        return obj
    box = [obj]
    d.broadcast_object_list(box, src=0)
    return box[0]


class Checkpointer:
    """Saves and restores model, optimizer and extra state under ``out_dir/step_N``.

    Args:
        out_dir: the run folder: a local path or an fsspec URL such as ``s3://bucket/run``
            (credentials and endpoint come from the environment, as for s3fs).
        keep: committed checkpoints to keep (0 keeps all). The newest committed one is never
            deleted; torn folders older than it are removed.
        async_save: use ``dcp.async_save`` in a background process; at most one save is in
            flight, and a new ``save`` first waits for the previous one.
        config: JSON-able dict recorded in each manifest (e.g. the training config).
        hf_config: a Hugging Face ``PretrainedConfig`` (or its dict) of the model: recorded as
            ``config["hf_config"]``, so ``consolidate`` and ``upload`` write its ``config.json``.
        hf_assets: asset file name (``config.json``, tokenizer files, ...) -> bytes: written
            into every checkpoint's ``hf_assets/`` and listed as ``config["hf_assets"]`` (as
            ``ckptool import`` does), so ``consolidate`` and ``upload`` export them too.

    Example:
        >>> ckpt = Checkpointer("runs/x", keep=2)
        >>> step = ckpt.load_latest(model, optimizer)       # None on a fresh run
        >>> ckpt.save(100, model, optimizer, extra={"lr_scheduler": sched}, loss=2.31)
        >>> ckpt.close()
    """

    def __init__(self, out_dir: str | os.PathLike[str], keep: int = 3, async_save: bool = False, *,
                 config: dict[str, Any] | None = None, hf_config: Any = None,
                 hf_assets: dict[str, bytes] | None = None) -> None:
        if keep < 0:
            raise ConfigError(f"keep must be 0 (keep all) or positive, got {keep}")
        # A URL stays a string: Path() would fold "s3://" into "s3:/".
        self.root: Path | str = os.fspath(out_dir).rstrip("/") if is_url(out_dir) else Path(out_dir)
        self.keep = keep
        self.async_save = async_save
        self.config = dict(config or {})
        if hf_config is not None:  # a transformers PretrainedConfig or its dict
            cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
            self.config["hf_config"] = cfg
        self.hf_assets = dict(hf_assets or {})
        if self.hf_assets:
            self.config["hf_assets"] = {name: f"{ASSETS_DIR}/{name}" for name in sorted(self.hf_assets)}
        self.stats = SaveStats()
        self.last_loaded: str | None = None
        self._pending: _Pending | None = None
        self._group: Any = None

    # -- saving -----------------------------------------------------------------------------
    def save(self, step: int, model: Any, optimizer: Any, *, extra: dict[str, Any] | None = None,
             loss: float | None = None) -> Path | str:
        """Save a checkpoint as ``out_dir/step_{step}`` (called on all ranks).

        Args:
            step: the training step; names the folder.
            model: the (FSDP2-sharded) model.
            optimizer: its optimizer (state saved with ``get_state_dict``).
            extra: more top-level entries: tensors, plain values or ``Stateful`` objects
                (anything with ``state_dict``/``load_state_dict``, e.g. an LR scheduler).
            loss: recorded in the manifest.

        Returns:
            The checkpoint folder (a URL string for a remote run). For an async save it is
            committed only once ``wait()`` returns (or the next ``save`` starts).

        Raises:
            CkptError: the save (or the previous async save) failed.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        self._wait_pending()  # at most one save in flight
        path = self._child(f"step_{step}")
        self._prepare_folder(path)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, **self._check_extra(extra)}
        if self.async_save:
            self._start_async(state, step, path, loss, t0)
        else:
            try:
                dcp.save(state, checkpoint_id=str(path))
            except dcp.CheckpointException as e:  # a BaseException: `except Exception` misses it
                raise CkptError(f"saving {path} failed: {_first_line(e)}", path=str(path)) from e
            self._committed(step, path, loss)
            took = time.perf_counter() - t0
            self._account(took, took)
        return path

    def save_model(self, model: Any, *, name: str = "final_model", step: int | None = None,
                   loss: float | None = None) -> Path | str:
        """Save the model weights alone (keys ``model.*``) as ``out_dir/name``, synchronously
        (called on all ranks). Retention and resume ignore it (it is no ``step_N`` folder)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        self.wait()
        path = self._child(name)
        self._prepare_folder(path)
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(path))
        if _rank() == 0:
            storage = Storage.open(path)
            manifest = mf.build_manifest(storage, step=step, world_size=_world_size(), loss=loss,
                                         config=self.config)
            manifest.files.update(self._write_assets(storage))
            mf.write_manifest(storage, manifest)
        return path

    def _write_assets(self, storage: Storage) -> dict[str, dict[str, Any]]:
        """Write ``hf_assets`` into the checkpoint (rank 0, before its manifest); their entries."""
        out = {}
        for name, data in sorted(self.hf_assets.items()):
            rel = f"{ASSETS_DIR}/{name}"
            storage.makedirs(ASSETS_DIR)
            storage.write_bytes(rel, data)
            size, digest = mf.file_checksum(storage, rel)
            out[rel] = {"size": size, mf.CHECKSUM: digest}
        return out

    @staticmethod
    def _check_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
        extra = dict(extra or {})
        clash = [k for k in RESERVED if k in extra]
        if clash:
            raise ConfigError(f"extra state may not use the reserved keys {clash}")
        return extra

    def _child(self, name: str) -> Path | str:
        return f"{self.root}/{name}" if isinstance(self.root, str) else self.root / name

    def _prepare_folder(self, path: Path | str) -> None:
        # A leftover folder of the same name (torn, or from a run resumed at an older step)
        # would mix old and new files under one .metadata: remove it first.
        if _rank() == 0:
            if isinstance(self.root, str):
                if Storage.open(path).exists():
                    logger.warning("replacing existing %s", path)
                    remove_remote(self.root, _name(path))
            else:
                self.root.mkdir(parents=True, exist_ok=True)
                if path.exists():
                    logger.warning("replacing existing %s", path)
                    remove_local(self.root, path.name)
        _barrier()

    def _start_async(self, state: dict[str, Any], step: int, path: Path | str, loss: float | None,
                     t0: float) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._group is None and _dist():
            # Its own gloo group: on the default group the background save's collectives
            # collide with training's (gloo "Received data size doesn't match expected size").
            self._group = dist.new_group(backend="gloo")
        # The default StagingOptions() want pinned memory and non-blocking copies, which need
        # an accelerator; a plain synchronous copy to CPU works everywhere.
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                              use_async_staging=False, use_non_blocking_copy=False))
        future = dcp.async_save(state, checkpoint_id=str(path), process_group=self._group,
                                async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
        pending = _Pending(step, path, loss, t0, future, stager)
        self._pending = pending
        self._account(None, time.perf_counter() - t0)
        future.add_done_callback(lambda _f: self._async_done(pending))

    def _async_done(self, p: _Pending) -> None:
        # Runs in the executor thread once the background save finished on this rank; every
        # rank's future completes only after rank 0 wrote .metadata, so the save is durable.
        try:
            p.stager.close()
            exc = p.future.exception()
            if exc is not None:
                p.error = exc
            else:
                self._committed(p.step, p.path, p.loss)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread by wait()
            p.error = e
        finally:
            self._account(time.perf_counter() - p.started, None)
            p.done.set()

    def _committed(self, step: int, path: Path | str, loss: float | None) -> None:
        if _rank() != 0:
            return
        # DCP fsyncs the files and .metadata but not the folder: make the rename of .metadata
        # durable before anything (manifest, retention) treats the save as done. (An object
        # store has no folders: each PUT is durable once it returns.)
        local = isinstance(path, Path)
        if local:
            fsync_dir(path)
        storage = Storage.open(path)
        manifest = mf.build_manifest(storage, step=step, world_size=_world_size(), loss=loss,
                                     config=self.config)
        manifest.files.update(self._write_assets(storage))
        mf.write_manifest(storage, manifest)
        if local:
            fsync_dir(path)
        logger.info("saved %s", path)
        self._retain()

    def _account(self, save_s: float | None, blocked_s: float | None) -> None:
        if save_s is not None:
            self.stats.saves += 1
            self.stats.save_seconds += save_s
            self.stats.last_save_seconds = save_s
        if blocked_s is not None:
            self.stats.blocked_seconds += blocked_s
            self.stats.last_blocked_seconds = blocked_s

    def wait(self) -> None:
        """Block until the async save in flight (if any) is committed (called on all ranks).

        Time spent here is not counted in ``stats.blocked_seconds`` (that is the time
        ``save`` held training up).

        Raises:
            CkptError: that save failed.
        """
        self._wait_pending()

    def _wait_pending(self) -> None:
        p, self._pending = self._pending, None
        if p is None:
            return
        p.done.wait()
        if p.error is not None:
            raise CkptError(f"async save of {p.path} failed: {_first_line(p.error)}",
                            path=str(p.path)) from p.error

    def close(self) -> None:
        """Wait for the save in flight and release the background group (called on all ranks)."""
        try:
            self.wait()
        finally:
            d = _dist()
            if self._group is not None and d:
                d.destroy_process_group(self._group)
            self._group = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- retention --------------------------------------------------------------------------
    def _retain(self) -> None:
        """Apply ``retention_victims`` to the run folder (rank 0 only)."""
        p = self._pending
        inflight = p.step if p is not None and not p.done.is_set() else None
        for c in retention_victims(step_checkpoints(self.root), self.keep, inflight=inflight):
            logger.info("retention: removing %s", c.url)
            if isinstance(self.root, str):
                remove_remote(self.root, c.name)
            else:
                remove_local(self.root, c.name)
        if isinstance(self.root, str):
            return  # remote removal renames nothing, so it leaves no hidden leftovers
        for leftover in deleting_leftovers(self.root):  # from a removal a crash cut short
            shutil.rmtree(self.root / leftover, ignore_errors=True)

    # -- loading ----------------------------------------------------------------------------
    def list(self) -> list[layout.CheckpointDir]:
        """Every ``step_N`` folder in the run, oldest first, committed or not (``.committed``)."""
        return step_checkpoints(self.root)

    def latest(self) -> layout.CheckpointDir | None:
        """The newest committed checkpoint that passes ``ckptool.ops.validate``, or None."""
        return latest_valid(self.root)

    def load_latest(self, model: Any, optimizer: Any, *, extra: dict[str, Any] | None = None) -> int | None:
        """Restore the newest valid checkpoint, if any (called on all ranks).

        Rank 0 picks the checkpoint and tells the others. Works at any rank count: DCP
        reshards on load.

        Args:
            model: the sharded model to load into.
            optimizer: its optimizer.
            extra: the same keys as given to ``save``; tensors and ``Stateful`` objects are
                restored in place, plain values are replaced in this dict.

        Returns:
            The step of the loaded checkpoint, or None when the run folder has none.
        """
        found = self.latest() if _rank() == 0 else None
        path = _broadcast(str(found.url) if found is not None else None)
        if path is None:
            return None
        return self.load(path, model, optimizer, extra=extra, check=False)

    def load(self, path: str | os.PathLike[str], model: Any, optimizer: Any, *,
             extra: dict[str, Any] | None = None, check: bool = True) -> int:
        """Restore one checkpoint folder into ``model``, ``optimizer`` and ``extra`` (called on
        all ranks). Returns the step from the folder name (0 if it has none).

        Args:
            path: a checkpoint folder (``step_N``).
            model: the sharded model to load into.
            optimizer: its optimizer.
            extra: as for ``load_latest``.
            check: validate first on rank 0 (torch's reader unpickles ``.metadata``
                unrestricted, so an unchecked folder is never handed to it).

        Raises:
            CorruptCheckpointError: ``validate`` found errors.
            IncompatibleCheckpointError: keys or shapes do not match the model.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        shapes = {k: tuple(v.shape) for k, v in model_sd.items() if hasattr(v, "shape")}
        # Rank 0 reads the index once (safely) and every rank hears the verdict.
        invalid, mismatch = _broadcast(_load_problems(path, shapes, check) if _rank() == 0
                                       else None)
        if invalid is not None:
            raise CorruptCheckpointError(f"{path} is not a loadable checkpoint: {invalid}", path=str(path),
                                         hint=f"Run 'ckptool validate {path}' for details")
        if mismatch is not None:  # DCP would load the keys it is asked for and ignore the rest
            raise IncompatibleCheckpointError(
                f"cannot load {path} into this model: {mismatch}", path=str(path),
                hint="Build the model the checkpoint was saved from, or start without it")
        state = {"model": model_sd, "optim": optim_sd, **self._check_extra(extra)}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (Exception, dcp.CheckpointException) as e:
            if isinstance(e, CkptError):
                raise
            raise IncompatibleCheckpointError(
                f"cannot load {path} into this model: {_first_line(e)}", path=str(path),
                hint="Check that --model and sizes match the run that saved it, or use --no-resume",
            ) from e
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if extra is not None:
            extra.update({k: state[k] for k in extra})
        self.last_loaded = str(path)
        return layout.step_of(_name(path)) or 0

    def load_pretrained(self, model: Any, path: str | os.PathLike[str], *,
                        tmp_dir: str | os.PathLike[str] | None = None) -> str:
        """Load model weights only (no optimizer, no step) into ``model`` (called on all ranks).

        ``path`` is a DCP checkpoint with ``model.*`` keys (``ckptool import`` output, a
        ``step_N`` or ``final_model`` folder) or a Hugging Face safetensors folder, file or Hub
        repo id, which rank 0 imports first into a temporary checkpoint for this world size
        (removed afterwards). Any rank count works: DCP reshards on load.

        Args:
            model: the (FSDP2-sharded) model; its ``state_dict()`` keys must all be in ``path``.
            path: the checkpoint or Hugging Face model.
            tmp_dir: where a Hugging Face model is imported (default: the system temp folder;
                on several nodes give a shared one, or run ``ckptool import`` once instead).

        Returns:
            The DCP checkpoint folder loaded from.

        Raises:
            CorruptCheckpointError: ``validate`` found errors in the checkpoint.
            IncompatibleCheckpointError: keys or shapes do not match the model.
            CkptError: the Hugging Face model could not be imported.

        Example:
            >>> Checkpointer("runs/ft").load_pretrained(model, "models/llama-tiny")
        """
        tmp, problem = None, None
        if _rank() == 0:
            try:
                tmp = _import_pretrained(path, _world_size(), tmp_dir)
            except CkptError as e:
                problem = str(e)
        tmp, problem = _broadcast((str(tmp) if tmp else None, problem))
        if problem is not None:
            raise CkptError(problem, path=os.fspath(path))
        try:
            ckpt = tmp or os.fspath(path)
            _load_model_weights(model, ckpt)
        finally:
            _barrier()
            if tmp and _rank() == 0:
                shutil.rmtree(Path(tmp).parent, ignore_errors=True)
        self.last_loaded = os.fspath(path)
        return os.fspath(path) if tmp is None else tmp


def _import_pretrained(path: str | os.PathLike[str], world_size: int,
                       tmp_dir: str | os.PathLike[str] | None) -> Path | None:
    """Import a Hugging Face model into a temporary checkpoint; None for a DCP checkpoint."""
    import tempfile

    from ckptool.ops.import_hf import import_hf, is_repo_id

    p = Path(os.fspath(path))
    hf = is_repo_id(path) or (p.is_file() and not is_url(path)) or (
        p.is_dir() and not (p / layout.METADATA).exists()
        and any(q.suffix in (".safetensors", ".bin") or q.name == "config.json" for q in p.iterdir()))
    if not hf:
        return None
    folder = Path(tempfile.mkdtemp(prefix="ckptool-pretrained-", dir=tmp_dir))
    try:
        return Path(import_hf(path, folder / "model", world_size=world_size, dtype="keep").destination)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _load_model_weights(model: Any, path: str) -> None:
    """``dcp.load`` of the model's state (keys ``model.*``), then ``set_model_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)

    state = {"model": get_model_state_dict(model)}
    shapes = {k: tuple(v.shape) for k, v in state["model"].items() if hasattr(v, "shape")}
    invalid, mismatch = _broadcast(_load_problems(path, shapes, True) if _rank() == 0 else None)
    if invalid is not None:
        raise CorruptCheckpointError(f"{path} is not a loadable checkpoint: {invalid}", path=path,
                                     hint=f"Run 'ckptool validate {path}' for details")
    if mismatch is not None:  # DCP would load the keys asked for and ignore the rest
        raise IncompatibleCheckpointError(f"cannot load {path} into this model: {mismatch}",
                                          path=path, hint="Load weights saved from this model")
    try:
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    except (Exception, dcp.CheckpointException) as e:
        if isinstance(e, CkptError):
            raise
        raise IncompatibleCheckpointError(
            f"cannot load the weights of {path} into this model: {_first_line(e)}", path=path,
            hint="Check that the model's architecture and sizes match the checkpoint") from e


def _name(path: str | os.PathLike[str]) -> str:
    """The last component of a path or URL."""
    return os.fspath(path).rstrip("/").rsplit("/", 1)[-1]


def _load_problems(path: str | os.PathLike[str], shapes: dict[str, tuple[int, ...]],
                   check: bool) -> tuple[str | None, str | None]:
    """(why the checkpoint is not valid, how its model differs from ``shapes``), each None when
    fine; the index is read once, with ckptool's safe reader (never torch's pickle.load)."""
    from ckptool.format.metadata import read_metadata

    if check:
        problem, meta = validation_problem(path)
        if problem is not None or meta is None:
            return problem, None
    else:
        meta = read_metadata(Storage.open(path))
    return None, _model_mismatch(path, meta, shapes)


def _model_mismatch(path: str | os.PathLike[str], meta: Any,
                    shapes: dict[str, tuple[int, ...]]) -> str | None:
    """How the checkpoint's model tensors differ from ``shapes`` (name -> global shape), if
    they do: extra or missing tensors, or other shapes."""
    from ckptool.format.state_layout import Group, read_layout

    storage = Storage.open(path)
    lay = read_layout(meta, keep_wrappers=True, ckptool_manifest=mf.read_manifest(storage) is not None)
    saved = {lay.names[k]: meta.tensors[k].shape for k in lay.keys(Group.MODEL) if k in lay.names}
    extra = sorted(set(saved) - set(shapes))
    missing = sorted(set(shapes) - set(saved))
    other = sorted(k for k in set(saved) & set(shapes) if saved[k] != shapes[k])

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    if extra:
        return f"the checkpoint has {len(extra)} tensors this model lacks ({some(extra)})"
    if missing:
        return f"this model has {len(missing)} tensors the checkpoint lacks ({some(missing)})"
    if other:
        k = other[0]
        return (f"{k} is {list(saved[k])} in the checkpoint, {list(shapes[k])} in this model"
                + (f" (and {len(other) - 1} more)" if len(other) > 1 else ""))
    return None


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] if text else type(e).__name__
