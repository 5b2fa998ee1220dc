"""Sample text from consolidated weights with the built-in model: train -> consolidate -> generate.

    ckptool train --out runs/demo --steps 300
    ckptool consolidate runs/demo/step_300 model.safetensors
    python examples/generate.py model.safetensors --prompt "The cat " --tokens 120

``ckptool consolidate`` records the model config of a ``ckptool train`` checkpoint in the
file's header (``ckptool_model_config``), so the model is rebuilt from the file alone; for
other files give the size with ``--model`` and the flags ``ckptool train`` uses (``--layers``,
``--heads``, ``--d-model``, ``--vocab``, ``--d-ff``, ``--max-seq-len``). Works with one
``.safetensors`` file or a folder of shards with ``model.safetensors.index.json``. Tokens are
bytes (vocabulary 256), as in ``ckptool train``'s data.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckptool.train.model import GPT, ModelConfig, model_config
from ckptool.train.sizes import FLAGS as _SIZE_FLAGS

FLAGS = {flag: field for field, flag in _SIZE_FLAGS.items()}  # --layers -> n_layers, ...


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.exists():
            return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        return [path / "model.safetensors"]
    return [path]


def read_config(path: str | os.PathLike[str]) -> ModelConfig | None:
    """The model config recorded by ``ckptool consolidate``, or None."""
    with safe_open(str(_files(Path(path))[0]), "pt") as f:
        text = (f.metadata() or {}).get("ckptool_model_config")
    return ModelConfig.from_dict(json.loads(text)) if text else None


def load_model(path: str | os.PathLike[str], cfg: ModelConfig | None = None) -> GPT:
    """A ``GPT`` with the weights of a consolidated file or folder (strict: every key must match).

    Example:
        >>> model = load_model("model.safetensors")
        >>> logits = model(torch.tensor([[72, 105]]))
    """
    cfg = cfg or read_config(path)
    if cfg is None:
        raise SystemExit(f"{path} records no model config; pass --model and the size flags")
    state: dict[str, torch.Tensor] = {}
    for f in _files(Path(path)):
        state.update(load_file(f))
    model = GPT(cfg)
    model.load_state_dict(state, strict=True)  # casts bf16/fp16 files to the fp32 parameters
    return model.eval()


@torch.no_grad()
def generate(model: GPT, prompt: bytes, n_tokens: int, *, temperature: float = 0.8,
             top_k: int | None = 40, seed: int = 0) -> bytes:
    """Sample ``n_tokens`` bytes after ``prompt`` (nanoGPT's loop: crop, scale, top-k, sample)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt or b"\n")], dtype=torch.long)
    for _ in range(n_tokens):
        logits = model(idx[:, -model.cfg.max_seq_len:])[:, -1, :] / max(temperature, 1e-5)
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
            logits[logits < kth] = -float("inf")
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)
        idx = torch.cat([idx, nxt], dim=1)
    return bytes(idx[0, len(prompt or b"\n"):].tolist())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("weights", help="a .safetensors file or a folder of shards")
    ap.add_argument("--prompt", default="The ")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="preset when the file records no config")
    # The size flags of 'ckptool train' (--layers, --heads, ...), for files without a config.
    for flag, field in FLAGS.items():
        ap.add_argument(flag, dest=field, type=int, default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads (default 1: sampling one token at a time from a small model is "
                         "latency-bound; more threads spend more on synchronisation than they save)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = None
    if args.model is not None:
        cfg = model_config(args.model, **{field: getattr(args, field) for field in FLAGS.values()})
    model = load_model(args.weights, cfg)
    prompt = args.prompt.encode("utf-8")
    out = generate(model, prompt, args.tokens, temperature=args.temperature, top_k=args.top_k,
                   seed=args.seed)
    print((prompt + out).decode("utf-8", errors="replace"))


if __name__ == "__main__":
    main()
