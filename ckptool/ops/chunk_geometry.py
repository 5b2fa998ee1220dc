"""Chunk geometry of one tensor in ``.metadata``: inside the shape, no overlap, no gap.

Structural (reads nothing but ``.metadata``); used by ``validate``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from ckptool.format.metadata import TensorEntry

MAX_GRID_CELLS = 1 << 20


def check_geometry(t: TensorEntry, add: Callable[..., None]) -> None:
    """Report chunks of ``t`` that lie outside it, overlap, leave a gap, or lack storage.

    ``add(code, message, fqn=...)`` records one error finding.
    """
    shape = t.shape
    inside = []
    for c in t.chunks:
        if c.storage is None:
            add("missing-storage", f"{t.fqn}: chunk at {list(c.offsets)} has no storage "
                "entry in .metadata", fqn=t.fqn)
        if any(o + s > d for o, s, d in zip(c.offsets, c.sizes, shape)):
            add("chunk-out-of-bounds", f"{t.fqn}: chunk {box(c.offsets, c.sizes)} lies "
                f"outside the tensor's shape {list(shape)}", fqn=t.fqn)
        elif c.storage is not None and c.storage.length < c.numel * t.dtype.itemsize:
            add("record-too-small", f"{t.fqn}: chunk {box(c.offsets, c.sizes)} needs "
                f"{c.numel * t.dtype.itemsize} bytes but its record is {c.storage.length}",
                fqn=t.fqn)
        else:
            inside.append(c)
    overlap = first_overlap(inside)
    if overlap is not None:
        a, b = overlap
        lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
        hi = tuple(min(x + s, y + z) for x, s, y, z in zip(a.offsets, a.sizes, b.offsets, b.sizes))
        add("chunk-overlap", f"{t.fqn}: region {box(lo, tuple(h - l for l, h in zip(lo, hi)))}"
            f" is saved twice (chunks at {list(a.offsets)} and {list(b.offsets)})", fqn=t.fqn)
        return
    covered = sum(c.numel for c in inside)
    if covered < t.numel and len(inside) == len(t.chunks):
        add("chunk-gap", f"{t.fqn}: {t.numel - covered} of {t.numel} elements are in no "
            f"chunk, first missing region {missing_region(shape, inside)}", fqn=t.fqn)


def box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    """``[o0:e0, o1:e1]``: a box of elements, as a message shows it."""
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"


def first_overlap(chunks: list) -> tuple | None:
    """A pair of chunks that share at least one element, else None (sweep along dim 0)."""
    live = [c for c in chunks if c.numel > 0]
    if not live or not live[0].offsets:
        return (live[0], live[1]) if len(live) > 1 else None
    live.sort(key=lambda c: c.offsets)
    for i, a in enumerate(live):
        a_end = a.offsets[0] + a.sizes[0]
        for b in live[i + 1:]:
            if b.offsets[0] >= a_end:
                break
            if all(bo < ao + asz and ao < bo + bsz
                   for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                return a, b
    return None


def missing_region(shape: tuple[int, ...], chunks: list) -> str:
    """Name one box of the tensor that no chunk covers (coordinate-compressed grid)."""
    if not shape:
        return "[] (the scalar itself)"
    cuts = []
    for d, n in enumerate(shape):
        points = {0, n}
        for c in chunks:
            points |= {c.offsets[d], c.offsets[d] + c.sizes[d]}
        cuts.append(sorted(p for p in points if 0 <= p <= n))
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > MAX_GRID_CELLS:
        return "(too fragmented to name)"
    for idx in itertools.product(*(range(len(c) - 1) for c in cuts)):
        lo = tuple(cuts[d][i] for d, i in enumerate(idx))
        if not any(all(o <= x < o + s for x, o, s in zip(lo, c.offsets, c.sizes)) for c in chunks):
            hi = tuple(cuts[d][i + 1] for d, i in enumerate(idx))
            return box(lo, tuple(h - l for l, h in zip(lo, hi)))
    return "(none found)"
