"""What ``ckptool train`` prints (issue 14, item 5): on a terminal the tqdm bar and every
message on separate lines within 80 columns; in a pipe one short line per report; the summary
within 80 columns for identical ranks, with "1 rank" / "2 ranks"."""

from __future__ import annotations

import re

from ckptool.cli import train as train_cli
from ckptool.train.config import TrainConfig
from ckptool.train.loop import RunStarted, SaveReport, StepReport, TrainResult
from ckptool.train.preflight import Notice

STATE = {"params": 468096, "grads": 468096, "optim": 936304}


def _events(path: str) -> list:
    steps = [StepReport(s, 300, 5.5 - s / 100, 3e-3, 12345.6, 0.1234, [STATE] * 4, None, 0.4, 0.35)
             for s in (10, 20, 100, 110)]
    return [Notice("step_100 was saved by 2 ranks, loading on 4 (DCP reshards on load)"),
            RunStarted(4, "cpu", "fp32", "hybrid", 234048, 0, 300, None),
            steps[0], steps[1], SaveReport(100, path, 0.35, True), steps[2], steps[3]]


def _screen_lines(text: str) -> list[str]:
    """What a terminal shows, line by line: a carriage return starts the line over."""
    return [seg for line in text.split("\n") for seg in line.split("\r") if seg.strip()]


def test_terminal_bar_and_messages_on_separate_lines_within_80_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: the bar still stops at 80
    view = train_cli._Progress(enabled=True)
    view.use_bar = True  # as on a terminal
    for e in _events("runs/demo/step_100"):
        view(e)
    view.close()
    lines = _screen_lines(capsys.readouterr().err)
    assert all(len(ln.rstrip()) <= 80 for ln in lines), [ln for ln in lines if len(ln.rstrip()) > 80]
    messages = [ln for ln in lines if not ln.startswith("train ")]
    assert messages == [
        "note: step_100 was saved by 2 ranks, loading on 4 (DCP reshards on load)",
        "training 234,048 parameters on 4 ranks: cpu, fp32, sharding hybrid",
        "fresh start: steps 1..300",
        "saving runs/demo/step_100 (training blocked 0.35 s)",
    ]
    bars = [ln for ln in lines if ln.startswith("train ")]
    assert bars and all(re.search(r"\| \d+/300 \[", b) for b in bars)
    assert any("loss 4.4000, 12,346 tok/s" in b for b in bars)


def test_pipe_one_short_line_per_report(capsys):
    view = train_cli._Progress(enabled=True)
    view.use_bar = False  # stderr is not a terminal
    for e in _events("runs/demo/step_100"):
        view(e)
    view.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert lines[3:] == ["step 10/300  loss 5.4000  12,346 tok/s  123 ms/step",
                         "step 20/300  loss 5.3000  12,346 tok/s  123 ms/step",
                         "saving runs/demo/step_100 (training blocked 0.35 s)",
                         "step 100/300  loss 4.5000  12,346 tok/s  123 ms/step",
                         "step 110/300  loss 4.4000  12,346 tok/s  123 ms/step"]
    assert all(len(ln) <= 80 for ln in lines)


def _result(world_size: int, **kw) -> TrainResult:
    base = dict(out="runs/demo", world_size=world_size, device="cpu", precision="fp32", sharding="full",
                model_params=234048, start_step=0, steps=300, resumed_from=None, first_loss=5.5542,
                final_loss=0.4067, losses=[5.5542, 0.4067], wall_seconds=54.4, tokens_per_s=5763.0,
                samples_per_s=90.1, state_bytes=[STATE] * world_size, peak_memory_bytes=None, saves=1,
                save_seconds=0.5, blocked_seconds=0.3, checkpoints=["step_300"], latest="runs/demo/step_300")
    return TrainResult(**{**base, **kw})


def test_summary_fits_80_columns_and_counts_ranks():
    text = train_cli.render_summary(_result(4, scaling={
        "ranks": 4.0, "timed_steps": 299.0, "samples_per_s": 90.1, "samples_per_s_1_rank": 30.0,
        "speedup": 3.0, "efficiency": 0.75}), TrainConfig())
    lines = text.splitlines()
    assert all(len(ln) <= 80 for ln in lines), [ln for ln in lines if len(ln) > 80]
    assert lines[0] == "trained steps 1..300 in 54.4 s on 4 ranks (cpu, fp32, sharding full)"
    assert "state of each of 4 ranks: params 457.1 KiB, grads 457.1 KiB, optim 914.4 KiB" in lines
    assert "scaling: 3.00x on 4 ranks, 75% efficiency (same batch, 299 timed steps)" in lines
    one = train_cli.render_summary(_result(1), TrainConfig())
    assert "on 1 rank (cpu" in one and "rank(s)" not in one and "each of" not in one
