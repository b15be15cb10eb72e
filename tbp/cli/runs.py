"""`tbp runs`: the runs under checkpoints/, how each ended, which one commands use, and removing one."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.table import Table

from ..runs import listing
from ..errors import TbpError
from .common import console, fmt_bytes, fmt_loss


@click.group(invoke_without_command=True)
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=listing.ROOT, show_default=True,
              help="The folder of runs.")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON on stdout.")
@click.pass_context
def runs(ctx, root, as_json):
    """List the runs under checkpoints/: kind, how each ended, steps, losses, size (--json: shape too).

    Status: training (a process is writing it), finished, early stop, max time, interrupted
    (Ctrl-C or SIGTERM, saved; --json gives the whole reason), aborted (ended without a word: killed or crashed), imported or
    merged. The run marked * is the one eval, serve and info use when given no --checkpoint: the
    one TBP_CHECKPOINT names, else the newest that did not abort; generate, attention and view take
    the newest such text or pairs run, chat the newest chat run, merge the newest LoRA run.

    \b
    Examples:
      tbp runs
      tbp runs rm checkpoints/old-run
      TBP_CHECKPOINT=checkpoints/pydoc tbp generate
    """
    if ctx.invoked_subcommand is not None:
        return
    found = listing.runs(root)
    if not found:
        raise TbpError(f"no runs under {root}/ (train one with tbp train)")
    rows = [listing.describe(r) for r in found]
    try:
        default = str(listing.default_run(None, root)[0])
    except TbpError:
        default = None
    for r in rows:
        r["default"] = r["run"] == default
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    t = Table(title=f"runs under {root}/, newest first (* the default where no --checkpoint is given)",
              title_justify="left")
    for col, right in (("", False), ("run", False), ("kind", False), ("status", False), ("steps", True),
                       ("best val", True), ("last val", True), ("size", True)):
        t.add_column(col, justify="right" if right else "left", no_wrap=col in ("status", "steps", "best val"))
    for r in rows:
        steps = "-" if r["step"] is None else f"{r['step']:,}" + (f" / {r['max_iters']:,}" if r["max_iters"] else "")
        best = "-" if r["best_val_loss"] is None else f"{fmt_loss(r['best_val_loss'])} @ {r['best_step']:,}"
        last = "-" if r["last_val_loss"] is None else fmt_loss(r["last_val_loss"])
        status = r["why"].split(":")[0] if r["status"] == "stopped" and r["why"] else r["status"]
        t.add_row("*" if r["default"] else "", r["run"], r["kind"], status, steps, best, last, fmt_bytes(r["bytes"]))
    console.print(t)


@runs.command("rm")
@click.argument("names", nargs=-1, required=True)
@click.option("--yes", "-y", is_flag=True, help="Do not ask (needed when stdin is not a terminal).")
@click.pass_context
def rm(ctx, names, yes):
    """Remove runs tbp wrote: NAME is a run's folder, or its name under --root.

    A folder holding anything tbp did not write, or one a training is writing, is refused
    (nothing removed).
    """
    root = ctx.parent.params["root"]
    targets = [root / n if (root / n).is_dir() and "/" not in n else Path(n) for n in names]
    for t in targets:                   # every one checked before any is removed
        if not t.is_dir():
            raise TbpError(f"{t}: no such run; nothing removed")
        listing.check_removable(t)
    if not yes:
        if not sys.stdin.isatty():
            raise click.UsageError("removing runs asks first: pass --yes where there is no terminal to ask in")
        listed = ", ".join(str(t) for t in targets)
        if not click.confirm(f"remove {listed}?", default=False, err=True):
            raise TbpError("nothing removed")
    for t in targets:
        freed = listing.remove(t)
        console.print(f"removed {t} ({fmt_bytes(freed)})")
