"""``ckptool import``: a Hugging Face safetensors model as a DCP checkpoint for N ranks."""

from __future__ import annotations

import click

from ckptool.cli._common import plural, byte_progress, echo_json, human_bytes, progress_enabled


@click.command("import")
@click.argument("src")
@click.argument("dst")
@click.option("--ranks", type=click.IntRange(min=1), required=True, metavar="N",
              help="FSDP2 rank count of the output layout.")
@click.option("--dtype", type=click.Choice(["float32", "keep"]), default="float32",
              show_default=True, help="float32: cast floating tensors to FSDP2 fp32 master "
                                      "weights (bf16 -> fp32 is exact); keep: the saved dtypes.")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Deep-validate the output and compare per-tensor checksums before "
                   "committing it.")
@click.option("--json", "json_out", is_flag=True, help="Print a JSON summary.")
def import_cmd(src: str, dst: str, ranks: int, dtype: str, force: bool, verify: bool,
               json_out: bool) -> None:
    """Write Hugging Face model SRC as a DCP checkpoint DST for N FSDP2 ranks.

    SRC is a model folder (model.safetensors, or shards and
    model.safetensors.index.json), one .safetensors file, or a Hub repo id
    org/name[@revision] (only the safetensors, the index, config and tokenizer
    files are downloaded). DST holds __r_0.distcp for r in 0..N-1 with rank r's
    torch.chunk rows of every tensor under keys model.<name>, as fully_shard +
    dcp.save write them, plus .metadata, ckptool.json and the config and
    tokenizer files in hf_assets/. Pickle weights (.bin) are refused.

    \b
    Examples:
      ckptool import ./Llama-3.2-1B ckpt/llama-ws8 --ranks 8
      ckptool import meta-llama/Llama-3.2-1B@main ckpt/llama-ws4 --ranks 4 --dtype keep
    """
    from ckptool.ops.import_hf import import_hf

    with byte_progress("import", progress_enabled(json_out)) as progress:
        result = import_hf(src, dst, world_size=ranks, dtype=dtype, force=force, verify=verify,
                           progress=progress)
    if json_out:
        echo_json(result)
        return
    casts = ", ".join(f"{a} -> {b}" for a, b in sorted(result.dtypes.items()))
    click.echo(f"wrote {result.destination}: {plural(result.world_size, 'rank')}, "
               f"{result.tensors} tensors"
               f"{f' ({len(result.tied)} tied)' if result.tied else ''}, "
               f"{human_bytes(result.bytes)}{f' ({casts})' if casts else ''} in "
               f"{result.seconds:.1f} s{' (verified)' if result.verified else ' (not verified)'}")
