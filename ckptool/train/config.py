"""``TrainConfig``: every option of ``ckptool train``, validated once, in one place.

Owns option names, defaults, and the checks that need no process group. It leaves the
Accelerate config mapping to ``accelerate.py``, runtime checks that need the world size to
``loop.py``, and flag parsing to ``cli/train.py``. Importing it does not import torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from ckptool.errors import ConfigError
from ckptool.train.sizes import ModelConfig, model_config

SHARDING = ("full", "grad-op", "none", "hybrid")
PRECISION = ("fp32", "bf16")
ACTIVATION_CHECKPOINTING = ("none", "every", "every-2")
DEVICES = ("auto", "cpu", "cuda")
MODEL_FIELDS = ("vocab", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len")
#: TrainConfig field -> its ``ckptool train`` option, where the two names differ.
FLAGS = {"n_layers": "--layers", "n_heads": "--heads", "resume": "--no-resume"}


def flag(field: str) -> str:
    """The command-line option of a ``TrainConfig`` field (``save_every`` -> ``--save-every``)."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def require_transformers(option: str = "--hf-model") -> None:
    """Raise ConfigError (a usage error) saying how to install transformers when it is missing."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(f"{option} needs the transformers package, which is not installed",
                          hint="Install it with: pip install 'ckptool[hf]'")


@dataclass(kw_only=True)
class TrainConfig:
    """Options of one training run. The defaults are the demo (tiny model, 2 CPU ranks).

    Example:
        >>> cfg = TrainConfig(out="/tmp/run", steps=20, save_every=10)
        >>> cfg.model_config().num_params()
        234048
    """

    out: str = "runs/demo"
    """Run folder; checkpoints go to ``OUT/step_N/``."""
    nproc: int | None = None
    """Ranks to start; None: one per GPU, or 2 on CPU. Ignored under torchrun/accelerate."""
    steps: int = 300
    """Optimizer steps to reach (a resumed run continues up to this step)."""
    save_every: int = 100
    """Save a checkpoint every this many steps (and at the last step); 0 saves only at the end."""
    keep: int = 3
    """Committed checkpoints to keep; 0 keeps all."""
    async_save: bool = False
    """Save with ``dcp.async_save`` in a background process; training goes on meanwhile."""
    seed: int = 0
    """Seed for weights and data order."""
    model: str = "tiny"
    """Named size: tiny, small, 125m, 350m, 1b."""
    vocab: int | None = None
    """Override the preset's vocabulary size (at least 256 for byte-level data)."""
    d_model: int | None = None
    """Override the preset's width."""
    n_layers: int | None = None
    """Override the preset's number of blocks."""
    n_heads: int | None = None
    """Override the preset's number of attention heads."""
    d_ff: int | None = None
    """Override the preset's MLP width (default 4 * d_model)."""
    max_seq_len: int | None = None
    """Override the preset's position-embedding length."""
    sharding: str = "full"
    """full (FULL_SHARD), grad-op (SHARD_GRAD_OP), none (NO_SHARD) or hybrid (HSDP)."""
    hybrid_shard_size: int | None = None
    """Ranks per shard group for hybrid; None: ranks per node if several nodes, else ws // 2."""
    mixed_precision: str | None = None
    """bf16 or fp32; None: bf16 on GPU, fp32 on CPU (bf16 is ~5x slower on CPU)."""
    activation_checkpointing: str = "none"
    """none, every (every block) or every-2 (every second block)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory."""
    lr: float = 3e-3
    """Peak learning rate (AdamW, linear warmup then cosine decay to lr / 10)."""
    warmup_steps: int | None = None
    """Warmup steps; None: 10% of the decay horizon, at most 100."""
    lr_decay_steps: int | None = None
    """Step at which the cosine decay ends; None: ``steps``. Fix it to continue a run to more
    steps on the same schedule (a resumed run then matches an uninterrupted one)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    batch_size: int = 16
    """Sequences in the GLOBAL micro-batch; split evenly over the ranks."""
    seq_len: int | None = None
    """Tokens per sequence; None: the model's max_seq_len."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    resume: bool = True
    """Continue from the latest valid checkpoint in ``out``; False refuses a non-empty ``out``."""
    resume_from: str | None = None
    """Resume from this checkpoint folder instead of the latest one."""
    init_from: str | None = None
    """A fresh run starts from these model weights: a DCP checkpoint (``model.*`` keys) or a
    Hugging Face safetensors model (``Checkpointer.load_pretrained``); unused when resuming."""
    log_every: int = 10
    """Report progress every this many steps."""
    data: str | None = None
    """A text file to train on (byte-level tokens); None: the built-in synthetic corpus."""
    scaling_check: bool = False
    """Afterwards, time a few steps on 1 rank and report samples/s at N ranks vs 1."""
    final_model_only: bool = False
    """At the end, also save ``OUT/final_model/`` with model weights only."""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda."""
    hf_model: str | None = None
    """Train a transformers causal LM instead of the built-in model: a Hugging Face model
    folder, a Hub repo id ``org/name[@revision]``, or a ``config.json`` alone (random init)."""
    trust_remote_code: bool = False
    """Let ``--hf-model`` run the model folder's own code (``auto_map`` in its config.json)."""

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_numbers()
        if self.resume_from is not None and not self.resume:
            raise ConfigError("--resume-from and --no-resume contradict each other; drop one")
        if self.data is not None and not os.path.isfile(self.data):
            raise ConfigError(f"--data {self.data} is not a file", path=self.data,
                              hint="Pass a text file (read as bytes) or omit --data for the demo corpus")
        if self.hf_model is not None:
            self._check_hf_model()
        mc = self.model_config()  # validates model sizes
        if mc.vocab < 256:
            raise ConfigError(f"--vocab {mc.vocab} is too small for byte-level tokens; use at least 256")
        if self.hf_model is None and self.effective_seq_len() > mc.max_seq_len:
            raise ConfigError(f"--seq-len {self.seq_len} exceeds the model's max_seq_len {mc.max_seq_len}",
                              hint="Lower --seq-len or raise --max-seq-len")
        if self.nproc is not None:
            self.check_world_size(self.nproc)

    def _check_choices(self) -> None:
        for name, allowed in (("sharding", SHARDING), ("activation_checkpointing", ACTIVATION_CHECKPOINTING),
                              ("device", DEVICES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{flag(name)} {getattr(self, name)} is not one of {', '.join(allowed)}")
        if self.mixed_precision is not None and self.mixed_precision not in PRECISION:
            raise ConfigError(f"--mixed-precision {self.mixed_precision} is not one of {', '.join(PRECISION)}",
                              hint="fp16 needs loss scaling, which ckptool train does not do; use bf16")

    def _check_hf_model(self) -> None:
        require_transformers()
        sizes = [flag(k) for k in MODEL_FIELDS if getattr(self, k) is not None]
        if sizes:
            raise ConfigError(f"{' '.join(sizes)} size the built-in model; --hf-model takes its sizes "
                              "from its config.json", hint="Drop them")

    def _check_numbers(self) -> None:
        positive = ("steps", "batch_size", "grad_accum", "log_every")
        non_negative = ("save_every", "keep", "seed")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be at least 1, got {getattr(self, name)}")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag(name)} must not be negative, got {getattr(self, name)}")
        for name in ("nproc", "seq_len", "hybrid_shard_size", "lr_decay_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        for name in ("grad_clip", "weight_decay", "warmup_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{flag(name)} must not be negative, got {getattr(self, name)}")

    def check_world_size(self, world_size: int) -> None:
        """Raise ConfigError unless the batch and the hybrid mesh split over ``world_size`` ranks."""
        if self.batch_size % world_size:
            raise ConfigError(
                f"--batch-size {self.batch_size} (the global batch) does not split over {world_size} ranks",
                hint=f"Use a multiple of {world_size}",
            )
        if self.sharding == "hybrid" and self.hybrid_shard_size is not None:
            if world_size % self.hybrid_shard_size:
                raise ConfigError(
                    f"--hybrid-shard-size {self.hybrid_shard_size} does not divide {world_size} ranks")

    # -- derived values -------------------------------------------------------------------
    def model_config(self) -> ModelConfig:
        """The ``ModelConfig`` of the preset with the overrides applied."""
        return model_config(self.model, **{k: getattr(self, k) for k in MODEL_FIELDS})

    def effective_seq_len(self) -> int:
        return self.seq_len if self.seq_len is not None else self.model_config().max_seq_len

    def effective_decay(self) -> int:
        return self.lr_decay_steps if self.lr_decay_steps is not None else self.steps

    def effective_warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else min(100, self.effective_decay() // 10)

    # -- (de)serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """All fields as plain JSON values (for the manifest)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], **overrides: Any) -> TrainConfig:
        """Build from a mapping whose keys may use dashes (``save-every``) and the command line's
        names (``layers``, ``heads``, ``no-resume``); overrides win.

        Raises:
            ConfigError: unknown keys or invalid values.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        clean = {str(k).replace("-", "_"): v for k, v in data.items()}
        # The command line's names are accepted too (layers, heads, no_resume).
        for option, field in (("layers", "n_layers"), ("heads", "n_heads")):
            if option in clean:
                clean[field] = clean.pop(option)
        if "no_resume" in clean:
            clean["resume"] = not clean.pop("no_resume")
        unknown = sorted(set(clean) - names)
        if unknown:
            raise ConfigError(f"unknown train options {unknown}",
                              hint="Use the long option names of 'ckptool train --help'")
        clean.update(overrides)
        return cls(**clean)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Options from a YAML or JSON file (a mapping of option names to values).

    Raises:
        ConfigError: unreadable file or not a mapping.
    """
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}", path=p) from None
    try:
        if p.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except ValueError as e:  # yaml.YAMLError and json.JSONDecodeError are ValueErrors or close
        raise ConfigError(f"{p} is not valid YAML/JSON: {e}", path=p) from None
    except Exception as e:  # yaml.YAMLError does not derive from ValueError
        raise ConfigError(f"{p} is not valid YAML: {' '.join(str(e).split())}", path=p) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping of option names to values", path=p)
    return data
