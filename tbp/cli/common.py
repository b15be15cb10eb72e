"""What every command shares: the stderr console, error mapping, number formatting."""
from __future__ import annotations

import signal
import sys
import traceback

import click
from pathlib import Path
from rich.console import Console
from rich.table import Table

from ..train import distributed
from ..errors import ConfigError, TbpError

console = Console(stderr=True, highlight=False)

def the_run(run, kinds: tuple[str, ...] | None = None, lora: bool = False):
    """The run a command reads: ``run`` as given, or the default (listing.default_run: the run
    TBP_CHECKPOINT names, else the newest usable run of ``kinds``), named on stderr either way,
    first, so that no output comes from a run the user did not mean."""
    from ..runs import listing               # the console is needed before the engine is loaded
    if run is None:
        run, why = listing.default_run(kinds, lora=lora)
        console.print(f"[dim]run: {run} ({why}; pass --checkpoint or set {listing.ENV} to choose)[/]")
    else:
        console.print(f"[dim]run: {run}[/]")
    return run


def one_run(positional, option, kinds: tuple[str, ...] | None = None, lora: bool = False):
    """The run of a command that takes it as RUN or as --checkpoint (the same; both only if
    equal), or neither: the default (:func:`the_run`)."""
    if positional is not None and option is not None and Path(positional) != Path(option):
        raise click.UsageError(f"give the run once: RUN {positional} or --checkpoint {option}")
    return the_run(positional or option, kinds, lora)


def load_run(run, best: bool = False, **kw):
    """disk.load_model: (model, tokenizer, config dict) of ``run``; with ``best``, a line on
    stderr naming the step whose weights these are, and its validation loss."""
    from ..runs import disk
    loaded = disk.load_model(run, best=best, **kw)
    if best:
        state = disk.read_state(Path(run)) if (Path(run) / "state.json").is_file() else {}
        if state.get("best_step") is not None:
            console.print(f"[dim]best-validation weights: step {state['best_step']:,}, val loss "
                          f"{fmt_loss(state['best_val_loss'])} (of {state.get('step', 0):,} steps)[/]")
    return loaded


BUG = "this is a bug in tbp, not a problem with your input: please report it with the traceback above"


class Terminated(KeyboardInterrupt):
    """SIGTERM (how schedulers stop a job), raised where the process is, so that every
    ``finally`` and temporary-file cleanup runs as for Ctrl-C."""


def _terminate(signum, frame):
    raise Terminated


class Group(click.Group):
    """Turns tbp's expected failures into one line: bad data, files or environment exit 1, a bad
    option value exits 2 (usage), Ctrl-C 130. Anything else is a bug: its traceback is shown,
    with a line saying so, and the exit code is 1."""

    def invoke(self, ctx):
        previous = signal.signal(signal.SIGTERM, _terminate)
        try:
            result = super().invoke(ctx)
            distributed.current().finish()          # every rank got here: the job ends cleanly
            return result
        except ConfigError as e:
            _end_ranks(e, 2, _one_line(e))
            raise click.UsageError(_one_line(e)) from None
        except (TbpError, OSError) as e:
            _end_ranks(e, 1, _one_line(e))
            raise click.ClickException(_one_line(e)) from None
        except Terminated as e:
            _end_ranks(e, 143, "terminated")
            console.print("terminated")
            sys.exit(143)
        except KeyboardInterrupt as e:
            _end_ranks(e, 130, "interrupted")
            console.print("interrupted")
            sys.exit(130)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise                                   # click's own: usage errors, --help, aborts
        except Exception as e:
            traceback.print_exc()
            _end_ranks(e, 1, BUG)
            console.print(f"[bold red]error:[/] {BUG}")
            sys.exit(1)
        finally:
            signal.signal(signal.SIGTERM, previous)


def _end_ranks(e: BaseException, code: int, message: str) -> None:
    """In an MPI job of several ranks (distributed.py): an error every rank raised alike ends each
    on its own, rank 0 alone saying why; any other ends the whole job now, so that no rank waits
    forever for one that has gone. Alone, nothing to do."""
    world = distributed.current()
    if world.size == 1:
        return
    if world.is_root or not getattr(e, "everywhere", False):
        console.print(("" if world.is_root else f"rank {world.rank}: ") + f"[bold red]Error:[/] {message}")
    if getattr(e, "everywhere", False):
        world.leave()
        sys.exit(code)
    world.abort(code)


def _one_line(e: Exception) -> str:
    if isinstance(e, FileNotFoundError) and e.filename:
        return f"{e.filename}: no such file or directory"
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror or e}"
    return " ".join(str(e).split()) or type(e).__name__


def kv_table(title: str, value_justify: str = "left") -> Table:
    """The two-column summary every command prints: a bold name, then its value."""
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify=value_justify)
    return t


def fmt_loss(x: float) -> str:
    """A loss in nats: four decimals, or three significant digits below 0.01, so that a run
    that has converged shows how far (8.31e-05, not 0.0000)."""
    return f"{x:.4f}" if not 0 < abs(x) < 0.01 else f"{x:.3g}" if abs(x) >= 1e-4 else f"{x:.2e}"


def split_figure(m: dict) -> str:
    """A run's final loss over its validation split (a metrics line's val_split_*), in words."""
    where = "the whole validation split" if m.get("val_split_every", 1) == 1 else \
        f"one window in {m['val_split_every']} of the validation split"
    return f"{fmt_loss(m['val_split_loss'])} ({m['val_split_bpb']:.3f} bits/byte) over {where}, " \
           f"{m['val_split_tokens']:,} tokens"


def fmt_count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def fmt_duration(seconds: float) -> str:
    """12 s, 3 min 10 s, 2 h 05 min."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
