"""The ``Checkpointer`` class: one run folder's saves, retention, resume and loads.

The steps it strings together live beside it: ``saving`` (manifest, assets, async machinery),
``loading`` (checks before DCP loads, pretrained weights), ``ranks`` (process-group queries)
and ``ckptool.run_folder`` (which checkpoints exist, resume and retention). Storage goes
through one ``Storage`` of the run folder, local or fsspec, decided when it is built.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from ckptool.checkpoint import loading
from ckptool.checkpoint.ranks import barrier, broadcast, dist, first_line, rank, world_size
from ckptool.checkpoint.saving import (ASSETS_DIR, PendingSave, SaveStats, start_async_save,
                                       write_manifest)
from ckptool.errors import CkptError, ConfigError
from ckptool.format import checkpoint_dirs as layout
from ckptool.run_folder import latest_valid, remove_checkpoint, retain, step_checkpoints
from ckptool.storage import Storage, is_url

logger = logging.getLogger(__name__)

RESERVED = ("model", "optim")


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
        self.run = Storage.open(self.root)  # local or fsspec: decided once, here
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
        self._pending: PendingSave | None = None
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
        path = self._prepare_folder(f"step_{step}")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, **self._check_extra(extra)}
        if self.async_save:
            self._start_async(state, step, path, loss, t0)
            return path
        try:
            dcp.save(state, checkpoint_id=str(path))
        except dcp.CheckpointException as e:  # a BaseException: `except Exception` misses it
            raise CkptError(f"saving {path} failed: {first_line(e)}", path=str(path)) from e
        self._committed(step, path, loss)
        took = time.perf_counter() - t0
        self.stats.add(took, took)
        return path

    def save_model(self, model: Any, *, name: str = "final_model", step: int | None = None,
                   loss: float | None = None) -> Path | str:
        """Save the model weights alone (keys ``model.*``) as ``out_dir/name``, synchronously
        (called on all ranks). Retention and resume ignore it (it is no ``step_N`` folder)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        self.wait()
        path = self._prepare_folder(name)
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(path))
        if rank() == 0:
            write_manifest(self.run.child(name), step=step, world_size=world_size(), loss=loss,
                           config=self.config, hf_assets=self.hf_assets)
        return path

    @staticmethod
    def _check_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
        extra = dict(extra or {})
        clash = [k for k in RESERVED if k in extra]
        if clash:
            raise ConfigError(f"extra state may not use the reserved keys {clash}")
        return extra

    def _prepare_folder(self, name: str) -> Path | str:
        """Make the run folder and empty ``name`` in it (rank 0; all ranks wait); its path."""
        # A leftover folder of the same name (torn, or from a run resumed at an older step)
        # would mix old and new files under one .metadata: remove it first.
        path = f"{self.root}/{name}" if isinstance(self.root, str) else self.root / name
        if rank() == 0:
            self.run.makedirs()
            if self.run.child(name).exists():  # a fresh listing, not fsspec's cache
                logger.warning("replacing existing %s", path)
                remove_checkpoint(self.run, name)
        barrier()
        return path

    def _start_async(self, state: dict[str, Any], step: int, path: Path | str, loss: float | None,
                     t0: float) -> None:
        import torch.distributed as torch_dist

        if self._group is None and dist():
            # Its own gloo group: on the default group the background save's collectives
            # collide with training's (gloo "Received data size doesn't match expected size").
            self._group = torch_dist.new_group(backend="gloo")
        future, stager = start_async_save(state, path, self._group)
        pending = PendingSave(step, path, loss, t0, future, stager)
        self._pending = pending
        self.stats.add(None, time.perf_counter() - t0)
        future.add_done_callback(lambda _f: self._async_done(pending))

    def _async_done(self, p: PendingSave) -> None:
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
            self.stats.add(time.perf_counter() - p.started, None)
            p.done.set()

    def _committed(self, step: int, path: Path | str, loss: float | None) -> None:
        """Rank 0, once DCP committed ``path``: manifest, then retention."""
        if rank() != 0:
            return
        storage = self.run.child(f"step_{step}")
        # DCP fsyncs the files and .metadata but not the folder: make the rename of .metadata
        # durable before anything (manifest, retention) treats the save as done. (A no-op on
        # an object store: it has no folders, and each PUT is durable once it returns.)
        storage.fsync()
        write_manifest(storage, step=step, world_size=world_size(), loss=loss, config=self.config,
                       hf_assets=self.hf_assets)
        storage.fsync()
        logger.info("saved %s", path)
        p = self._pending
        inflight = p.step if p is not None and not p.done.is_set() else None
        retain(self.run, self.keep, inflight=inflight)

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
            raise CkptError(f"async save of {p.path} failed: {first_line(p.error)}",
                            path=str(p.path)) from p.error

    def close(self) -> None:
        """Wait for the save in flight and release the background group (called on all ranks)."""
        try:
            self.wait()
        finally:
            d = dist()
            if self._group is not None and d:
                d.destroy_process_group(self._group)
            self._group = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- loading ----------------------------------------------------------------------------
    def list(self) -> list[layout.CheckpointDir]:
        """Every ``step_N`` folder in the run, oldest first, committed or not (``.committed``)."""
        return step_checkpoints(self.run)

    def latest(self) -> layout.CheckpointDir | None:
        """The newest committed checkpoint that passes ``ckptool.ops.validate``, or None."""
        return latest_valid(self.run)

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
        found = self.latest() if rank() == 0 else None
        path = broadcast(str(found.url) if found is not None else None)
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
        state = loading.load_state(path, model, optimizer, self._check_extra(extra), check=check)
        if extra is not None:
            extra.update({k: state[k] for k in extra})
        self.last_loaded = str(path)
        return layout.step_of(os.fspath(path).rstrip("/").rsplit("/", 1)[-1]) or 0

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
        loaded = loading.load_pretrained(model, path, tmp_dir=tmp_dir)
        self.last_loaded = os.fspath(path)
        return loaded
