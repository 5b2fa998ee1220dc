"""The built-in GPT-style decoder that ``ckptool train`` shards and checkpoints.

Owns the architecture (``GPT``, ``Block``); sizes and the exact parameter count live in the
torch-free ``sizes.py`` and are re-exported here. It knows nothing about sharding
(``parallel.py``) or data (``data.py``).

The ``state_dict()`` keys are kept short and stable because they become the tensor names of
exported files::

    tok_emb.weight                 (vocab, d_model)
    pos_emb.weight                 (max_seq_len, d_model)
    blocks.{i}.norm1.weight        (d_model,)
    blocks.{i}.attn.qkv.weight     (3 * d_model, d_model)
    blocks.{i}.attn.proj.weight    (d_model, d_model)
    blocks.{i}.norm2.weight        (d_model,)
    blocks.{i}.mlp.fc.weight       (d_ff, d_model)
    blocks.{i}.mlp.proj.weight     (d_model, d_ff)
    norm.weight                    (d_model,)
    head.weight                    (vocab, d_model)

No biases, no weight tying (``head`` is its own tensor, which keeps export simple).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ckptool.errors import ConfigError
from ckptool.train.sizes import PRESETS, ModelConfig, model_config

__all__ = ["GPT", "Block", "ModelConfig", "PRESETS", "model_config"]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, t, d) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ff, bias=False)
        self.proj = nn.Linear(cfg.ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-norm transformer block: the repeating unit FSDP shards one at a time."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model, bias=False)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model, bias=False)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token + position embedding, ``n_layers`` blocks, final norm, linear head.

    Example:
        >>> model = GPT(PRESETS["tiny"])
        >>> logits = model(torch.zeros(2, 8, dtype=torch.long))   # (2, 8, 256)
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model, bias=False)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
        for name, p in self.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif name.endswith(".proj.weight"):
                p.normal_(0.0, 0.02 / math.sqrt(2 * self.cfg.n_layers))
            else:
                p.normal_(0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ConfigError(f"sequence length {t} exceeds max_seq_len {self.cfg.max_seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
