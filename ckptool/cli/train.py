"""``ckptool train``: parse options -> ``TrainConfig`` -> ``launch`` -> render the summary.

With no options it runs the demo: the tiny model on 2 CPU ranks into ``runs/demo``. torch is
imported only when the command runs (``ckptool --help`` stays fast).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click
from click.core import ParameterSource

from ckptool.cli._common import echo_json, human_bytes, plural, progress_enabled
from ckptool.errors import ConfigError
from ckptool.storage import is_url
from ckptool.train.config import ACTIVATION_CHECKPOINTING, DEVICES, PRECISION, SHARDING, TrainConfig
from ckptool.train.events import RunStarted, SaveReport, StepReport, TrainResult
from ckptool.train.preflight import Notice
from ckptool.train.sizes import PRESETS

# CLI option name -> TrainConfig field, where they differ.
RENAMED = {"layers": "n_layers", "heads": "n_heads", "no_resume": "resume"}
NOT_CONFIG = ("config", "accelerate_config", "json_out")


def _default(name: str) -> str:
    return f"  [default: {TrainConfig.__dataclass_fields__[name].default}]"


_PATH, _FILE = click.Path(file_okay=False), click.Path(dir_okay=False)
_FLAG: dict[str, Any] = {"is_flag": True, "default": None}
#: Where the run goes, how long it is and how it saves.
_RUN = [
    click.option("--out", type=_PATH, help="Run folder (step_N/ checkpoints)." + _default("out")),
    click.option("--nproc", type=int, help="Ranks to start (default: one per GPU, or 2 on CPU)."),
    click.option("--steps", type=int, help="Train up to this step." + _default("steps")),
    click.option("--save-every", type=int, help="Checkpoint every K steps; 0: never." + _default("save_every")),
    click.option("--keep", type=int, help="Committed checkpoints to keep; 0: all." + _default("keep")),
    click.option("--async-save", **_FLAG, help="Save in a background process (dcp.async_save)."),
    click.option("--seed", type=int, help="Seed for weights and data order." + _default("seed")),
]
#: The built-in model's shape.
_MODEL = [
    click.option("--model", type=click.Choice(list(PRESETS)), help="Model size." + _default("model")),
    click.option("--d-model", type=int, help="Override the width."),
    click.option("--layers", type=int, help="Override the number of blocks."),
    click.option("--heads", type=int, help="Override the attention heads."),
    click.option("--vocab", type=int, help="Override the vocabulary size."),
    click.option("--d-ff", type=int, help="Override the MLP width (default 4 x width)."),
    click.option("--max-seq-len", type=int, help="Override the position-embedding length."),
]
#: How the model is sharded and computed.
_PARALLEL = [
    click.option("--sharding", type=click.Choice(SHARDING), help="FSDP strategy." + _default("sharding")),
    click.option("--hybrid-shard-size", type=int, help="Ranks per shard group for --sharding hybrid."),
    click.option("--mixed-precision", type=click.Choice(PRECISION), help="Default: bf16 on GPU, fp32 on CPU."),
    click.option("--activation-checkpointing", type=click.Choice(ACTIVATION_CHECKPOINTING),
                 help="Recompute activations of every / every second block."
                 + _default("activation_checkpointing")),
    click.option("--cpu-offload", **_FLAG, help="Keep sharded state in host memory (CPUOffloadPolicy)."),
]
#: The optimizer, its schedule and the batches.
_OPTIMIZER = [
    click.option("--lr", type=float, help="Peak learning rate." + _default("lr")),
    click.option("--warmup-steps", type=int, help="Linear warmup (default: 10% of the decay, at most 100)."),
    click.option("--lr-decay-steps", type=int, help="End of the cosine decay (default: --steps)."),
    click.option("--weight-decay", type=float, help="AdamW weight decay." + _default("weight_decay")),
    click.option("--grad-clip", type=float, help="Gradient-norm clip; 0: off." + _default("grad_clip")),
    click.option("--batch-size", type=int, help="GLOBAL sequences per micro-step." + _default("batch_size")),
    click.option("--seq-len", type=int, help="Tokens per sequence (default: the model's max)."),
    click.option("--grad-accum", type=int, help="Micro-batches per step." + _default("grad_accum")),
]
#: What the run starts from, where options and data come from, and output.
_START = [
    click.option("--no-resume", **_FLAG, help="Start fresh; refuse an --out that holds checkpoints."),
    click.option("--resume-from", type=click.Path(), help="Resume from this checkpoint folder."),
    click.option("--init-from", type=click.Path(),
                 help="Fresh run: start from these model weights (checkpoint or HF safetensors)."),
    click.option("--hf-model", metavar="SRC", help="Fine-tune a transformers causal LM instead: HF model "
                 "folder, Hub repo id, or a config.json (random init); needs ckptool[hf]."),
    click.option("--trust-remote-code", **_FLAG, help="Let --hf-model run the model folder's own code (auto_map)."),
    click.option("--config", type=_FILE, help="YAML/JSON file of these options (dashes or underscores)."),
    click.option("--accelerate-config", type=_FILE, help="Take FSDP settings from an Accelerate config file."),
    click.option("--log-every", type=int, help="Report progress every K steps." + _default("log_every")),
    click.option("--data", type=_FILE, help="Text file to train on (bytes as tokens; default: built-in corpus)."),
    click.option("--scaling-check", **_FLAG, help="Also time 1 rank; report samples/s at N vs 1 rank."),
    click.option("--final-model-only", **_FLAG, help="Also save OUT/final_model (model weights only)."),
    click.option("--device", type=click.Choice(DEVICES), help="CUDA when available." + _default("device")),
    click.option("--json", "json_out", is_flag=True, help="Print the summary as JSON (no progress)."),
]


def _options(f: Any) -> Any:
    """Apply every option of ``train``, in --help order."""
    for opt in reversed(_RUN + _MODEL + _PARALLEL + _OPTIMIZER + _START):
        f = opt(f)
    return f


@click.command("train")
@_options
@click.pass_context
def train(ctx: click.Context, **kw: Any) -> None:
    """Train the built-in GPT with FSDP2 and save DCP checkpoints (no options: the CPU demo).

    \b
    Runs N ranks itself (--nproc), or joins torchrun / accelerate launch. Resumes from the
    latest valid checkpoint in --out unless --no-resume. Option precedence: command line >
    --accelerate-config > --config > defaults.
    """
    from ckptool.train.launch import launch  # torch is imported only once ranks start

    try:
        cfg = _config(ctx, kw)
        view = _Progress(enabled=not kw["json_out"])
        try:
            result = launch(cfg, on_event=view)
        finally:
            view.close()
    except ConfigError as e:  # a bad option or a contradiction between options: usage, exit 2
        raise click.UsageError(" ".join(str(e).split()), ctx) from e
    if result is None:  # a rank other than 0 under torchrun
        return
    if kw["json_out"]:
        echo_json(result)
    else:
        click.echo(render_summary(result, cfg))


def _config(ctx: click.Context, kw: dict[str, Any]) -> TrainConfig:
    from ckptool.train.config import read_config_file

    options = read_config_file(kw["config"]) if kw["config"] else {}
    if kw["accelerate_config"]:
        from ckptool.train.accelerate_config import read_accelerate_config

        options.update(read_accelerate_config(kw["accelerate_config"]))
    options.update(_given(ctx, kw))
    return TrainConfig.from_dict(options)


def _given(ctx: click.Context, kw: dict[str, Any]) -> dict[str, Any]:
    """Options set on the command line, as TrainConfig fields."""
    out = {}
    for name, value in kw.items():
        if name in NOT_CONFIG or ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE:
            continue
        if name == "no_resume":
            value = not value
        out[RENAMED.get(name, name)] = value
    return out


#: Widest line the progress view and the summary aim for (a bar never grows past it).
WIDTH = 80


class _Progress:
    """Renders rank 0's events on stderr: on a terminal a one-line tqdm bar (at most 80
    columns) with every message on its own line above it; in a pipe one line per report."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.use_bar = enabled and progress_enabled(False)

    def __call__(self, event: Notice | RunStarted | StepReport | SaveReport) -> None:
        if not self.enabled:
            return
        match event:
            case Notice(text=text):
                self._line(f"note: {text}")
            case RunStarted():
                self._started(event)
            case StepReport():
                self._step(event)
            case SaveReport(path=path, blocked_seconds=blocked, is_async=is_async):
                what = "saving" if is_async else "saved"
                self._line(f"{what} {_short(path)} (training blocked {blocked:.2f} s)")

    def _started(self, e: RunStarted) -> None:
        self._line(f"training {e.model_params:,} parameters on {plural(e.world_size, 'rank')}: "
                   f"{e.device}, {e.precision}, sharding {e.sharding}")
        where = f"resumed from {_short(e.resumed_from)}" if e.resumed_from else "fresh start"
        self._line(f"{where}: steps {e.start_step + 1}..{e.steps}" if e.start_step < e.steps
                   else f"{where}: already at step {e.steps}")
        if self.use_bar and e.start_step < e.steps:
            import shutil

            from tqdm import tqdm

            self.bar = tqdm(total=e.steps, initial=e.start_step, unit="step", desc="train",
                            ncols=min(WIDTH, shutil.get_terminal_size().columns),
                            bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                       "[{elapsed}<{remaining}{postfix}]")

    def _step(self, e: StepReport) -> None:
        if self.bar is not None:
            self.bar.update(e.step - self.bar.n)
            self.bar.set_postfix_str(f"loss {e.loss:.4f}, {e.tokens_per_s:,.0f} tok/s", refresh=True)
        else:
            click.echo(f"step {e.step}/{e.steps}  loss {e.loss:.4f}  {e.tokens_per_s:,.0f} tok/s  "
                       f"{e.step_seconds * 1000:.0f} ms/step", err=True)

    def _line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            click.echo(text, err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _state(b: dict[str, int]) -> str:
    return f"params {human_bytes(b['params'])}, grads {human_bytes(b['grads'])}, optim {human_bytes(b['optim'])}"


def _short(path: str) -> str:
    """``path`` relative to the current folder when it lies inside it (a URL as it is)."""
    if is_url(path):
        return path
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _export(r: TrainResult, cfg: Any) -> str:
    """Where the summary suggests exporting to: an HF model is a folder from_pretrained loads."""
    if getattr(cfg, "hf_model", None) and not is_url(r.out):
        return _short(r.out.rstrip("/")) + "-hf/"
    return "model.safetensors"


def render_summary(r: TrainResult, cfg: Any) -> str:
    """The human summary of a ``TrainResult``, ending with the next commands to try."""
    if not r.losses:
        return (f"{_short(r.out)} is already at step {r.steps} (--steps {cfg.steps}): nothing to train.\n"
                f"Pass a larger --steps to continue, or a new --out to start over.")
    lines = [
        f"trained steps {r.start_step + 1}..{r.steps} in {r.wall_seconds:.1f} s on "
        f"{plural(r.world_size, 'rank')} ({r.device}, {r.precision}, sharding {r.sharding})",
    ]
    if r.resumed_from:
        lines.append(f"resumed from {_short(r.resumed_from)}")
    lines += [
        f"loss {r.first_loss:.4f} -> {r.final_loss:.4f}",
        f"throughput {r.tokens_per_s:,.0f} tokens/s, {r.samples_per_s:.1f} samples/s",
    ]
    if len({tuple(sorted(b.items())) for b in r.state_bytes}) == 1:
        who = f"state of each of {r.world_size} ranks" if r.world_size > 1 else "state"
        lines.append(f"{who}: {_state(r.state_bytes[0])}")
    else:
        lines += ["state per rank:"] + [f"  rank {i}: {_state(b)}" for i, b in enumerate(r.state_bytes)]
    lines.append(f"saves: {r.saves}, {r.save_seconds:.2f} s saving, training blocked {r.blocked_seconds:.2f} s")
    if r.peak_memory_bytes:
        lines.append("peak GPU memory: " + ", ".join(human_bytes(b) for b in r.peak_memory_bytes))
    if r.scaling:
        s = r.scaling
        lines += [f"scaling: {s['speedup']:.2f}x on {plural(int(s['ranks']), 'rank')}, "
                  f"{100 * s['efficiency']:.0f}% efficiency (same batch, {int(s['timed_steps'])} timed steps)",
                  f"  {s['samples_per_s']:.1f} samples/s vs {s['samples_per_s_1_rank']:.1f} on 1 rank "
                  f"with one rank's CPU threads"]
    if r.latest:
        latest = _short(r.latest)
        lines += ["checkpoints: " + ", ".join(r.checkpoints), "", "Next:",
                  f"  ckptool validate {latest}",
                  f"  ckptool consolidate {latest} {_export(r, cfg)}"]
    return "\n".join(lines)
