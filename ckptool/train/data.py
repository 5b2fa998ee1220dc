"""Training batches: a learnable built-in corpus or a user's text file, as byte-level tokens.

Owns what each rank reads at each step. The contract that makes resume at another rank count
possible: the GLOBAL batch of step ``s`` (micro-batch ``m``) depends only on (data, seed, s, m),
and rank ``r`` of ``w`` takes rows ``[r*B/w, (r+1)*B/w)`` of it. The position (next step to
read) is saved in the checkpoint through ``state_dict()``/``load_state_dict()``.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import torch

from ckptool.errors import ConfigError, IncompatibleCheckpointError

# A tiny grammar: sentences are learnable (spelling, word order), yet not one repeated string.
_SUBJECTS = ("the cat", "a dog", "the old man", "my sister", "the bird", "a small child",
             "the teacher", "our neighbour")
_VERBS = ("sees", "likes", "chases", "finds", "paints", "remembers", "visits", "follows")
_OBJECTS = ("the red ball", "a green apple", "the quiet river", "a long letter", "the blue door",
            "an old song", "the tall tree", "a warm coat")
_ENDINGS = ("", " in the park", " at night", " every morning", " after lunch", " by the sea")
CORPUS_BYTES = 1 << 18


def demo_corpus(n_bytes: int = CORPUS_BYTES, *, seed: int = 1234) -> bytes:
    """``n_bytes`` of sentences from a small fixed grammar (deterministic for a seed).

    Example:
        >>> demo_corpus(40)
        b'Our neighbour likes the red ball. The ca'
    """
    rng = random.Random(seed)  # Mersenne Twister: the same text on every platform and version
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}. "
        s = s[0].upper() + s[1:]
        parts.append(s)
        size += len(s)
    return "".join(parts).encode("ascii")[:n_bytes]


@dataclass(frozen=True)
class Batch:
    """One rank's micro-batch: ``inputs`` and next-token ``targets``, both (b, seq_len) int64."""

    inputs: torch.Tensor
    targets: torch.Tensor


class TokenBatches:
    """Random windows of a token stream; deterministic per (seed, step, micro-batch).

    Example:
        >>> src = TokenBatches.demo(seq_len=32, global_batch=8, seed=0, rank=0, world_size=2)
        >>> batch = src.get(step=0, micro=0)          # rows 0..3 of the global batch
        >>> batch.inputs.shape
        torch.Size([4, 32])
    """

    def __init__(self, tokens: torch.Tensor, *, name: str, seq_len: int, global_batch: int,
                 seed: int, rank: int, world_size: int) -> None:
        if tokens.numel() < seq_len + 2:
            raise ConfigError(f"{name} has {tokens.numel()} tokens, too few for --seq-len {seq_len}",
                              hint="Use a longer text file or a smaller --seq-len")
        if global_batch % world_size:
            raise ConfigError(f"global batch {global_batch} does not split over {world_size} ranks")
        self.tokens = tokens
        self.name = name
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.position = 0  # the next step to read

    @classmethod
    def demo(cls, **kwargs: Any) -> TokenBatches:
        """The built-in grammar corpus (256 KiB)."""
        tokens = torch.frombuffer(bytearray(demo_corpus()), dtype=torch.uint8).long()
        return cls(tokens, name="demo-corpus", **kwargs)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **kwargs: Any) -> TokenBatches:
        """A file's bytes as tokens (vocab 256); the whole file is read into memory."""
        p = os.fspath(path)
        try:
            with open(p, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read --data {p}: {e.strerror}", path=p) from None
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long() if raw else torch.zeros(0)
        return cls(tokens, name=f"file:{os.path.basename(p)}:{len(raw)}", **kwargs)

    def get(self, step: int, micro: int) -> Batch:
        """This rank's slice of the global micro-batch ``micro`` of step ``step``."""
        # One generator per (seed, step, micro): the global batch never depends on world size.
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1009 + micro)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.global_batch,),
                               generator=g)
        per_rank = self.global_batch // self.world_size
        mine = starts[self.rank * per_rank:(self.rank + 1) * per_rank]
        idx = mine[:, None] + torch.arange(self.seq_len + 1)[None, :]
        window = self.tokens[idx]
        return Batch(inputs=window[:, :-1].contiguous(), targets=window[:, 1:].contiguous())

    # -- checkpointed position (torch.distributed.checkpoint Stateful protocol) ---------------
    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "source": self.name,
                "global_batch": self.global_batch, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("source", "seed", "global_batch", "seq_len"):
            if state.get(key) != mine[key]:
                raise IncompatibleCheckpointError(
                    f"the checkpoint's data {key} is {state.get(key)!r} but this run's is {mine[key]!r}",
                    hint="Resume with the same --data/--seed/--batch-size/--seq-len, or use --no-resume "
                         "with a new --out",
                )
        self.position = int(state["position"])
