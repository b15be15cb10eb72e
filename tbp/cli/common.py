"""What every command shares: the stderr console, error mapping, number formatting."""
from __future__ import annotations

import sys

import click
from rich.console import Console

from ..errors import TbpError

console = Console(stderr=True, highlight=False)


class Group(click.Group):
    """Maps tbp's expected failures to one line and exit 1, Ctrl-C to exit 130."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (TbpError, ValueError, OSError) as e:
            raise click.ClickException(_one_line(e)) from None
        except KeyboardInterrupt:
            console.print("interrupted")
            sys.exit(130)


def _one_line(e: Exception) -> str:
    if isinstance(e, FileNotFoundError) and e.filename:
        return f"{e.filename}: no such file or directory"
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror or e}"
    return " ".join(str(e).split()) or type(e).__name__


def fmt_count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
