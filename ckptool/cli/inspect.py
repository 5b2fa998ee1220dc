"""``ckptool inspect``: what one checkpoint holds."""

from __future__ import annotations

import click

from ckptool.cli._common import plural, echo_json, echo_note, human_bytes, model_key_options


@click.command("inspect")
@click.argument("checkpoint")
@model_key_options
@click.option("--json", "json_out", is_flag=True, help="Print the summary as JSON.")
def inspect_cmd(checkpoint: str, model_key: str | None, keep_wrappers: bool,
                json_out: bool) -> None:
    """Show the step, world size, files and every key of CHECKPOINT.

    Keys are grouped into model, optimizer and other (step, scheduler, RNG, ...),
    each with dtype, global shape, number of chunks and bytes. The grouping is
    read from the checkpoint's records (DCP's planner_data), and is the one
    consolidate and upload use; --model-key chooses the model by hand.

    \b
    Example:
      ckptool inspect runs/demo/step_300
    """
    from ckptool.ops.inspect import GROUPS, inspect

    s = inspect(checkpoint, model_key=model_key, keep_wrappers=keep_wrappers)
    echo_note(s.note)
    if json_out:
        echo_json(s)
        return
    click.echo(f"{s.path}")
    click.echo(f"  step {s.step}  world size {s.world_size}  {len(s.files)} files  "
               f"{human_bytes(s.total_bytes)}")
    if s.manifest and s.manifest.get("loss") is not None:
        click.echo(f"  loss {s.manifest['loss']:.4f}")
    if s.layout:
        click.echo(f"  {s.layout}")
    for g in GROUPS:
        keys = s.groups.get(g, ())
        if not keys:
            continue
        click.echo(f"\n{g} ({len(keys)} keys, {human_bytes(s.group_bytes(g))})")
        width = min(max(len(k.fqn) for k in keys), 60)
        for k in keys:
            if k.kind == "tensor":
                shape = "x".join(map(str, k.shape)) if k.shape else "scalar"
                click.echo(f"  {k.fqn:<{width}}  {k.dtype:<9} {shape:<16} "
                           f"{plural(k.chunks, 'chunk'):>10}  {human_bytes(k.bytes):>10}")
            else:
                click.echo(f"  {k.fqn:<{width}}  {'object':<9} {'':<16} {'':>10}  "
                           f"{human_bytes(k.bytes):>10}")
