"""Import a Hugging Face safetensors model as a DCP checkpoint for N FSDP2 ranks, offline.

``import_hf`` is a reshard whose source is a folder of safetensors: output rank ``r`` of
``N`` gets one file, ``__r_0.distcp``, holding exactly its ``torch.chunk`` rows (dim 0) of every
tensor -- what ``fully_shard`` on N ranks, ``get_model_state_dict`` and ``dcp.save`` write --
under keys ``model.<hf name>`` (``planner_data`` keeps the nesting ``("model", name)``).
Records come from ``format/dcp_writer.py`` (byte-identical to ``torch.save``), each chunk's
written by ``ops/import_copy.py``; worker threads, progress, verification and the commit are
reshard's (``ops/reshard.py``).

Bytes move without torch: each output row block is one contiguous range of a source file,
copied in the kernel (``os.copy_file_range``) 512 KiB at a time, the source's bytes re-read
for the record's CRC-32 and, when verifying, the copy's compared with them while both are in
the CPU's cache (safetensors store no checksum to check a copy against); or, when cast
(``--dtype float32``, the default: FSDP2 master weights; bf16 -> fp32 is exact), read and
cast with numpy in 256 KiB blocks, each written and, when verifying, read back and compared at
once. Verification reads each record back right after it is written (its structure; its
data was compared as it was written), and, while the files are fsynced, checks
that the written index points every chunk at a record whose CRC-32s add up to the CRC-32 of
the (cast) source rows. A
tied model whose files store no ``lm_head.weight`` gets it from the input embedding, as
``state_dict()`` lists it. The source's config and tokenizer files are copied to
``hf_assets/`` and listed in ``ckptool.json`` (``config["hf_config"]``,
``config["hf_assets"]``) for a later export.

A local source that fits in half the available memory is read into the page cache front to
back on a thread of its own as the copy starts (``storage.readahead``); for a larger one, each
worker asks for its next rows 128 MiB ahead instead.

Peak memory: one 8 MiB buffer per worker (a cast holds one 256 KiB block and its cast at a
time); it does not grow with the model.
Output goes to a temporary folder renamed at the end: assets, then ``.distcp`` files (fsynced,
records checked as written), then, while the last of them are fsynced, ``.metadata`` and the
verification; ``ckptool.json`` last.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ckptool._version import __version__
from ckptool.errors import ConfigError, IncompatibleCheckpointError
from ckptool.format import manifest as mf
from ckptool.format.crc import crc32_combine
from ckptool.format.dcp_output import (Expected, WrittenFile, check_world_size, file_sizes,
                                       local_workers, read_back_crc, write_rank_files)
from ckptool.format.dcp_writer import V2_DTYPES, write_metadata
from ckptool.format.fsdp_layout import fsdp_chunks
from ckptool.format.dtypes import DTYPES
from ckptool.format.hf_source import (ASSETS_DIR, HEAD_NAME, KNOWN_EMBEDDINGS, HFSource,
                                     input_embeddings, open_source, ties_embeddings)
from ckptool.format.metadata import METADATA, CheckpointMetadata, Chunk, TensorEntry
from ckptool.format.safetensors_writer import CASTABLE
from ckptool.format.copy_engine import (Progress, Ticker, fsync_file, new_output_folder,
                                        unverified)
from ckptool.ops.hf_assets import copy_assets
from ckptool.ops.import_copy import Copier, OutTensor
from ckptool.storage import Storage, atomic_path
from ckptool.storage.readahead import read_ahead

DTYPE_CHOICES = ("float32", "keep")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(?:@[\w./-]+)?")


@dataclass(frozen=True)
class ImportResult:
    """What ``import_hf`` wrote.

    Attributes:
        source: the folder, file or ``repo@commit`` read.
        destination: the checkpoint folder written.
        world_size: ranks of the output (its number of ``.distcp`` files).
        tensors: tensors written (``tied``: of them, copies of a tied embedding).
        bytes_read, bytes: source bytes read, tensor data bytes written.
        dtypes: source dtype -> output dtype, for every cast made.
        assets: asset files copied into ``hf_assets/``.
        files: output file name -> size in bytes.
        seconds: wall time, verification included.
        verified: every record was read back as written and passed ``validate --deep``'s
            record checks, the output validates, and per-tensor checksums match.
    """

    source: str
    destination: str
    world_size: int
    tensors: int
    tied: list[str]
    bytes_read: int
    bytes: int
    dtypes: dict[str, str]
    assets: list[str]
    files: dict[str, int]
    seconds: float
    verified: bool


def import_hf(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, world_size: int,
              dtype: str = "float32", force: bool = False, verify: bool = True,
              progress: Progress | None = None) -> ImportResult:
    """Write the safetensors model ``src`` as a DCP checkpoint for ``world_size`` FSDP2 ranks.

    Args:
        src: a Hugging Face model folder (``model.safetensors`` or shards and
            ``model.safetensors.index.json``), one ``.safetensors`` file, or a Hub repo id
            ``org/name[@revision]`` (downloaded: safetensors, index, config and tokenizer files).
        dst: a local folder to create.
        world_size: ranks of the output layout.
        dtype: ``"float32"`` casts floating tensors to float32 (FSDP2 master weights);
            ``"keep"`` keeps the saved dtypes.
        force: replace an existing ``dst``.
        verify: check every record as written (as ``validate --deep`` does), validate the
            output and compare per-tensor checksums before committing.
        progress: called as ``progress(bytes_done, bytes_total)`` from the calling thread.

    Returns:
        An ``ImportResult``.

    Raises:
        CheckpointNotFoundError: no such folder, file or safetensors weights.
        IncompatibleCheckpointError: pickle weights (``.bin``); a dtype DCP records cannot hold.
        CorruptCheckpointError: a hostile or damaged header or index; failed verification.
        HubError: the download failed.
        ConfigError: bad ``world_size``/``dtype``, or ``dst`` exists (without ``force``).

    Example:
        >>> r = import_hf("models/llama-1b", "ckpt/llama-1b-ws8", world_size=8)
        >>> r.files["__0_0.distcp"]
    """
    t0 = time.perf_counter()
    _check_options(world_size, dtype)
    out = _destination(dst, force)
    source, label = _open(src, out)
    plan = _plan(source, dtype)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        files = _write_output(tmp, source, plan, _plan_ranks(plan, world_size), out=out,
                              verify=verify, progress=progress)
        _write_manifest(tmp, source, label, world_size, dtype, files)
    return ImportResult(
        source=label, destination=str(out), world_size=world_size, tensors=len(plan),
        tied=[o.fqn for o in plan if o.fqn != f"model.{o.src.name}"],
        bytes_read=sum(t.nbytes for t in source.tensors.values()),
        bytes=sum(o.src.nbytes // o.src.dtype.itemsize * o.dtype.itemsize for o in plan),
        dtypes={o.src.dtype.name: o.dtype.name for o in plan if o.src.dtype != o.dtype},
        assets=sorted(n.split("/", 1)[1] for n in files if n.startswith(f"{ASSETS_DIR}/")),
        files=file_sizes(files), seconds=time.perf_counter() - t0, verified=verify)


def _check_options(world_size: int, dtype: str) -> None:
    check_world_size(world_size)
    if dtype not in DTYPE_CHOICES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")


def _write_output(tmp: Path, source: HFSource, plan: list[OutTensor],
                  ranks: list[list[tuple[OutTensor, Chunk]]], *, out: Path, verify: bool,
                  progress: Progress | None) -> dict[str, tuple[int, str]]:
    """The ``.distcp`` files, assets and ``.metadata`` in ``tmp`` (verified if asked): name ->
    (size, xxh3-64)."""
    ticker = Ticker(progress, sum(o.src.nbytes for o in plan))
    files = copy_assets(source, tmp)  # first: fsynced while the disk has nothing else to write
    # the whole source, if it fits in memory; else each worker asks for its next rows
    whole = read_ahead(sorted({o.src.path for o in plan}))
    with Copier(ticker, {o.src.path for o in plan}, compare=verify) as copier:

        def finish(written: list[WrittenFile[tuple[OutTensor, Chunk]]]) -> None:  # while fsyncing
            files.update({w.name: (w.size, w.digest) for w in written})
            write_metadata(tmp, _metadata(plan, written), checkpoint_id=str(out), sync=False)
            if verify:
                _verify(tmp, plan, copier.crcs, written)
            fsync_file(tmp / METADATA)
            files[METADATA] = mf.file_checksum(Storage.open(tmp), METADATA)

        write_rank_files(tmp, ranks, copier.write_item, ticker=ticker, workers=local_workers(),
                         check=_expected if verify else None, meanwhile=finish,
                         prefetch=None if whole else copier.prefetch)
    return files


# ---------------------------------------------------------------------------------------------
# Source and destination


def is_repo_id(src: str | os.PathLike[str]) -> bool:
    """``org/name[@revision]`` that is not a local path."""
    text = os.fspath(src)
    return bool(_REPO_ID.fullmatch(text)) and not os.path.exists(text)


def _open(src: str | os.PathLike[str], out: Path) -> tuple[HFSource, str]:
    """The source and its label (``repo@commit`` for a Hub download); ``out`` not inside it."""
    if is_repo_id(src):
        from ckptool.ops.hub_download import download

        repo_id, _, revision = os.fspath(src).partition("@")
        root, files, sha = download(repo_id, revision or None)
        source, label = open_source(root, files=files), f"{repo_id}@{sha}"
    else:
        source = open_source(src)
        label = source.root
    _check_inside(source, out)
    return source, label


def _destination(dst: str | os.PathLike[str], force: bool) -> Path:
    return new_output_folder(dst, force=force, verb="import")


def _check_inside(source: HFSource, out: Path) -> None:
    root = Path(source.root).resolve()
    if out == root or out in root.parents:
        raise ConfigError(f"DST {out} is, or contains, the source {root}; choose another DST")


# ---------------------------------------------------------------------------------------------
# Planning (headers only)


def _plan(source: HFSource, dtype: str) -> list[OutTensor]:
    """Output tensors in source read order; a tied ``lm_head.weight`` last."""
    target = DTYPES["float32"]
    plan = []
    for t in source.tensors.values():
        out = target if dtype == "float32" and t.dtype.name in CASTABLE else t.dtype
        if out.name not in V2_DTYPES:
            raise IncompatibleCheckpointError(
                f"{source.root}: {t.name} is {t.dtype}, which ckptool cannot write as a DCP "
                "record yet", path=source.root, hint="Convert it to a float dtype first")
        plan.append(OutTensor(f"model.{t.name}", t, out))
    tied = _tied_head(source)
    if tied is not None:
        emb = next(o for o in plan if o.src.name == tied[1])
        plan.append(OutTensor(f"model.{tied[0]}", emb.src, emb.dtype))
    return plan


def _tied_head(source: HFSource) -> tuple[str, str] | None:
    """(head name, embedding name) when the files leave out a head that ``state_dict()`` lists.

    transformers keeps a tied ``lm_head.weight`` in ``state_dict()`` (both names share one
    parameter) but ``save_pretrained`` stores it once, under the embedding's name.
    """
    if not ties_embeddings(source.config) or HEAD_NAME in source.tensors:
        return None
    found = input_embeddings(source.tensors)
    # A known architecture's embedding, or the only candidate; else leave the head out (a
    # strict load then names it as missing rather than loading a guess).
    if found and (found[0] in KNOWN_EMBEDDINGS or len(found) == 1):
        return HEAD_NAME, found[0]
    return None


def _plan_ranks(plan: list[OutTensor], world_size: int) -> list[list[tuple[OutTensor, Chunk]]]:
    ranks: list[list[tuple[OutTensor, Chunk]]] = [[] for _ in range(world_size)]
    for o in plan:
        for rank, chunk in fsdp_chunks(o.src.shape, world_size):
            ranks[rank].append((o, chunk))
    return ranks


def _expected(item: tuple[OutTensor, Chunk]) -> Expected:
    """What a chunk's record must hold when read back."""
    return item[0].dtype, item[1].sizes


def _metadata(plan: list[OutTensor], written: list[WrittenFile[tuple[OutTensor, Chunk]]]
              ) -> CheckpointMetadata:
    chunks: dict[str, list[Chunk]] = defaultdict(list)
    for w in written:
        for (o, chunk), ref in w.items:
            chunks[o.fqn].append(Chunk(chunk.offsets, chunk.sizes, ref))
    tensors = {o.fqn: TensorEntry(o.fqn, o.dtype, o.src.shape, tuple(chunks[o.fqn])) for o in plan}
    return CheckpointMetadata(tensors=tensors, objects={},
                              planner_data={o.fqn: ("model", o.fqn[len("model."):]) for o in plan},
                              save_id=str(uuid.uuid4()))


# ---------------------------------------------------------------------------------------------
# Verification and manifest


def _verify(folder: Path, plan: list[OutTensor], crcs: dict[tuple[str, int], int],
            written: list[WrittenFile[tuple[OutTensor, Chunk]]]) -> None:
    """Validate the output (its records were deep-checked as they were written: parsed, dtype
    and shape, CRC-32 of every entry); then every tensor's row-major CRC-32, from the records
    the written index points to, must equal the CRC-32 of the (cast) source rows computed
    while copying."""
    from ckptool.ops.validate import validate

    report = validate(str(folder))
    if not report.ok:
        raise unverified(str(folder), report.errors[0].message)
    meta = report.metadata[""]
    if set(meta.tensors) != {o.fqn for o in plan}:
        raise unverified(str(folder), "the written index does not list the planned tensors")
    files = {w.name: w for w in written}
    for o in plan:
        t = meta.tensors[o.fqn]
        if t.shape != o.src.shape or t.dtype != o.dtype:
            raise unverified(str(folder), f"{o.fqn} is {t.dtype} {list(t.shape)}, planned "
                                          f"{o.dtype} {list(o.src.shape)}")
        want, size = 0, 0
        for c in sorted(t.chunks, key=lambda c: c.offsets):
            n, row = c.numel * t.dtype.itemsize, c.offsets[0] if c.offsets else 0
            want, size = crc32_combine(want, crcs[(o.fqn, row)], n), size + n
        if read_back_crc(t, files) != (want, size):
            raise unverified(str(folder), f"{o.fqn} differs from the source rows")


def _write_manifest(tmp: Path, source: HFSource, label: str, world_size: int, dtype: str,
                    files: dict[str, tuple[int, str]]) -> None:
    assets = {n.split("/", 1)[1]: n for n in files if n.startswith(f"{ASSETS_DIR}/")}
    manifest = mf.Manifest(
        step=None, world_size=world_size,
        files={name: {"size": size, mf.CHECKSUM: digest} for name, (size, digest) in files.items()},
        config={"hf_config": source.config, "hf_assets": assets},
        source={"path": label, "operation": "import", "format": "safetensors", "dtype": dtype},
        created=time.time(), ckptool_version=__version__)
    mf.write_manifest(Storage.open(tmp), manifest)


__all__ = ["ImportResult", "import_hf", "is_repo_id"]
