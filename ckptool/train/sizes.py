"""Model sizes: ``ModelConfig`` (exact parameter count, JSON round trip) and named presets.

Torch-free on purpose, so ``ckptool estimate`` and config files can use it without the ~2 s
torch import; the modules themselves are in ``model.py``, which re-exports these names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ckptool.errors import ConfigError


#: ``ModelConfig`` field -> the option of ``ckptool train`` / ``estimate`` that sets it.
FLAGS = {"vocab": "--vocab", "d_model": "--d-model", "n_layers": "--layers", "n_heads": "--heads",
         "d_ff": "--d-ff", "max_seq_len": "--max-seq-len"}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of the decoder.

    ``num_params()`` is exact: it equals ``sum(p.numel() for p in GPT(cfg).parameters())``.
    """

    vocab: int = 256
    """Vocabulary size (256 for byte-level text)."""
    d_model: int = 64
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks (``model.blocks``)."""
    n_heads: int = 4
    """Attention heads; must divide ``d_model``."""
    d_ff: int | None = None
    """Hidden width of the MLP; None means ``4 * d_model``."""
    max_seq_len: int = 64
    """Longest sequence the learned position embedding covers."""

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_layers", "n_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{FLAGS[name]} must be at least 1, got {getattr(self, name)}")
        if self.d_ff is not None and self.d_ff < 1:
            raise ConfigError(f"--d-ff must be at least 1, got {self.d_ff}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"--d-model {self.d_model} is not divisible by --heads {self.n_heads}",
                hint="Pick --heads that divides --d-model",
            )

    @property
    def ff(self) -> int:
        """The MLP hidden width actually used."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    def num_params(self) -> int:
        """Exact number of parameters.

        With V = vocab, S = max_seq_len, d = d_model, f = MLP width, L = n_layers::

            V*d  (tok_emb) + S*d  (pos_emb)
            + L * (4*d*d  (qkv + proj) + 2*d*f  (fc + proj) + 2*d  (two norms))
            + d  (final norm) + V*d  (head)

        Returns:
            The count, equal to ``sum(p.numel() for p in GPT(self).parameters())``.

        Example:
            >>> ModelConfig(vocab=256, d_model=64, n_layers=4, n_heads=4).num_params()
            234048
        """
        d, f = self.d_model, self.ff
        per_block = 4 * d * d + 2 * d * f + 2 * d
        return self.vocab * d + self.max_seq_len * d + self.n_layers * per_block + d + self.vocab * d

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (``d_ff`` resolved), for manifests and ``config.json``."""
        out = dataclasses.asdict(self)
        out["d_ff"] = self.ff
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Inverse of ``to_dict``; unknown keys are a ConfigError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown model config keys {unknown}; known: {sorted(names)}")
        return cls(**data)


#: Named sizes. tiny trains in seconds on 2 CPU cores; the rest are for GPUs.
#: Exact counts (``num_params()``): tiny 234,048; small 4,918,528; 125m 127,812,864;
#: 350m 343,454,720; 1b 1,039,214,592.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab=256, d_model=64, n_layers=4, n_heads=4, max_seq_len=64),
    "small": ModelConfig(vocab=256, d_model=256, n_layers=6, n_heads=8, max_seq_len=256),
    "125m": ModelConfig(vocab=32000, d_model=768, n_layers=11, n_heads=12, max_seq_len=1024),
    "350m": ModelConfig(vocab=32000, d_model=1024, n_layers=22, n_heads=16, max_seq_len=1024),
    "1b": ModelConfig(vocab=32000, d_model=2048, n_layers=18, n_heads=16, max_seq_len=1024),
}


def model_config(name: str, **overrides: int | None) -> ModelConfig:
    """A preset with some fields replaced (None values are ignored).

    Raises:
        ConfigError: unknown preset name or invalid sizes.
    """
    if name not in PRESETS:
        raise ConfigError(f"--model {name}: unknown model size; choose one of {', '.join(PRESETS)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(PRESETS[name], **changes)
