"""``ckptool upload``: publish weights with a model card to the Hugging Face Hub."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ckptool.cli._common import (byte_progress, echo_json, human_bytes, model_key_options,
                                 parse_size, progress_enabled)

if TYPE_CHECKING:
    from ckptool.ops.upload import UploadResult


@click.command("upload")
@click.argument("path")
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repo private (an existing repo keeps "
                                              "its visibility).")
@click.option("--revision", metavar="BRANCH", default=None,
              help="Commit to this branch (created from main if missing).")
@click.option("--path-in-repo", metavar="DIR", default=None,
              help="Put the files in this folder of the repo (default: the root).")
@click.option("--commit-message", metavar="MSG", default=None,
              help="Default: 'Upload <checkpoint> (step N) with ckptool X'.")
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing to main.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
              help="DCP source only: cast floating tensors while consolidating.")
@click.option("--max-shard-size", metavar="SIZE", default=None,
              help="DCP source only: largest shard (default 5GB), e.g. 500MB, 2GiB.")
@model_key_options
@click.option("--token", metavar="TOKEN", default=None,
              help="Hub token (default: HF_TOKEN, or the one saved by 'hf auth login').")
@click.option("--dry-run", is_flag=True, help="Check and list what would be sent; send nothing.")
@click.option("--json", "json_out", is_flag=True, help="Print a JSON summary.")
def upload_cmd(path: str, repo_id: str, private: bool, revision: str | None,
               path_in_repo: str | None, commit_message: str | None, create_pr: bool,
               dtype: str | None, max_shard_size: str | None, model_key: str | None,
               keep_wrappers: bool, token: str | None, dry_run: bool, json_out: bool) -> None:
    """Upload PATH to the Hugging Face Hub model repo REPO_ID with a model card.

    PATH is a .safetensors file, a folder of shards with its
    model.safetensors.index.json, or a DCP checkpoint (consolidated to a
    temporary folder first). The files are checked before anything is sent;
    a README.md model card (step, loss, world size, dtype, training config,
    usage) and, for ckptool's built-in model, a config.json go with them.
    Re-running after an interruption resumes: files the Hub already has are
    not sent again. HF_ENDPOINT selects another Hub.

    \b
    Examples:
      ckptool upload runs/demo alice/tiny-gpt --dtype bfloat16
      ckptool upload hf_out/ alice/tiny-gpt --revision step-300 --dry-run
    """
    from huggingface_hub.utils import disable_progress_bars
    from huggingface_hub.utils import logging as hf_logging

    from ckptool.ops.upload import upload

    hf_logging.disable_propagation()  # it has its own handler; ours would print each line twice
    show = progress_enabled(json_out)
    if not show:
        disable_progress_bars()
    limit = parse_size(max_shard_size, option="--max-shard-size") if max_shard_size is not None else None
    with byte_progress("upload", show) as progress:
        result = upload(path, repo_id, private=private, revision=revision,
                        path_in_repo=path_in_repo, commit_message=commit_message,
                        create_pr=create_pr, dtype=dtype, max_shard_size=limit,
                        model_key=model_key, keep_wrappers=keep_wrappers, token=token,
                        dry_run=dry_run, progress=progress)
    if json_out:
        echo_json(result)
        return
    _render(result)


def _render(r: UploadResult) -> None:
    if r.dry_run:
        click.echo(f"dry run: would upload {len(r.files)} files ({human_bytes(r.bytes)}) to "
                   f"{r.repo_id}{f' (branch {r.revision})' if r.revision else ''}; nothing sent")
        for f in r.files:
            click.echo(f"  {f.path_in_repo:<48} {human_bytes(f.size):>10}")
        return
    who = f" as {r.user}" if r.user else ""
    click.echo(f"uploaded {len(r.files)} files ({human_bytes(r.bytes)}, {r.tensors} tensors) "
               f"from {r.source} to {r.repo_id}{who} in {r.seconds:.1f} s: "
               f"{r.pr_url or r.commit_url}")
