"""``ckptool validate``: prove a checkpoint on disk is complete."""

from __future__ import annotations

import sys

import click

from ckptool.cli._common import byte_progress, echo_json, human_bytes, progress_enabled


@click.command("validate")
@click.argument("checkpoint")
@click.option("--deep", is_flag=True,
              help="Also read every record: parse it, compare dtype/shape, verify CRC-32 and "
                   "manifest checksums (reads all bytes).")
@click.option("--world-size", type=click.IntRange(min=1), default=None,
              help="Fail unless the checkpoint was saved by this many ranks.")
@click.option("--json", "json_out", is_flag=True, help="Print the report as JSON.")
def validate_cmd(checkpoint: str, deep: bool, world_size: int | None, json_out: bool) -> None:
    """Check that CHECKPOINT is committed and every byte it needs is present.

    \b
    Structural checks (fast, reads only .metadata and file sizes):
      committed (.metadata present), chunks inside each tensor's shape, no
      overlaps, no gaps, every referenced file present, inside the folder and
      long enough, no unreferenced .distcp files, manifest sizes.
    With --deep: every record parsed and its CRC-32 verified.

    Exit status 0 when complete, 1 with one line per problem otherwise.

    \b
    Example:
      ckptool validate runs/demo/step_300 --deep
    """
    from ckptool.ops.validate import Severity, validate

    with byte_progress("validate", deep and progress_enabled(json_out)) as progress:
        report = validate(checkpoint, deep=deep, world_size=world_size, progress=progress)
    if json_out:
        echo_json({"ok": report.ok, **{k: v for k, v in vars(report).items() if k != "metadata"}})
    else:
        for f in report.findings:
            click.echo(str(f), err=f.severity is Severity.ERROR)
        if report.ok:
            kind = "deep" if deep else "structure"
            click.echo(f"ok: {report.path} is complete ({report.tensors} tensors, "
                       f"{report.files} files, {human_bytes(report.total_bytes)}, "
                       f"world size {report.world_size}; checked {kind})")
    sys.exit(0 if report.ok else 1)
