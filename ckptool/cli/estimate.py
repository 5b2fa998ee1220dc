"""``ckptool estimate``: per-GPU memory of a run before launch (the accounting is ``ops/estimate.py``).

Never imports torch: sizes come from the torch-free ``train/sizes.py`` (except ``--hf-model``,
whose parameter count transformers gives by building the model on the meta device).
"""

from __future__ import annotations

import re

import click

from ckptool.cli._common import echo_json, parse_size
from ckptool.ops.estimate import (ACTIVATION_CHECKPOINTING, ALIASES, OPTIMIZERS, PRECISIONS, STRATEGIES, Estimate,
                                  Terms, fmt_bytes)
from ckptool.errors import ConfigError
from ckptool.train.sizes import PRESETS

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """'7e9', '7B', '1.3b', '125M', '7_000_000_000' -> a positive integer parameter count."""
    m = re.fullmatch(r"([0-9][0-9_,]*(?:\.[0-9]*)?(?:[eE][+]?[0-9]+)?)\s*([kKmMbBgGtT]?)", text.strip())
    value = float(m.group(1).replace("_", "").replace(",", "")) * _SUFFIX[m.group(2).upper()] if m else 0
    if value < 1:
        raise click.BadParameter(f"{text!r} is not a positive parameter count; use e.g. 7e9, 7B or 125M")
    return round(value)


@click.command("estimate")
@click.option("--params", metavar="N", callback=lambda _c, _p, v: None if v is None else parse_count(v),
              help="Parameter count (7e9, 7B, 125M): state terms only.")
@click.option("--model", type=click.Choice(list(PRESETS)), help="Built-in model size: exact shapes, activations.")
@click.option("--d-model", type=int, help="Width (with --layers and --vocab, or overriding --model).")
@click.option("--layers", type=int, help="Number of transformer blocks.")
@click.option("--heads", type=int, help="Attention heads (default: d_model / 64).")
@click.option("--vocab", type=int, help="Vocabulary size.")
@click.option("--d-ff", type=int, help="MLP width (default 4 x width).")
@click.option("--max-seq-len", type=int, help="Position-embedding length (without --model: --seq-len, else 2048).")
@click.option("--ranks", type=click.IntRange(min=1), default=1, show_default=True, help="World size N.")
@click.option("--strategy", type=click.Choice([*STRATEGIES, *ALIASES]), default="full-shard", show_default=True,
              help="FSDP strategy (full and none are ckptool train's names for full-shard and ddp).")
@click.option("--hybrid-shard-size", type=click.IntRange(min=1), help="Ranks per shard group for hybrid.")
@click.option("--mixed-precision", "precision", type=click.Choice(PRECISIONS), default="bf16", show_default=True,
              help="Compute dtype (sharded state is fp32 either way).")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adamw", show_default=True,
              help="adamw (8 B/param) or sgd with momentum (4 B/param).")
@click.option("--cpu-offload", is_flag=True, help="Sharded state in host memory.")
@click.option("--activation-checkpointing", "ac", type=click.Choice(ACTIVATION_CHECKPOINTING), default="none",
              show_default=True, help="Recompute activations of every / every second block.")
@click.option("--batch-size", type=click.IntRange(min=1), help="GLOBAL sequences per micro-step, as in "
              "ckptool train (default 16 with a model).")
@click.option("--seq-len", type=click.IntRange(min=1), help="Tokens per sequence (default: the model's max).")
@click.option("--hf-model", metavar="SRC", help="A transformers causal LM (model folder, Hub repo id or "
              "config.json): its parameter count, from the config (no weights read; imports torch).")
@click.option("--trust-remote-code", is_flag=True, help="Let --hf-model run the model folder's own code (auto_map).")
@click.option("--gpu-memory", default="80GB", show_default=True, help="Memory per GPU (80GB, 141GB, 24GiB).")
@click.option("--json", "json_out", is_flag=True, help="Print the estimate as JSON.")
def estimate_cmd(params: int | None, model: str | None, ranks: int, strategy: str,
                 hybrid_shard_size: int | None, precision: str, optimizer: str, cpu_offload: bool, ac: str,
                 batch_size: int | None, seq_len: int | None, gpu_memory: str, json_out: bool,
                 hf_model: str | None, trust_remote_code: bool, **shape: int | None) -> None:
    """Per-GPU memory of a training run, before launch: state, gathered blocks, activations.

    \b
    Compares the strategy with DDP and says whether it fits --gpu-memory; if not, what to try
    (full shard, then activation checkpointing, then CPU offload or more ranks). AdamW holds
    16 B/param of state (fp32 params 4, fp32 grads 4, optimizer 8), divided by the ranks it
    is sharded over. Sizes are decimal (1 GB = 10^9 bytes).

    Exit status: 0 when it fits, 1 when it does not (the table and what to try are printed
    either way), 2 for a usage error.

    \b
    Examples:
      ckptool estimate --params 7e9 --ranks 8
      ckptool estimate --model 1b --ranks 8 --batch-size 64 --seq-len 1024
    """
    try:
        if hf_model is not None:
            params = _hf_params(hf_model, trust_remote_code, params, model, shape)
        est = _estimate(params, model, ranks, strategy, hybrid_shard_size, precision, optimizer, cpu_offload,
                        ac, batch_size, seq_len, gpu_memory, shape)
    except ConfigError as e:  # a bad option value or combination: a usage error, as click's own
        raise click.UsageError(" ".join(str(e).split())) from e
    if json_out:
        echo_json(est.to_dict())
    else:
        click.echo(render(est))
    if est.verdict is not None and not est.verdict.fits:
        raise SystemExit(1)


def _estimate(params: int | None, model: str | None, ranks: int, strategy: str, hybrid_shard_size: int | None,
              precision: str, optimizer: str, cpu_offload: bool, ac: str, batch_size: int | None,
              seq_len: int | None, gpu_memory: str, shape: dict[str, int | None]) -> Estimate:
    from ckptool.ops.estimate import estimate, resolve_model

    given = {k: v for k, v in shape.items() if v is not None}
    if params is not None and (model or given):
        raise click.UsageError("--params and a model shape (--model, --d-model, ...) are exclusive; pass one")
    if params is None and not (model or given):
        raise click.UsageError("pass --params N, or a model: --model NAME or --d-model, --layers and --vocab")
    cfg = None
    if params is None:
        if model is None and seq_len is not None:
            given.setdefault("max_seq_len", seq_len)
        cfg = resolve_model(model, n_layers=given.pop("layers", None), n_heads=given.pop("heads", None), **given)
    return estimate(params=params, model=cfg, ranks=ranks,
                    strategy=strategy, hybrid_shard_size=hybrid_shard_size, precision=precision,
                    optimizer=optimizer, cpu_offload=cpu_offload, activation_checkpointing=ac,
                    batch_size=batch_size, seq_len=seq_len, gpu_memory=parse_size(gpu_memory, option="--gpu-memory"))


def _hf_params(src: str, trust_remote_code: bool, params: int | None, model: str | None,
               shape: dict[str, int | None]) -> int:
    """``--hf-model``: the parameter count of its config (built on meta by transformers)."""
    if params is not None or model or any(v is not None for v in shape.values()):
        raise click.UsageError("--hf-model takes the model from SRC; drop --params, --model and the sizes")
    from ckptool.train.config import require_transformers

    require_transformers()
    from ckptool.train.hf_model import param_count

    return param_count(src, trust_remote_code=trust_remote_code)


ROWS = (("parameters", "params_bytes"), ("gradients", "grads_bytes"), ("optimizer state", "optim_bytes"),
        ("total state", "state_bytes"), ("largest gathered block", "largest_block_bytes"),
        ("gathered (transient)", "gathered_bytes"), ("activations", "activation_bytes"),
        ("estimated peak", "peak_bytes"))


def render(est: Estimate) -> str:
    """The human table: one column for the strategy, one for DDP, then the verdict."""
    columns = [est.per_rank] if est.strategy == "ddp" else [est.per_rank, est.ddp]
    rows = list(ROWS)
    if est.cpu_offload:
        rows[4:4] = [("  on the GPU", "gpu_state_bytes"), ("  on the host", "host_state_bytes")]
    lines = [_headline(est), f"{'per rank':<24}" + "".join(f"{_label(est, t):>18}" for t in columns)]
    for title, field in rows:
        lines.append(f"{title:<24}" + "".join(f"{_cell(t, field):>18}" for t in columns))
    lines.append(f"model state, one full copy: {fmt_bytes(est.total_state_bytes)}")
    if est.verdict is not None:
        lines.append(est.verdict.message)
    lines += [f"note: {n}" for n in est.notes]
    return "\n".join(lines)


def _headline(est: Estimate) -> str:
    b = est.bytes_per_param
    what = f"{est.params:,} parameters on {est.ranks} rank{'s' if est.ranks > 1 else ''}"
    if est.model is not None:
        what += f", {est.micro_batch} x {est.seq_len} tokens per rank"
    return (f"{what}: {est.precision} compute, {est.optimizer}, {b['total']} B/param of state "
            f"(fp32 params {b['params']} + fp32 grads {b['grads']} + optimizer {b['optim']})"
            + ("" if est.activation_checkpointing == "none"
               else f", activation checkpointing {est.activation_checkpointing}"))


def _label(est: Estimate, t: Terms) -> str:
    if t.strategy == "ddp":
        return "ddp"
    of = f" of {est.ranks}" if t.shard_ranks != est.ranks else ""
    return f"{t.strategy} /{t.shard_ranks}{of}" + (" +offload" if est.cpu_offload else "")


def _cell(t: Terms, field: str) -> str:
    value = getattr(t, field)
    if value is None:
        return "-"
    if field == "peak_bytes" and t.activation_bytes is None:
        return ">= " + fmt_bytes(value)
    return fmt_bytes(value)
