"""The model card (``README.md``) and ``config.json`` that ``ckptool upload`` sends with the weights.

Owns the text: YAML metadata through ``huggingface_hub.ModelCardData`` (``library_name:
ckptool``, tags), a table of what is known about the checkpoint (step, loss, world size,
dtype, size), the training config, and a usage snippet. It also builds ``config.json`` for
ckptool's built-in model (``ModelConfig.to_dict()`` plus ``"model_type": "ckptool-gpt"``), which
``ckptool.train.model.GPT`` and ``examples/generate.py`` rebuild the model from. What to send
and how is ``ops/upload.py``'s business. Imports huggingface_hub lazily; never imports torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ckptool._version import __version__

MODEL_TYPE = "ckptool-gpt"
TAGS = ("ckptool", "pytorch", "safetensors", "fsdp2", "dcp")
#: How ``examples/generate.py`` is run against an uploaded repo (keep in step with the script).
GENERATE_CMD = "python examples/generate.py --model {repo_id}"
# Training-config keys that hold local paths: left out of a card that may be public.
_LOCAL_PATH_KEYS = ("out", "resume_from")


@dataclass(frozen=True)
class CardFacts:
    """What the card says about the weights; None means unknown (the row is left out).

    Attributes:
        repo_id: where the card will live.
        weight_files: names of the ``.safetensors`` files, in repo order.
        sharded: an index (``model.safetensors.index.json``) is sent.
        tensors, nbytes: number of tensors and their data bytes.
        dtype: dtypes of the tensors (``"float32"`` or ``"bfloat16, float32"``).
        step, loss, world_size: provenance from the checkpoint's manifest or the file header.
        source: the checkpoint folder's name.
        train_config: the training config recorded in the manifest.
        model_config: ``ModelConfig`` fields when the weights are ckptool's built-in model.
        subfolder: ``path_in_repo`` when the files do not go to the repo root.
        hf_model_type: ``model_type`` of a Hugging Face ``config.json`` sent with the weights
            (the card then says ``library_name: transformers``).
        base_model: the Hub repo the weights were imported from, when known.
    """

    repo_id: str
    weight_files: tuple[str, ...]
    sharded: bool
    tensors: int
    nbytes: int
    dtype: str | None = None
    step: int | None = None
    loss: float | None = None
    world_size: int | None = None
    source: str | None = None
    train_config: dict[str, Any] = field(default_factory=dict)
    model_config: dict[str, Any] | None = None
    subfolder: str = ""
    hf_model_type: str | None = None
    base_model: str | None = None


def model_config_json(model_config: dict[str, Any]) -> bytes:
    """``config.json`` for the built-in model: ``ModelConfig`` fields plus ``model_type``.

    Args:
        model_config: ``ModelConfig.to_dict()`` as recorded in the manifest (``model_type`` may
            be present and is ignored).

    Returns:
        UTF-8 JSON, keys in field order, newline-terminated.

    Raises:
        ConfigError: the fields do not make a valid ``ModelConfig``.

    Example:
        >>> json.loads(model_config_json(PRESETS["tiny"].to_dict()))["model_type"]
        'ckptool-gpt'
    """
    from ckptool.train.sizes import ModelConfig

    fields = {k: v for k, v in model_config.items() if k != "model_type"}
    cfg = ModelConfig.from_dict(fields)
    return (json.dumps({"model_type": MODEL_TYPE, **cfg.to_dict()}, indent=2) + "\n").encode()


def model_card(facts: CardFacts) -> str:
    """The ``README.md`` text: YAML metadata block, facts, training config, usage.

    Args:
        facts: what is known about the weights.

    Returns:
        The card, parsed once by ``huggingface_hub.ModelCard`` so its metadata is well-formed.

    Example:
        >>> text = model_card(CardFacts("alice/demo", ("model.safetensors",), False, 3, 240))
        >>> text.startswith("---\\nlibrary_name: ckptool")
        True
    """
    from huggingface_hub import ModelCard, ModelCardData

    tags = [*TAGS, MODEL_TYPE] if facts.model_config else list(TAGS)
    if facts.hf_model_type:
        tags.append(facts.hf_model_type)
    data = ModelCardData(library_name="transformers" if facts.hf_model_type else "ckptool",
                         tags=tags, base_model=facts.base_model)
    name = facts.repo_id.split("/")[-1]
    body = "\n\n".join(part for part in (
        f"# {name}",
        "Weights exported with ckptool (`pip install ckptool`) from a PyTorch FSDP2 training "
        "run saved with Distributed Checkpoint (DCP).",
        _facts_table(facts),
        _config_section(facts),
        "## Usage",
        _usage(facts),
    ) if part)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n"))


def _facts_table(f: CardFacts) -> str:
    rows = [("step", f.step), ("loss", f"{f.loss:.4f}" if f.loss is not None else None),
            ("world size (ranks)", f.world_size), ("dtype", f.dtype),
            ("tensors", f"{f.tensors} ({f.nbytes:,} bytes)"),
            ("files", ", ".join(f"`{n}`" for n in f.weight_files)),
            ("source checkpoint", f"`{f.source}`" if f.source else None),
            ("exported with", f"ckptool {__version__}")]
    lines = ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows if v is not None]
    return "\n".join(lines)


def _config_section(f: CardFacts) -> str:
    import yaml

    parts = []
    if f.model_config:
        parts.append("## Model\n\nckptool's built-in GPT-style decoder; `config.json` holds its "
                     f"sizes:\n\n```json\n{model_config_json(f.model_config).decode()}```")
    cfg = {k: v for k, v in f.train_config.items()
           if k not in _LOCAL_PATH_KEYS and k != "model_config" and v is not None}
    if isinstance(cfg.get("data"), str):
        cfg["data"] = os.path.basename(cfg["data"])
    if cfg:
        text = yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False).rstrip()
        parts.append(f"## Training config\n\n```yaml\n{text}\n```")
    return "\n\n".join(parts)


def _usage(f: CardFacts) -> str:
    prefix = f"{f.subfolder}/" if f.subfolder else ""
    if f.sharded:
        load = (
            "import json\n\nfrom huggingface_hub import snapshot_download\n"
            "from safetensors.torch import load_file\n\n"
            f'folder = snapshot_download("{f.repo_id}", allow_patterns=["{prefix}*.safetensors", '
            f'"{prefix}*.json"])\n'
            f'index = json.load(open(f"{{folder}}/{prefix}model.safetensors.index.json"))\n'
            "state_dict = {}\n"
            'for shard in sorted(set(index["weight_map"].values())):\n'
            f'    state_dict.update(load_file(f"{{folder}}/{prefix}{{shard}}"))')
    else:
        load = ("from huggingface_hub import hf_hub_download\n"
                "from safetensors.torch import load_file\n\n"
                f'state_dict = load_file(hf_hub_download("{f.repo_id}", '
                f'"{prefix}{f.weight_files[0]}"))')
    if f.hf_model_type:
        sub = f', subfolder="{f.subfolder}"' if f.subfolder else ""
        return ("Load it with transformers:\n\n```python\n"
                "from transformers import AutoModelForCausalLM\n\n"
                f'model = AutoModelForCausalLM.from_pretrained("{f.repo_id}"{sub})\n```')
    text = ("Load the weights (tensor names are the model's own `state_dict()` keys):\n\n"
            f"```python\n{load}\n```")
    if f.model_config:
        text += (
            "\n\nRebuild ckptool's model from `config.json` (`pip install ckptool`):\n\n"
            "```python\nimport json\n\nfrom ckptool.train.model import GPT, ModelConfig\n\n"
            f'config = json.load(open(hf_hub_download("{f.repo_id}", "{prefix}config.json")))\n'
            'config.pop("model_type")\n'
            "model = GPT(ModelConfig.from_dict(config))\n"
            "model.load_state_dict(state_dict)\n```\n\n"
            "or generate text with the script from the ckptool repository:\n\n"
            f"```bash\n{GENERATE_CMD.format(repo_id=f.repo_id)}\n```")
    return text
