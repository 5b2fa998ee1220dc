"""``ckptool consolidate``: export a checkpoint's model weights to safetensors."""

from __future__ import annotations


import click

from ckptool.cli._common import (byte_progress, echo_json, echo_note, human_bytes,
                                 model_key_options, parse_size, progress_enabled)


@click.command("consolidate")
@click.argument("checkpoint")
@click.argument("output", type=click.Path(dir_okay=True, file_okay=True))
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
              help="Cast floating tensors on the way (round-to-nearest-even, as torch does).")
@click.option("--max-shard-size", default=None, metavar="SIZE",
              help="Largest shard when OUTPUT is a folder (default 5GB; e.g. 500MB, 2GiB).")
@click.option("--include", multiple=True, metavar="GLOB",
              help="Export only tensors whose output name matches (repeatable).")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="Leave out tensors whose output name matches (repeatable).")
@click.option("--keep-prefix", is_flag=True,
              help="Name tensors by their full DCP key (the 'model.' level included).")
@model_key_options
@click.option("--hf-assets", metavar="SRC", default=None,
              help="A Hugging Face model folder or Hub repo id (org/name[@rev]; only its asset "
                   "files are downloaded) whose config.json, generation config and tokenizer "
                   "files are written beside the weights (folder OUTPUT). Default: those the "
                   "checkpoint records (ckptool import, train --hf-model).")
@click.option("--force", is_flag=True,
              help="Replace an existing OUTPUT file, or the weight files of a non-empty OUTPUT "
                   "folder (model*.safetensors, index; other files are kept).")
@click.option("--verify", is_flag=True, help="Re-read the output and compare checksums.")
@click.option("--no-crc-check", "no_crc", is_flag=True,
              help="Skip the CRC-32 check of source records (allows in-kernel copies; damaged "
                   "bytes go undetected).")
@click.option("--json", "json_out", is_flag=True, help="Print a JSON summary.")
def consolidate_cmd(checkpoint: str, output: str, dtype: str | None, max_shard_size: str | None,
                    include: tuple[str, ...], exclude: tuple[str, ...], keep_prefix: bool,
                    model_key: str | None, keep_wrappers: bool, hf_assets: str | None,
                    force: bool, verify: bool,
                    no_crc: bool, json_out: bool) -> None:
    """Write the model weights of CHECKPOINT to OUTPUT as safetensors.

    OUTPUT ending in .safetensors is one file; otherwise it is a folder of
    HF-style shards (model-00001-of-0000N.safetensors and
    model.safetensors.index.json). An existing OUTPUT is never replaced
    without --force, and OUTPUT may not lie inside the source checkpoint.
    Names are the model's own state_dict()
    keys: which keys are the model is read from the checkpoint's records
    (DCP's planner_data), whoever saved it (ckptool, a plain dcp.save, the
    AppState recipe, Accelerate, torchtitan); --model-key chooses by hand.
    Bytes are streamed file to file; memory does not grow with the model.

    \b
    Examples:
      ckptool consolidate runs/demo/step_300 model.safetensors
      ckptool consolidate runs/demo/step_300 hf_out/ --dtype bfloat16 --max-shard-size 2GB
    """
    from ckptool.ops.consolidate import consolidate

    limit = parse_size(max_shard_size, option="--max-shard-size") if max_shard_size else None
    with byte_progress("consolidate", progress_enabled(json_out)) as progress:
        result = consolidate(checkpoint, output, dtype=dtype, max_shard_size=limit,
                             include=include, exclude=exclude, keep_prefix=keep_prefix,
                             model_key=model_key, keep_wrappers=keep_wrappers,
                             hf_assets=hf_assets, force=force,
                             verify=verify, check_crc=not no_crc, progress=progress)
    echo_note(result.note)
    if result.tied:
        click.echo(f"lm_head.weight is tied to {result.tied} (tie_word_embeddings): written "
                   "once, as from_pretrained expects", err=True)
    if result.removed:
        click.echo(f"replaced (--force): {', '.join(result.removed)}", err=True)
    if json_out:
        echo_json(result)
        return
    shards = len([f for f in result.files if f.endswith(".safetensors")])
    where = f"{result.destination} ({shards} files)" if shards > 1 else result.destination
    click.echo(f"wrote {where}: {result.tensors} tensors, {human_bytes(result.bytes)} in "
               f"{result.seconds:.1f} s from {result.source}"
               f"{' (verified)' if result.verified else ''}")
