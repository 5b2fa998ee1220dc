"""Export a sharded DCP checkpoint's model weights to safetensors, streaming, in bounded memory.

The plan comes from ``.metadata`` alone: output names, dtypes, shapes and byte offsets, split
into HF-style shards. Headers are written first, then data is placed with positioned writes,
so copies run in source order: each source file is read front to back (remote: over one
streamed request per file, several files at once). The copy jobs are ``ops/chunk_copier.py``.

Row-block chunks (FSDP2 ``Shard(0)``: offsets ``(k, 0, ..)``, full trailing dims) are one
contiguous byte range of the output. They are copied in-kernel (``copy_file_range``) while a
second thread reads the same file to check every record's CRC-32; when the bytes must pass
through Python anyway (a cast, ``verify``, a remote source) each 8 MiB block is read once,
checked, cast and written. Any other chunk layout is assembled one tensor at a time.

Peak memory: an 8 MiB buffer (plus its cast) per worker, and for non-row-block tensors one
full tensor; never the model. Output goes to a temporary name, fsynced, renamed at the end
(``atomic_path``). Torch-free: casts are numpy (``cast_bytes``), bit-exact with torch.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ckptool._version import __version__
from ckptool.errors import (CheckpointNotFoundError, ConfigError, IncompleteCheckpointError,
                            NoCheckpointError)
from ckptool.format.dtypes import CAST_TARGETS, DTYPES, DType
from ckptool.format.checkpoint_dirs import CheckpointDir, resolve_checkpoint, step_of
from ckptool.format.manifest import Manifest, read_manifest
from ckptool.format.metadata import CheckpointMetadata, TensorEntry
from ckptool.format.state_layout import StateLayout, read_layout
from ckptool.format.copy_engine import Progress
from ckptool.format.reader import CheckpointReader
from ckptool.format.safetensors_writer import (CASTABLE, INDEX_NAME, FileLayout, StagedOutput,
                                               TensorSpec, index_json, plan_file, shard_filenames,
                                               split_shards)
from ckptool.ops import hf_assets as hf_assets_mod
from ckptool.ops.chunk_copier import Copier, Piece
from ckptool.storage import Storage, is_url

#: huggingface_hub's default ``max_shard_size``.
DEFAULT_MAX_SHARD = 5 * 10**9


@dataclass(frozen=True)
class ConsolidateResult:
    """What ``consolidate`` wrote.

    Attributes:
        source: the DCP folder read (for Accelerate output, its model part).
        destination: the ``.safetensors`` file or the folder written.
        files: every file written, index last when there is one.
        tensors: number of tensors exported.
        bytes: tensor data bytes written (after any cast).
        seconds: wall time.
        step, world_size: provenance of the source.
        dtype: the cast target, or None when bytes were copied as saved.
        verified: the output was re-read and matched the source checksums.
        note: how the model's keys were found when another reading was possible (say it).
        removed: files of an earlier export that ``force`` replaced or deleted.
        assets: ``config.json``, tokenizer and other asset files written beside the weights.
        tied: the input embedding ``lm_head.weight`` was found tied to (and left out), if any.
    """

    source: str
    destination: str
    files: tuple[str, ...]
    tensors: int
    bytes: int
    seconds: float
    step: int | None
    world_size: int | None
    dtype: str | None
    verified: bool
    note: str | None = None
    removed: tuple[str, ...] = ()
    assets: tuple[str, ...] = ()
    tied: str | None = None


def consolidate(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                dtype: str | None = None, max_shard_size: int | None = None,
                include: Iterable[str] = (), exclude: Iterable[str] = (), keep_prefix: bool = False,
                model_key: str | None = None, keep_wrappers: bool = False,
                hf_assets: str | os.PathLike[str] | None = None, force: bool = False,
                verify: bool = False, check_crc: bool = True, workers: int | None = None,
                progress: Progress | None = None) -> ConsolidateResult:
    """Write a checkpoint's model weights as safetensors, streaming chunk bytes in bounded
    memory (an 8 MiB block per worker, plus one full tensor for non-row-block layouts).

    Args:
        src: a committed checkpoint: DCP folder (local or fsspec URL), ``step_N``/``step-N``,
            or Accelerate ``save_state`` output (its ``pytorch_model_fsdp_0`` part is read).
        dst: ``*.safetensors`` for one file, else a folder for HF-style shards
            (``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``).
        dtype: cast floating tensors to ``float32``, ``bfloat16`` or ``float16``.
        max_shard_size: data bytes per shard in folder mode (default 5 GB; a bigger tensor
            gets its own). An error with a ``.safetensors`` output, which is one file.
        include, exclude: fnmatch patterns on output names: kept if some include (or none)
            and no exclude match.
        keep_prefix: name tensors by their full DCP key (``model.`` level included).
        model_key: the model's sub-tree, dotted (``app.model``); default: found from records.
        keep_wrappers: keep ``_orig_mod.``, ``_checkpoint_wrapped_module.``, ... in names.
        hf_assets: a HF model folder or Hub repo id whose config and tokenizer files go beside
            the weights (default: those the manifest records). Folder OUTPUT only.
        force: replace an existing output (of a folder, only its weight files); else refuse.
        verify: re-read the output and compare xxh3 checksums with the bytes copied.
        check_crc: check every source record's CRC-32 (False saves a read of the source).
        workers: threads for copy and check jobs (default 2; 8 files streamed at once if remote).
        progress: called as ``progress(bytes_done, bytes_total)`` from the calling thread; an
            exception it raises (e.g. ``KeyboardInterrupt``) aborts and removes the output.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError: the source
            fails ``validate`` (first problem in the message) or its bytes are damaged.
        ConfigError: a bad option, or filters that match nothing.
        CkptError: ``verify`` found the output differs from the source.

    Example:
        >>> r = consolidate("runs/demo/step_40", "model.safetensors", dtype="bfloat16")
    """
    t0 = time.perf_counter()
    dst, single = _output(dst, max_shard_size, hf_assets)
    plan = _plan(src, dst, single, cast=_cast_target(dtype), max_shard_size=max_shard_size,
                 include=include, exclude=exclude, keep_prefix=keep_prefix, model_key=model_key,
                 keep_wrappers=keep_wrappers, hf_assets=hf_assets)
    staged = StagedOutput(dst, single=single, replace=force)
    files = _write(plan, staged, verify=verify, check_crc=check_crc, workers=workers,
                   progress=progress)
    return _result(plan, files, staged, verify=verify, seconds=time.perf_counter() - t0)


def _write(plan: _Plan, staged: StagedOutput, *, verify: bool, check_crc: bool,
           workers: int | None, progress: Progress | None) -> list[Path]:
    """Copy the planned bytes into the staged output, with the index and assets; every file
    written (final paths), index last."""
    inline = plan.cast is not None or verify
    dst, single = staged.dst, staged.single
    with CheckpointReader(plan.storage, plan.meta) as ck, staged as out_dir:
        paths = [out_dir] if single else [out_dir / lay.filename for lay in plan.layouts]
        copier = Copier(ck, check_crc=check_crc, track=verify, inline=inline)
        copier.run(paths, plan.layouts, plan.pieces, plan.whole, workers, progress)
        if len(plan.layouts) > 1:
            (out_dir / INDEX_NAME).write_bytes(index_json(plan.layouts))
        for name, data in plan.assets.items():
            (out_dir / name).write_bytes(data)
        for out in copier.outs if verify else ():
            out.verify()
    files = [dst] if single else [dst / lay.filename for lay in plan.layouts]
    files += [dst / INDEX_NAME] if len(plan.layouts) > 1 else []
    return files + [dst / name for name in sorted(plan.assets)]


def _result(plan: _Plan, files: list[Path], staged: StagedOutput, *, verify: bool,
            seconds: float) -> ConsolidateResult:
    return ConsolidateResult(
        source=plan.storage.url, destination=str(staged.dst), files=tuple(map(str, files)),
        tensors=len(plan.selected), bytes=sum(lay.data_bytes for lay in plan.layouts),
        seconds=seconds, step=_int_or_none(plan.header.get("source_step")),
        world_size=plan.meta.world_size, dtype=plan.cast.name if plan.cast else None,
        verified=verify, note=plan.note, removed=tuple(staged.removed),
        assets=tuple(sorted(plan.assets)), tied=plan.tied)


@dataclass(frozen=True)
class _Plan:
    """Everything decided from the index before a byte is copied."""

    storage: Storage
    meta: CheckpointMetadata
    cast: DType | None
    selected: list[tuple[TensorEntry, str]]
    layouts: list[FileLayout]
    pieces: list[Piece]
    whole: list[Piece]
    assets: dict[str, bytes]     # written beside the weights (folder output only)
    header: dict[str, str]
    tied: str | None
    note: str | None


def _output(dst: str | os.PathLike[str], max_shard_size: int | None,
            hf_assets: str | os.PathLike[str] | None) -> tuple[Path, bool]:
    """The local output path and whether it is one file; options that cannot apply refused."""
    if max_shard_size is not None and max_shard_size <= 0:
        raise ConfigError(f"--max-shard-size must be positive, got {max_shard_size}")
    path = _local_dst(dst)
    single = path.suffix == ".safetensors" and not path.is_dir()
    if single and max_shard_size is not None:
        raise ConfigError(f"--max-shard-size applies to a folder output; {path.name} is one file",
                          hint="Drop --max-shard-size, or give a folder as OUTPUT to get shards")
    if single and hf_assets is not None:
        raise ConfigError("--hf-assets needs a folder OUTPUT (from_pretrained loads a folder)",
                          hint=f"Give a folder instead of {path.name}")
    return path, single


def _plan(src: str | os.PathLike[str], dst: Path, single: bool, *, cast: DType | None,
          max_shard_size: int | None, include: Iterable[str], exclude: Iterable[str],
          keep_prefix: bool, model_key: str | None, keep_wrappers: bool,
          hf_assets: str | os.PathLike[str] | None) -> _Plan:
    """Everything decided before a byte is copied, from the source's index and manifest."""
    ckpt, meta = _open_source(src)
    _check_destination(dst, ckpt)
    storage = ckpt.part(ckpt.model_part)
    man = read_manifest(storage)
    layout = read_layout(meta, model_key=model_key, keep_wrappers=keep_wrappers,
                         ckptool_manifest=man is not None, where=ckpt.url)
    selected = _select(meta, layout, include, exclude, keep_prefix, ckpt.url)
    assets = hf_assets_mod.collect(storage, man, hf_assets)
    tied, note = None, layout.note
    if single and assets:
        note = "; ".join(filter(None, [note, "the checkpoint knows its config.json and tokenizer "
                                       "files: give a folder OUTPUT to write them beside the "
                                       "weights (from_pretrained loads a folder)"]))
        assets = {}
    elif not single and not keep_prefix:
        with CheckpointReader(storage, meta) as ck:
            selected, tied = hf_assets_mod.untie(ck, selected, hf_assets_mod.config_of(assets))
    specs = [TensorSpec(name, _out_dtype(t.dtype, cast), t.shape) for t, name in selected]
    groups = [specs] if single else split_shards(specs, max_shard_size or DEFAULT_MAX_SHARD)
    names = [dst.name] if single else shard_filenames(len(groups))
    header = _provenance(ckpt, meta, man, cast)
    layouts = [plan_file(n, g, header) for n, g in zip(names, groups)]
    pieces, whole = _plan_copies(selected, layouts, cast)
    return _Plan(storage, meta, cast, selected, layouts, pieces, whole, assets, header, tied,
                 note)


# ---------------------------------------------------------------------------------------------
# Planning (metadata only)


def _cast_target(dtype: str | None) -> DType | None:
    if dtype is None:
        return None
    if dtype not in CAST_TARGETS:
        raise ConfigError(f"cannot cast to {dtype!r}; use one of {', '.join(CAST_TARGETS)}")
    return DTYPES[dtype]


def _out_dtype(src: DType, cast: DType | None) -> DType:
    return cast if cast is not None and src.name in CASTABLE else src


def _local_dst(dst: str | os.PathLike[str]) -> Path:
    if not os.fspath(dst).strip():
        raise ConfigError("OUTPUT is empty; give a .safetensors file name or a folder")
    if is_url(dst):
        raise ConfigError(f"{os.fspath(dst)}: consolidate writes to a local path; write locally "
                          "and use 'ckptool upload' to ship the result")
    return Path(os.path.abspath(os.fspath(dst)))


def _check_destination(dst: Path, ckpt: CheckpointDir) -> None:
    """Never write into the source checkpoint, over it, or into its run's checkpoint list."""
    if not ckpt.storage.is_local:
        return
    src = Path(ckpt.url).resolve()
    out = dst.resolve()
    if out == src or src in out.parents or out in src.parents:
        raise ConfigError(f"OUTPUT {dst} is inside, or holds, the source checkpoint {src}",
                          hint="Write the export to a folder outside the checkpoint and its run")
    if out.parent == src.parent and step_of(out.name) is not None:
        raise ConfigError(f"OUTPUT {dst} would be listed as a checkpoint of the run {src.parent}",
                          hint="Choose a name that is not step_N / checkpoint-N, or another folder")


def _open_source(src: str | os.PathLike[str]) -> tuple[CheckpointDir, CheckpointMetadata]:
    """Resolve and structurally validate the model part; raise validate's first finding."""
    from ckptool.ops.validate import require_valid

    try:
        ckpt = resolve_checkpoint(src)
    except CheckpointNotFoundError as e:
        if not isinstance(e, NoCheckpointError):
            raise
        raise IncompleteCheckpointError(str(e), path=e.path) from None
    ckpt = dataclasses.replace(ckpt, parts=(ckpt.model_part,))
    report = require_valid(ckpt, action="consolidate")
    return ckpt, report.metadata[ckpt.model_part]


def _select(meta: CheckpointMetadata, layout: StateLayout, include: Iterable[str],
            exclude: Iterable[str], keep_prefix: bool, where: str) -> list[tuple[TensorEntry, str]]:
    inc, exc = tuple(include), tuple(exclude)
    out = []
    for fqn, name in layout.names.items():
        name = fqn if keep_prefix else name
        if inc and not any(fnmatch.fnmatchcase(name, p) for p in inc):
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in exc):
            continue
        out.append((meta.tensors[fqn], name))
    if not out:
        if not (inc or exc):
            raise ConfigError(f"{where}: no model weights found", hint=f"'ckptool inspect {where}' "
                              "lists its keys; choose the model's sub-tree with --model-key")
        raise ConfigError(f"{where}: no tensor matches the filters; check --include/--exclude "
                          f"against 'ckptool inspect {where}'")
    return out


def _provenance(ckpt: CheckpointDir, meta: CheckpointMetadata, man: Manifest | None,
                cast: DType | None) -> dict[str, str]:
    """The header's ``__metadata__`` (str -> str): format, source, and the model config when
    the checkpoint's ``ckptool.json`` records one (``examples/generate.py`` builds the model
    from it)."""
    step = man.step if man is not None and man.step is not None else ckpt.step
    out = {"format": "pt", "ckptool_version": __version__, "source_checkpoint": ckpt.name}
    if step is not None:
        out["source_step"] = str(step)
    if meta.world_size is not None:
        out["source_world_size"] = str(meta.world_size)
    if cast is not None:
        out["dtype"] = cast.name
    model_config = man.config.get("model_config") if man is not None else None
    if isinstance(model_config, dict):
        out["ckptool_model_config"] = json.dumps(model_config, sort_keys=True)
    return out


def _int_or_none(s: str | None) -> int | None:
    return int(s) if s is not None else None


def _plan_copies(selected: list[tuple[TensorEntry, str]], layouts: list[FileLayout],
                 cast: DType | None) -> tuple[list[Piece], list[Piece]]:
    """Row-block pieces (one per non-empty chunk) and whole tensors assembled in memory."""
    where = {t.name: (i, lay.offsets[t.name]) for i, lay in enumerate(layouts) for t in lay.tensors}
    pieces, whole = [], []
    for t, name in selected:
        out, base = where[name]
        odt = _out_dtype(t.dtype, cast)
        if t.row_blocks() is None:
            whole.append(Piece(t, t.chunks[0], out, base, odt))
            continue
        row = math.prod(t.shape[1:]) * odt.itemsize
        pieces += [Piece(t, c, out, base + (c.offsets[0] if c.offsets else 0) * row, odt)
                   for c in t.chunks if c.numel]
    # Read every source file front to back; output order does not matter (positioned writes).
    pieces.sort(key=lambda p: (p.chunk.storage.relative_path, p.chunk.storage.offset))  # type: ignore[union-attr]
    return pieces, whole
