"""``ckptool ls``: the checkpoints of a run folder."""

from __future__ import annotations

import sys
import time

import click

from ckptool.cli._common import echo_json, human_bytes


@click.command("ls")
@click.argument("run_dir")
@click.option("--json", "json_out", is_flag=True, help="Print the list as JSON.")
def ls_cmd(run_dir: str, json_out: bool) -> None:
    """List every checkpoint in RUN_DIR with its status; mark the latest good one.

    Status is "complete" (committed and structurally valid), "incomplete"
    (no .metadata: the save was interrupted) or "invalid" (committed but
    broken; run 'ckptool validate' on it for details).

    \b
    Example:
      ckptool ls runs/demo
    """
    from ckptool.ops.inspect import list_run

    entries = list_run(run_dir)
    if json_out:
        echo_json(entries)
        return
    if not entries:
        click.echo(f"no checkpoints in {run_dir}", err=True)
        sys.exit(1)
    click.echo(f"{'':2}{'name':<20} {'step':>8}  {'status':<10} {'ranks':>5} {'size':>10}  saved")
    for e in entries:
        mark = "* " if e.latest_good else "  "
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.mtime)) if e.mtime else "-"
        step = "-" if e.step is None else str(e.step)
        ranks = "-" if e.world_size is None else str(e.world_size)
        click.echo(f"{mark}{e.name:<20} {step:>8}  {e.status:<10} {ranks:>5} "
                   f"{human_bytes(e.bytes):>10}  {when}")
    if any(e.latest_good for e in entries):
        click.echo("\n* latest good checkpoint")
