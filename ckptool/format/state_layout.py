"""Whose checkpoint is it? Which keys are the model, which the optimizer, which the rest.

Decided once, here, from the checkpoint's own records — never from a name prefix (a Hugging
Face model's own names start with ``model.``, and ``lm_head.weight`` does not). Every command
(inspect, consolidate, upload, ...) uses this one answer.

The evidence, best first:

1. ``--model-key PATH`` (``model_key=``): the model is the sub-tree at PATH, by hand.
2. ``Metadata.planner_data``: DCP's default planner records the nested path of every flattened
   key: ``("model", "lm_head.weight")``, ``("app", "optim", "state", "x", "exp_avg")``,
   ``("lm_head.weight",)``. The model is the shallowest sub-tree named ``model`` (ckptool,
   ``{"model", "optim"}`` saves, the AppState recipe ``{"app": {"model", "optim"}}``,
   Accelerate); without one, it is the top-level tensors (``dcp.save(model.state_dict())``,
   torchtitan, which flattens the model beside ``optimizer``, ``lr_scheduler``,
   ``dataloader``, ``train_state``). Sub-trees named like an optimizer are the optimizer;
   everything else (scheduler, data loader, train state, RNG, extras) is "other".
3. No ``planner_data`` (a custom planner): with a ckptool manifest, ckptool's own layout
   (``model.*``, ``optim.*``); otherwise no tensor is dropped: every tensor outside an
   optimizer-named prefix is exported under its full key, and the note says how to choose
   the other reading (``--model-key model``).

Exported names are the model's own ``state_dict()`` names: the path below the model's
sub-tree, with wrapper segments that break loading into an inference model removed
(``_orig_mod.`` from torch.compile, ``_checkpoint_wrapped_module.``, ``_fsdp_wrapped_module.``,
and DDP's leading ``module.`` when every name has it) unless ``keep_wrappers``. Two keys that
collapse to one name are an error, never an overwrite.

Torch-free; reads only the parsed index.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from ckptool.errors import ConfigError, IncompatibleCheckpointError
from ckptool.format.metadata import CheckpointMetadata


class Group(str, enum.Enum):
    """Which part of the training state a key belongs to."""

    MODEL = "model"
    OPTIMIZER = "optimizer"
    OTHER = "other"


#: Sub-tree names that hold a model's state dict (DCP recipe, ckptool, Accelerate, nanoGPT-like).
MODEL_NAMES = ("model",)
#: Sub-tree names that hold optimizer state (ckptool/DCP recipe, torchtitan, Accelerate, HF Trainer).
OPTIM_NAMES = ("optim", "optimizer", "optimizers", "optimizer_state_dict", "optim_state_dict")
#: Path segments added by wrappers, not by the model: removed from exported names by default.
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
DDP_SEGMENT = "module"


@dataclass(frozen=True)
class StateLayout:
    """The answer for one checkpoint.

    Attributes:
        groups: every key (tensors and objects) -> its group, in the saved order.
        names: every model *tensor* key -> its exported name (the model's own name).
        model_path: the model sub-tree's path (``("model",)``, ``("app", "model")``; ``()`` for
            top-level keys), or None when the reading is not path-based.
        basis: what decided it: ``"--model-key"``, ``"planner_data"``, ``"manifest"`` or
            ``"key names"``.
        note: set when another reading was possible: which was chosen and how to pick the other.
    """

    groups: dict[str, Group]
    names: dict[str, str]
    model_path: tuple[Any, ...] | None
    basis: str
    note: str | None = None

    def keys(self, group: Group) -> list[str]:
        return [k for k, g in self.groups.items() if g is group]


def read_layout(meta: CheckpointMetadata, *, model_key: str | None = None,
                keep_wrappers: bool = False, ckptool_manifest: bool = False,
                where: str = "the checkpoint") -> StateLayout:
    """Group the keys of ``meta`` and name the model's tensors.

    Args:
        meta: the parsed index.
        model_key: the model sub-tree chosen by hand, dotted (``app.model``), or ``""`` for
            "every top-level tensor".
        keep_wrappers: keep ``_orig_mod.`` & co. in exported names.
        ckptool_manifest: the folder has a ckptool manifest (used only without planner_data).
        where: the checkpoint's name, for messages.

    Raises:
        ConfigError: ``model_key`` matches no tensor.
        IncompatibleCheckpointError: two keys would be exported under one name.
    """
    keys = [*meta.tensors, *meta.objects]
    paths = _paths(meta, keys)
    if model_key is not None:
        layout = _by_model_key(meta, keys, paths, model_key, where)
    elif paths is not None:
        layout = _by_paths(meta, keys, paths)
    elif ckptool_manifest:
        layout = _by_prefix(meta, keys, "model", basis="manifest")
    else:
        layout = _by_names(meta, keys)
    return _named(layout, keep_wrappers, where)


# ---------------------------------------------------------------------------------------------
# Readings


def _paths(meta: CheckpointMetadata, keys: list[str]) -> dict[str, tuple[Any, ...]] | None:
    """planner_data as {key: path}, or None when it does not describe every key exactly."""
    pd = meta.planner_data
    out = {}
    for k in keys:
        p = pd.get(k)
        if not isinstance(p, tuple) or not p or ".".join(map(str, p)) != k:
            return None
        out[k] = p
    return out


def _optim_path(path: tuple[Any, ...]) -> bool:
    return any(isinstance(s, str) and s in OPTIM_NAMES for s in path[:-1])


def _by_paths(meta: CheckpointMetadata, keys: list[str],
              paths: dict[str, tuple[Any, ...]]) -> StateLayout:
    candidates = _model_subtrees(meta, paths)
    note = None
    if candidates:
        model_path = candidates[0]
        if len(candidates) > 1:
            others = ", ".join(".".join(map(str, c)) for c in candidates[1:])
            note = (f"the model is the sub-tree '{'.'.join(map(str, model_path))}' (others: "
                    f"{others}); choose another with --model-key")
    else:
        model_path = ()
    groups: dict[str, Group] = {}
    names: dict[str, str] = {}
    n = len(model_path)
    for k in keys:
        p = paths[k]
        if n and p[:n] == model_path and len(p) > n:
            groups[k] = Group.MODEL
        elif not n and len(p) == 1 and k in meta.tensors:
            groups[k] = Group.MODEL  # top-level tensors: a plain model state dict, or torchtitan
        elif _optim_path(p):
            groups[k] = Group.OPTIMIZER
        else:
            groups[k] = Group.OTHER
        if groups[k] is Group.MODEL and k in meta.tensors:
            names[k] = ".".join(map(str, p[n:]))
    if not names:
        # No sub-tree named like a model and no top-level tensor: keep every tensor that is
        # not optimizer state, under its full key, rather than export nothing.
        for k in meta.tensors:
            if groups[k] is Group.OTHER:
                groups[k], names[k] = Group.MODEL, k
        if names:
            tops = sorted({str(paths[k][0]) for k in names})
            note = (f"no sub-tree named 'model' and no top-level tensor: exported every "
                    f"non-optimizer tensor under its full key; choose one sub-tree with "
                    f"--model-key (one of {', '.join(tops[:6])})")
            model_path = None
    return StateLayout(groups, names, model_path, "planner_data", note)


def _model_subtrees(meta: CheckpointMetadata, paths: dict[str, tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Paths of sub-trees named like a model that hold at least one tensor, shallowest first."""
    found: dict[tuple[Any, ...], int] = {}
    for k in meta.tensors:
        p = paths[k]
        for i, seg in enumerate(p[:-1]):
            if seg in MODEL_NAMES and not _optim_path(p[:i + 1] + ("",)):
                found.setdefault(p[:i + 1], len(found))
                break
    return sorted(found, key=lambda q: (len(q), found[q]))


def _by_model_key(meta: CheckpointMetadata, keys: list[str], paths: dict[str, tuple[Any, ...]] | None,
                  model_key: str, where: str) -> StateLayout:
    """The sub-tree at ``model_key`` (dotted), matched on whole path segments when the paths
    are known, else on the key text."""
    prefix = model_key.strip(".")
    groups: dict[str, Group] = {}
    names: dict[str, str] = {}
    for k in keys:
        p = paths[k] if paths is not None else tuple(k.split("."))
        rest = _below(p, prefix)
        if rest is not None:
            groups[k] = Group.MODEL
            if k in meta.tensors:
                names[k] = rest
        else:
            groups[k] = Group.OPTIMIZER if _optim_path(p) else Group.OTHER
    if not names:
        tops = sorted({(paths[k][0] if paths else k.split(".")[0]) for k in meta.tensors})
        raise ConfigError(
            f"--model-key {model_key!r} matches no tensor of {where}; its top-level keys are "
            f"{', '.join(map(str, tops[:8]))}{' ...' if len(tops) > 8 else ''}",
            hint="Pass the dotted path of the model's state dict, e.g. --model-key app.model, "
                 "or '' for the top-level tensors")
    return StateLayout(groups, names, tuple(prefix.split(".")) if prefix else (), "--model-key")


def _below(path: tuple[Any, ...], prefix: str) -> str | None:
    """The path below ``prefix`` (dotted) when ``path`` starts with it on segment boundaries."""
    if not prefix:
        return ".".join(map(str, path)) if len(path) == 1 else None
    acc = ""
    for i, seg in enumerate(path[:-1]):
        acc = f"{acc}.{seg}" if acc else str(seg)
        if acc == prefix:
            return ".".join(map(str, path[i + 1:]))
        if not prefix.startswith(acc + "."):
            return None
    return None


def _by_prefix(meta: CheckpointMetadata, keys: list[str], prefix: str, *, basis: str) -> StateLayout:
    """ckptool's own layout without planner_data: ``model.*`` is the model."""
    groups: dict[str, Group] = {}
    names: dict[str, str] = {}
    for k in keys:
        head, _, rest = k.partition(".")
        if head == prefix and rest:
            groups[k] = Group.MODEL
            if k in meta.tensors:
                names[k] = rest
        else:
            groups[k] = Group.OPTIMIZER if head in OPTIM_NAMES else Group.OTHER
    return StateLayout(groups, names, (prefix,), basis)


def _by_names(meta: CheckpointMetadata, keys: list[str]) -> StateLayout:
    """No record of the nesting: keep every tensor that is not under an optimizer-named prefix,
    under its full key (never drop one); name the other reading."""
    groups: dict[str, Group] = {}
    names: dict[str, str] = {}
    for k in keys:
        head = k.split(".", 1)[0]
        if head in OPTIM_NAMES:
            groups[k] = Group.OPTIMIZER
        elif k in meta.tensors:
            groups[k], names[k] = Group.MODEL, k
        else:
            groups[k] = Group.OTHER
    heads = {k.split(".", 1)[0] for k in names if "." in k}
    note = None
    if len(heads) == 1 or "model" in heads:
        head = "model" if "model" in heads else next(iter(heads))
        note = (f"the index does not record how keys were nested (no planner_data): exported "
                f"every tensor under its full key; if '{head}.' is a wrapper level and not part "
                f"of the model's own names, pass --model-key {head}")
    return StateLayout(groups, names, None, "key names", note)


# ---------------------------------------------------------------------------------------------
# Names


def _named(layout: StateLayout, keep_wrappers: bool, where: str) -> StateLayout:
    names = layout.names if keep_wrappers else strip_wrappers(layout.names)
    seen: dict[str, str] = {}
    for k, name in names.items():
        if name in seen:
            raise IncompatibleCheckpointError(
                f"{where}: keys {seen[name]!r} and {k!r} would both be exported as {name!r}",
                hint="Pass --keep-wrappers to keep wrapper segments, or --model-key to choose "
                     "one sub-tree")
        seen[name] = k
    return dataclasses.replace(layout, names=names)


def strip_wrappers(names: dict[str, str]) -> dict[str, str]:
    """Exported names without wrapper segments (DDP's ``module.`` only when every name has it)."""
    out = {k: ".".join(s for s in name.split(".") if s not in WRAPPER_SEGMENTS)
           for k, name in names.items()}
    if out and all(n.startswith(DDP_SEGMENT + ".") for n in out.values()):
        out = {k: n[len(DDP_SEGMENT) + 1:] for k, n in out.items()}
    return out


def describe(layout: StateLayout) -> str:
    """One line: how the model was found (for inspect and --json)."""
    if layout.model_path is None:
        where = "every tensor under its full key"
    elif layout.model_path:
        where = f"sub-tree '{'.'.join(map(str, layout.model_path))}'"
    else:
        where = "the top-level tensors"
    return f"model = {where} (from {layout.basis})"
