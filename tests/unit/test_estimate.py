"""``ckptool estimate``: the seed's 7B arithmetic, exact shard sizes, activations, verdicts, CLI.

The per-rank state terms are checked against real FSDP2 runs in
``tests/dist/test_estimate_reality.py``; the activation formula is checked here against the
bytes autograd really saves for backward (CPU, no process group).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ckptool.cli import cli
from ckptool.cli.estimate import parse_count
from ckptool.errors import ConfigError
from ckptool.ops.estimate import (activation_bytes, estimate, hybrid_shard_size, param_shapes, resolve_model,
                                  shard_numel)
from ckptool.train.sizes import PRESETS

GB = 10**9
P7B = 7_000_000_000


def _cli(*args: str):
    return CliRunner().invoke(cli, ["estimate", *args])


# -- seed 000: 7B parameters, mixed precision, Adam ------------------------------------------


def test_seed_7b_state_is_112_gb_and_14_gb_per_rank_at_8():
    est = estimate(params=P7B, ranks=8)
    # By hand: 16 B/param = fp32 param shard 4 + fp32 grad shard 4 + exp_avg 4 + exp_avg_sq 4.
    assert est.bytes_per_param == {"params": 4, "grads": 4, "optim": 8, "total": 16}
    assert est.total_state_bytes == 7_000_000_000 * 16 == 112_000_000_000
    assert est.per_rank_state_bytes == 112_000_000_000 // 8 == 14_000_000_000
    t = est.per_rank
    assert (t.params_bytes, t.grads_bytes, t.optim_bytes) == (3_500_000_000, 3_500_000_000, 7_000_000_000)
    assert est.ddp.state_bytes == est.ddp.peak_bytes == 112_000_000_000  # one full copy per GPU
    assert t.gathered_bytes is None and t.activation_bytes is None  # no shape: state only


def test_seed_7b_cli_table_and_verdicts():
    res = _cli("--params", "7e9", "--ranks", "8")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[1].split() == ["per", "rank", "full-shard", "/8", "ddp"]
    assert "total state" in lines[5] and lines[5].split()[-4:] == ["14.0", "GB", "112.0", "GB"]
    assert "fits with 66.0 GB headroom of 80.0 GB per GPU (state only)" in res.output
    assert "model state, one full copy: 112.0 GB" in res.output

    ddp = _cli("--params", "7B", "--ranks", "8", "--strategy", "ddp")
    assert ddp.exit_code == 1  # it does not fit
    assert ("does not fit: needs 112.0 GB (state only) of 80.0 GB per GPU, 32.0 GB over; "
            "try --strategy full-shard (14.0 GB, fits)") in ddp.output

    one = estimate(params=P7B, ranks=1, gpu_memory=80 * GB).verdict
    assert not one.fits and one.headroom_bytes == -32 * GB
    assert [(s.options, s.peak_bytes, s.fits) for s in one.suggestions] == [
        ("--cpu-offload", 0, True), ("--ranks 2", 56 * GB, True)]


def test_rubric_order_full_shard_then_checkpointing_then_offload_or_ranks():
    # A 6.7B llama-like shape, 8 x 4096 tokens per rank: activations dominate.
    cfg = resolve_model(d_model=4096, n_layers=32, vocab=32000, max_seq_len=4096)
    v = estimate(model=cfg, ranks=8, strategy="ddp", batch_size=64, seq_len=4096, gpu_memory=80 * GB).verdict
    assert [s.options for s in v.suggestions] == ["--strategy full-shard", "--activation-checkpointing every"]
    assert [s.fits for s in v.suggestions] == [False, True]
    v = estimate(model=cfg, ranks=8, batch_size=64, seq_len=4096, gpu_memory=16 * GB,
                 activation_checkpointing="every").verdict
    assert v.suggestions[0].options == "--cpu-offload" and v.suggestions[-1].options.startswith("--ranks")
    assert "or --ranks" in v.message
    huge = estimate(model=cfg, ranks=8, batch_size=64, seq_len=4096, gpu_memory=1 * GB).verdict
    assert not huge.fits and huge.message.endswith("it does not fit: lower --batch-size or --seq-len")


# -- exact shapes and FSDP2 padding ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_shapes_sum_to_num_params(name):
    cfg = PRESETS[name]
    assert sum(shard_numel(s, 1) for s in param_shapes(cfg).values()) == cfg.num_params()


def test_param_shapes_match_the_built_model():
    from ckptool.train.model import GPT

    cfg = resolve_model("tiny", vocab=258, d_ff=200)
    assert {k: tuple(p.shape) for k, p in GPT(cfg).named_parameters()} == param_shapes(cfg)


def test_uneven_shards_are_padded_per_tensor():
    # vocab 258 over 4 ranks: FSDP2 gives rank 0 ceil(258 / 4) = 65 rows of tok_emb and head.
    cfg = resolve_model("tiny", vocab=258)
    rows = 2 * 65 * 64 + 16 * 64 + 4 * (16 + 48 * 64 + 16 * 64 + 16 + 64 * 64 + 16 * 256) + 16
    t = estimate(model=cfg, ranks=4, precision="fp32").per_rank
    assert t.params_bytes == t.grads_bytes == rows * 4
    assert t.optim_bytes == rows * 8 + 28 * 4  # exp_avg, exp_avg_sq + one 4-byte step per tensor
    assert estimate(params=10, ranks=4).per_rank.params_bytes == 3 * 4


def test_strategies_divide_what_they_shard():
    cfg = PRESETS["small"]
    kw = {"model": cfg, "ranks": 8, "batch_size": 16}
    full, grad_op, ddp = (estimate(strategy=s, **kw).per_rank for s in ("full-shard", "grad-op", "ddp"))
    hybrid = estimate(strategy="hybrid", **kw)
    assert hybrid.shard_ranks == 4 and estimate(strategy="hybrid", hybrid_shard_size=2, **kw).shard_ranks == 2
    # Every first dim of "small" divides by 8, so the shards are exact fractions.
    assert full.params_bytes * 8 == ddp.params_bytes == hybrid.per_rank.params_bytes * 4
    assert full.grads_bytes * 8 == ddp.grads_bytes
    steps = 4 * len(param_shapes(cfg))  # AdamW's 4-byte step per tensor is not sharded
    assert (full.optim_bytes - steps) * 8 == ddp.optim_bytes - steps
    # FSDP2's SHARD_GRAD_OP still stores fp32 master shards / N; the whole compute copy stays gathered.
    assert grad_op.state_bytes == full.state_bytes and grad_op.gathered_bytes > full.gathered_bytes
    assert ddp.gathered_bytes == grad_op.gathered_bytes
    assert estimate(strategy="none", **kw).per_rank == ddp and estimate(strategy="full", **kw).per_rank == full
    off = estimate(cpu_offload=True, **kw).per_rank
    assert (off.gpu_state_bytes, off.host_state_bytes) == (0, full.state_bytes)
    assert off.peak_bytes == full.peak_bytes - full.state_bytes
    sgd = estimate(optimizer="sgd", **kw).per_rank
    assert sgd.optim_bytes * 2 == full.optim_bytes - 4 * len(param_shapes(cfg))


def test_hybrid_default_matches_the_training_loop(monkeypatch):
    from ckptool.train import parallel

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for ranks in (1, 2, 3, 4, 6, 8, 16):
        assert hybrid_shard_size(ranks) == parallel.hybrid_shard_size(ranks)


# -- activations -------------------------------------------------------------------------------


def _saved_bytes(cfg, dtype, batch: int, seq: int) -> int:
    """Bytes autograd saves for backward (distinct storages, parameters excluded), plus the
    logits and targets the training step keeps alive."""
    import torch
    import torch.nn.functional as F

    from ckptool.train.model import GPT

    model = GPT(cfg).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    idx, targets = torch.randint(0, cfg.vocab, (batch, seq)), torch.randint(0, cfg.vocab, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(idx)
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return sum(saved.values()) + logits.nbytes


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_formula_matches_saved_tensors(precision):
    import torch

    cfg = resolve_model("tiny", d_ff=192, n_heads=8)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    measured = _saved_bytes(cfg, dtype, 4, 48)
    est = activation_bytes(cfg, micro_batch=4, seq_len=48, precision=precision)
    # fp32: exact but for one 4-byte loss scalar. bf16 on CPU keeps LayerNorm statistics in
    # bf16 (CUDA keeps fp32, which the formula assumes): 2 B less per statistic.
    stats = 0 if precision == "fp32" else (4 * cfg.n_layers + 2) * 4 * 48 * 2
    assert measured - 4 == est - stats


def test_activation_checkpointing_keeps_block_inputs_and_recomputes_one_block():
    cfg = PRESETS["tiny"]  # d 64, f 256, V 256, h 4, L 4
    n, c = 8 * 64, 2
    block = n * ((8 * 64 + 2 * 256) * c + 4 * 4 + 16)
    head = n * ((2 * 64 + 256) * c + 4 * 256 + 24) + 8 * 64
    kw = {"micro_batch": 8, "seq_len": 64}
    assert activation_bytes(cfg, **kw) == 4 * block + head
    assert activation_bytes(cfg, checkpointing="every", **kw) == 4 * n * 64 * c + block + head
    assert activation_bytes(cfg, checkpointing="every-2", **kw) == 2 * n * 64 * c + 2 * block + block + head


def test_batch_is_global_and_split_over_ranks():
    one = estimate(model="tiny", ranks=1, batch_size=16)
    four = estimate(model="tiny", ranks=4, batch_size=16)
    assert (one.micro_batch, four.micro_batch, one.seq_len) == (16, 4, 64)
    assert four.per_rank.activation_bytes < one.per_rank.activation_bytes
    assert estimate(model="tiny", ranks=3, batch_size=16).notes[-1].startswith("--batch-size 16 does not split")


# -- JSON, errors ------------------------------------------------------------------------------


def test_json_keys():
    res = _cli("--model", "tiny", "--ranks", "2", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert list(data)[:2] == ["total_state_bytes", "per_rank_state_bytes"]
    assert data["per_rank_state_bytes"] == data["per_rank"]["state_bytes"] == 468096 * 2 + 936304
    for key in ("params_bytes", "grads_bytes", "optim_bytes", "gathered_bytes", "largest_block_bytes",
                "activation_bytes", "peak_bytes", "gpu_state_bytes", "host_state_bytes"):
        assert isinstance(data["per_rank"][key], int) and isinstance(data["ddp"][key], int), key
    assert data["model"]["d_ff"] == 256 and data["verdict"]["fits"] is True
    assert data["params"] == 234048 and data["ranks"] == 2 and data["strategy"] == "full-shard"


@pytest.mark.parametrize("args, words", [
    (["--params", "-7e9"], "Invalid value for '--params': '-7e9' is not a positive parameter count"),
    (["--params", "lots"], "is not a positive parameter count"),
    (["--params", "7e9", "--ranks", "0"], "Invalid value for '--ranks': 0 is not in the range x>=1"),
    (["--model", "huge"], "Invalid value for '--model': 'huge' is not one of 'tiny'"),
    (["--params", "7e9", "--model", "tiny"], "exclusive"),
    ([], "pass --params N, or a model"),
    (["--params", "7e9", "--gpu-memory", "lots"], "Invalid value for --gpu-memory: 'lots' is not a size"),
])
def test_usage_errors_exit_2(args, words):
    res = _cli(*args)
    assert res.exit_code == 2 and words in res.output, res.output


@pytest.mark.parametrize("args, words", [
    (["--d-model", "64"], "a model shape without --model needs --layers, --vocab"),
    (["--params", "7e9", "--batch-size", "8"], "need a model shape"),
    (["--params", "7e9", "--ranks", "6", "--strategy", "hybrid", "--hybrid-shard-size", "4"],
     "hybrid shard size 4 does not divide 6 ranks"),
    (["--model", "tiny", "--heads", "5"], "--d-model 64 is not divisible by --heads 5"),
    (["--model", "tiny", "--seq-len", "65"], "--seq-len 65 exceeds the model's max_seq_len 64"),
])
def test_bad_combinations_are_usage_errors_exit_2(args, words):
    proc = subprocess.run([sys.executable, "-m", "ckptool", "estimate", *args], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and words in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_does_not_fit_exits_1_and_fits_exits_0():
    # The verdict is the exit status, so a script can gate a launch on it (--json too).
    fits = _cli("--params", "7e9", "--ranks", "8")
    assert fits.exit_code == 0 and "fits with" in fits.output
    ddp = _cli("--params", "7e9", "--ranks", "8", "--strategy", "ddp")
    assert ddp.exit_code == 1 and "does not fit" in ddp.output
    as_json = _cli("--params", "7e9", "--ranks", "8", "--strategy", "ddp", "--json")
    assert as_json.exit_code == 1 and json.loads(as_json.output)["verdict"]["fits"] is False


def test_library_errors():
    for kw in ({"params": -1}, {"params": 0}, {"params": P7B, "ranks": 0}, {"model": "huge"}, {},
               {"params": P7B, "model": "tiny"}, {"params": P7B, "strategy": "zero3"}):
        with pytest.raises(ConfigError):
            estimate(**{"ranks": 1, **kw})


def test_parse_count_and_no_torch():
    assert [parse_count(s) for s in ("7e9", "7B", "1.3b", "125M", "7_000_000_000", "350m", "1000")] == [
        P7B, P7B, 1_300_000_000, 125_000_000, P7B, 350_000_000, 1000]
    code = ("import sys; from click.testing import CliRunner; from ckptool.cli import cli; "
            "r = CliRunner().invoke(cli, ['estimate', '--model', '1b', '--ranks', '8']); "
            "assert r.exit_code == 0, r.output; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
