"""The ``ckptool`` command line: one click group, one module per command, one error boundary.

Each command module parses options, calls one library function, and renders its result as
text or ``--json``. Commands are imported lazily so ``ckptool --help`` never imports torch.
Exit codes: 0 success, 1 a ``CkptError`` (one line, ``CKPTOOL_DEBUG=1`` for the traceback),
2 a usage error.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

import click

from ckptool._version import __version__
from ckptool.errors import CkptError

# name -> "module:function"; modules live beside this file.
COMMANDS = {
    "train": "ckptool.cli.train:train",
    "inspect": "ckptool.cli.inspect:inspect_cmd",
    "ls": "ckptool.cli.ls:ls_cmd",
    "validate": "ckptool.cli.validate:validate_cmd",
    "consolidate": "ckptool.cli.consolidate:consolidate_cmd",
    "reshard": "ckptool.cli.reshard:reshard_cmd",
    "import": "ckptool.cli.import_cmd:import_cmd",
    "upload": "ckptool.cli.upload:upload_cmd",
    "estimate": "ckptool.cli.estimate:estimate_cmd",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if self._load(name) is not None]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return self._load(name)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:  # command not built yet
                return None
            raise
        return getattr(module, attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="ckptool")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """Checkpoints for FSDP2 training with PyTorch Distributed Checkpoint (DCP).

    \b
    Typical session:
      ckptool train --out runs/demo            # short FSDP2 demo run, saves step_N/
      ckptool ls runs/demo                     # what is there, which is good
      ckptool validate runs/demo/step_300      # prove a checkpoint is complete
      ckptool consolidate runs/demo/step_300 model.safetensors

    Set CKPTOOL_DEBUG=1 to see tracebacks.
    """
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point with the error boundary."""
    try:
        cli.main(args=argv, prog_name="ckptool", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except CkptError as e:
        report_error(e)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
    sys.exit(0)


def report_error(e: BaseException) -> None:
    if os.environ.get("CKPTOOL_DEBUG"):
        import traceback

        traceback.print_exception(e)
    msg = " ".join(str(e).split())  # always one line
    click.echo(f"error: {msg}", err=True)
