"""Loading into a model: the checks before DCP sees a checkpoint, and pretrained weights.

Rank 0 reads the checkpoint's index once with ckptool's safe reader (torch's reader unpickles
``.metadata`` unrestricted, so an unchecked folder is never handed to it), validates it if
asked, compares its model tensors with the model's, and every rank hears the verdict. Then
``dcp.load`` reshards onto whatever rank count loads it. ``Checkpointer.load`` and
``Checkpointer.load_pretrained`` are the public entry points.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from ckptool.checkpoint.ranks import barrier, broadcast, first_line, rank, world_size
from ckptool.errors import CkptError, CorruptCheckpointError, IncompatibleCheckpointError
from ckptool.format import checkpoint_dirs as layout
from ckptool.format import manifest as mf
from ckptool.run_folder import validation_problem
from ckptool.storage import Storage, is_url


def load_state(path: str | os.PathLike[str], model: Any, optimizer: Any, extra: dict[str, Any], *,
               check: bool) -> dict[str, Any]:
    """Load model, optimizer and ``extra`` entries from ``path`` (called on all ranks); the
    loaded state (``model``, ``optim`` and ``extra``'s keys). See ``Checkpointer.load``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    check_loadable(path, _shapes(model_sd), check=check,
                   hint="Build the model the checkpoint was saved from, or start without it")
    state = {"model": model_sd, "optim": optim_sd, **extra}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, dcp.CheckpointException) as e:
        if isinstance(e, CkptError):
            raise
        raise IncompatibleCheckpointError(
            f"cannot load {path} into this model: {first_line(e)}", path=str(path),
            hint="Check that --model and sizes match the run that saved it, or use --no-resume",
        ) from e
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state


def load_pretrained(model: Any, path: str | os.PathLike[str], *,
                    tmp_dir: str | os.PathLike[str] | None) -> str:
    """Load weights only into ``model`` (called on all ranks); the DCP folder loaded from.
    A Hugging Face model is first imported by rank 0 into a temporary checkpoint, removed
    afterwards. See ``Checkpointer.load_pretrained``."""
    tmp, problem = None, None
    if rank() == 0:
        try:
            tmp = import_pretrained(path, world_size(), tmp_dir)
        except CkptError as e:
            problem = str(e)
    tmp, problem = broadcast((str(tmp) if tmp else None, problem))
    if problem is not None:
        raise CkptError(problem, path=os.fspath(path))
    try:
        load_model_weights(model, tmp or os.fspath(path))
    finally:
        barrier()
        if tmp and rank() == 0:
            shutil.rmtree(Path(tmp).parent, ignore_errors=True)
    return os.fspath(path) if tmp is None else tmp


def import_pretrained(path: str | os.PathLike[str], world_size: int,
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


def load_model_weights(model: Any, path: str) -> None:
    """``dcp.load`` of the model's state (keys ``model.*``), then ``set_model_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)

    state = {"model": get_model_state_dict(model)}
    check_loadable(path, _shapes(state["model"]), check=True, hint="Load weights saved from this model")
    try:
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    except (Exception, dcp.CheckpointException) as e:
        if isinstance(e, CkptError):
            raise
        raise IncompatibleCheckpointError(
            f"cannot load the weights of {path} into this model: {first_line(e)}", path=path,
            hint="Check that the model's architecture and sizes match the checkpoint") from e


def check_loadable(path: str | os.PathLike[str], shapes: dict[str, tuple[int, ...]], *, check: bool,
                   hint: str) -> None:
    """Raise unless ``path`` is valid (when ``check``) and holds exactly the model tensors
    ``shapes`` (called on all ranks; rank 0 reads, all hear). ``hint`` goes with a mismatch.

    Raises:
        CorruptCheckpointError: ``validate`` found errors.
        IncompatibleCheckpointError: extra, missing or differently shaped model tensors (DCP
            would load the keys it is asked for and silently ignore the rest).
    """
    invalid, mismatch = broadcast(load_problems(path, shapes, check) if rank() == 0 else None)
    if invalid is not None:
        raise CorruptCheckpointError(f"{path} is not a loadable checkpoint: {invalid}", path=str(path),
                                     hint=f"Run 'ckptool validate {path}' for details")
    if mismatch is not None:
        raise IncompatibleCheckpointError(f"cannot load {path} into this model: {mismatch}",
                                          path=str(path), hint=hint)


def _shapes(state_dict: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state_dict.items() if hasattr(v, "shape")}


def load_problems(path: str | os.PathLike[str], shapes: dict[str, tuple[int, ...]],
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
    return None, model_mismatch(path, meta, shapes)


def model_mismatch(path: str | os.PathLike[str], meta: Any,
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
