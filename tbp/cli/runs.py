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
    cells = []
    for r in rows:
        steps = "-" if r["step"] is None else f"{r['step']:,}" + (f" / {r['max_iters']:,}" if r["max_iters"] else "")
        best = "-" if r["best_val_loss"] is None else f"{fmt_loss(r['best_val_loss'])} @ {r['best_step']:,}"
        last = "-" if r["last_val_loss"] is None else fmt_loss(r["last_val_loss"])
        status = r["why"].split(":")[0] if r["status"] == "stopped" and r["why"] else r["status"]
        cells.append({"": "*" if r["default"] else "", "run": r["run"], "kind": r["kind"], "status": status,
                      "steps": steps, "best val": best, "last val": last, "size": fmt_bytes(r["bytes"])})
    columns = _fitting(["", "run", "kind", "status", "steps", "best val", "last val", "size"], cells, console.width)
    if columns is None:            # narrower than a name: one line a run, which the terminal may wrap but not cut
        click.echo(f"runs under {root}/, newest first (* the default)")
        for c in cells:
            click.echo(f"{c[''] or ' '} {c['run']}  {c['status']}  {c['best val']}")
        return
    t = Table(title=f"runs under {root}/, newest first (* the default where no --checkpoint is given)",
              title_justify="left")
    for col in columns:
        t.add_column(col, justify="right" if col in ("steps", "best val", "last val", "size") else "left",
                     no_wrap=True)
    for c in cells:
        t.add_row(*(c[col] for col in columns))
    hidden = [col for col in DROPPED_FIRST if col not in columns]
    if hidden:
        t.caption = f"too narrow for {', '.join(hidden)}: a wider terminal shows them, tbp runs --json has all"
    console.print(t)


# the columns a narrow terminal loses first: the run's name, the one a user copies, is never cut
DROPPED_FIRST = ("size", "last val", "kind", "steps", "status", "best val")


def _fitting(columns: list[str], cells: list[dict], width: int) -> list[str] | None:
    """``columns`` less the fewest of DROPPED_FIRST, in that order, for every cell to show whole
    in ``width`` characters (each column its widest cell, one space either side, a rule between);
    None where not even the names fit."""
    def needed(cols):
        return 1 + sum(3 + max(len(col), *(len(c[col]) for c in cells)) for col in cols)
    for n in range(len(DROPPED_FIRST) + 1):
        kept = [c for c in columns if c not in DROPPED_FIRST[:n]]
        if needed(kept) <= width:
            return kept
    return None


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
