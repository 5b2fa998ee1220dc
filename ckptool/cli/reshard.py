"""``ckptool reshard``: rewrite a checkpoint for another rank count, offline."""

from __future__ import annotations

import click

from ckptool.cli._common import plural, byte_progress, echo_json, human_bytes, progress_enabled


@click.command("reshard")
@click.argument("src")
@click.argument("dst", required=False)
@click.option("--to", "to", type=click.IntRange(min=1), required=True, metavar="M",
              help="Rank count of the new layout (1: a single-file checkpoint).")
@click.option("--from", "from_", type=click.IntRange(min=1), default=None, metavar="N",
              help="Fail (writing nothing) unless SRC was saved by N ranks.")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Deep-validate the output and compare per-tensor checksums with SRC "
                   "before committing it.")
@click.option("--json", "json_out", is_flag=True, help="Print a JSON summary.")
def reshard_cmd(src: str, dst: str | None, to: int, from_: int | None, force: bool,
                verify: bool, json_out: bool) -> None:
    """Rewrite checkpoint SRC so that rank r of M ranks reads exactly one file.

    The output (DST; default for RUN/step_N: RUN-wsM/step_N, a new run that
    'ckptool train --out RUN-wsM --nproc M' resumes; else SRC-wsM) holds __r_0.distcp for r in
    0..M-1, each with what rank r owns under FSDP2's layout for M ranks (model
    and optimizer state, Shard(0) as torch.chunk splits it), plus .metadata and
    ckptool.json. Bytes are copied exactly, streaming; memory does not grow
    with the model. It loads with dcp.load on M ranks.

    \b
    Examples:
      ckptool reshard runs/demo/step_300 --from 2 --to 4
      ckptool reshard runs/demo/step_300 single/ --to 1 --json
    """
    from ckptool.ops.reshard import reshard

    with byte_progress("reshard", progress_enabled(json_out)) as progress:
        result = reshard(src, dst, world_size=to, expect_from=from_, force=force, verify=verify,
                         progress=progress)
    if json_out:
        echo_json(result)
        return
    ranks = result.source_world_size if result.source_world_size is not None else "?"
    click.echo(f"wrote {result.destination}: {plural(result.world_size, 'rank')} (from {ranks}), "
               f"{result.tensors} tensors, {result.objects} other values, "
               f"{human_bytes(result.bytes)} in {result.seconds:.1f} s"
               f"{' (verified)' if result.verified else ' (not verified)'}")
