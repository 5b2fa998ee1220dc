"""Helpers shared by the command modules: JSON output, sizes, progress."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

import click


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(to_jsonable(obj), indent=2, sort_keys=False))


def plural(n: int, word: str) -> str:
    """'1 rank', '2 ranks'."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_size(text: str, *, option: str | None = None) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536870912, '1000' -> 1000.

    ``option`` names the flag in the error (``click.BadParameter``, exit 2)."""
    s = text.strip().upper().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for suffix, mult in units.items():
        if s.endswith(suffix):
            num = s[: -len(suffix)]
            break
    else:
        num, mult = s, 1
    try:
        value = float(num)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size; use e.g. 5GB, 500MB, 2GiB",
                                 param_hint=option) from None
    if value <= 0:
        raise click.BadParameter(f"{text!r}: size must be positive", param_hint=option)
    return int(value * mult)


def model_key_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--model-key`` and ``--keep-wrappers``: which keys are the model, and their names."""
    fn = click.option(
        "--keep-wrappers", is_flag=True,
        help="Keep wrapper segments (_orig_mod., _checkpoint_wrapped_module., "
             "_fsdp_wrapped_module., DDP's module.) in tensor names.")(fn)
    return click.option(
        "--model-key", metavar="PATH", default=None,
        help="The model's sub-tree in the saved state, dotted (e.g. app.model; '' for the "
             "top-level tensors). Default: read from the checkpoint's own records.")(fn)


def echo_note(note: str | None) -> None:
    """A reading the tool chose where another was possible: said on stderr, never silent."""
    if note:
        click.echo(f"note: {note}", err=True)


def progress_enabled(json_out: bool) -> bool:
    return (not json_out) and sys.stderr.isatty()


class byte_progress:  # noqa: N801 - used like a function
    """A tqdm bar of bytes on stderr, exposed as an op's ``progress(done, total)`` callback.

    ``with byte_progress("consolidate", enabled) as progress:`` yields the callback, or None
    when disabled (not a terminal, or ``--json``), so the op skips progress work entirely.
    """

    def __init__(self, desc: str, enabled: bool) -> None:
        self.desc = desc
        self.enabled = enabled
        self.bar: Any = None

    def __enter__(self) -> Callable[[int, int], None] | None:
        return self.update if self.enabled else None

    def update(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                            desc=self.desc, leave=False)
        self.bar.update(done - self.bar.n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
