"""`tbp view`: an interactive page of a run, one self-contained HTML file."""
from __future__ import annotations

from pathlib import Path

import click

from ..runs import disk
from ..errors import TbpError
from ..files.atomic import atomic_write_text
from .common import console, the_run, load_run
from .generate import source_tokens, start_tokens
from .options import check_strategy, strategy_options


def _runs(main: Path, more: tuple) -> list[dict]:
    """Each run's metrics: the main run may have none (an imported or merged model: the page then
    shows the prompt alone); a --compare run is there for its curves, so it must have some."""
    runs = []
    for run in (main, *more):
        metrics = disk.read_metrics(run)
        if not metrics and run != main:
            raise TbpError(f"{run}: no metrics.jsonl lines to compare: the run has not logged a step")
        runs.append({"label": Path(run).name, "metrics": metrics})
    if not runs[0]["metrics"]:
        console.print(f"[dim]{main}: no training metrics (imported, merged or not yet logged): the page shows "
                      f"the prompt only[/]")
    return runs


def _claim(out: Path, force: bool) -> None:
    """Refuse a folder, an existing file without --force, and with --force a file tbp view did
    not write (--force never deletes what tbp did not write)."""
    from ..look.view import MARKER
    if out.is_dir():
        raise TbpError(f"{out}: is a folder; --out names the HTML file to write")
    if not out.exists():
        return
    if not out.is_file():                  # a FIFO, a device: opening it to look would block or consume
        raise TbpError(f"{out}: is not a regular file; --out names the HTML file to write")
    if not force:
        raise TbpError(f"{out} already exists (use --force to replace it)")
    with open(out, "rb") as f:
        head = f.read(4096)
    if MARKER.encode() not in head:
        raise TbpError(f"{out}: is not a page tbp view wrote; refusing to replace it, even with --force")


@click.command("view")
@click.option("--checkpoint", "run", type=click.Path(path_type=Path), default=None,
              help="Run directory. Default: TBP_CHECKPOINT, else the newest text or pairs run under checkpoints/ that did not abort (tbp runs).")
@click.option("--prompt", required=True, help="The text whose attention the page shows (at most the context).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The HTML file to write.")
@click.option("--compare", "more", multiple=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Another run whose training curves to overlay (repeat for several).")
@click.option("--best", is_flag=True, help="Use the weights with the best validation loss.")
@click.option("--force", is_flag=True, help="Replace an existing page that tbp view wrote.")
@click.option("--plotly", "plotly_mode", type=click.Choice(["inline", "beside"]), default="inline", show_default=True,
              help="inline: the chart library inside the page, one self-contained file (most of its ~5 MiB); "
                   "beside: the library written once next to the page as plotly-<version>.min.js, which pages in "
                   "the same folder share, and each page a few hundred KiB. Both open offline.")
@strategy_options("show", budget=16)
def view(run, prompt, out, more, best, force, plotly_mode, strategy=None):
    """Write one HTML page of a run that any browser opens: no server, no network.

    Training and validation curves (of --compare runs too), each layer's gradient norm, update
    ratio and input RMS over training, and for the prompt: attention per layer and head, where
    hovering a token shades what it reads and what reads it; Attention Residuals' depth
    weights, an encoder-decoder's cross-attention, a sparse decoder's kept positions and
    Multi-Token Attention's kernels where the model has them. The numbers are those of
    `tbp attention --json`. Needs the view extra (pip install 'tbp[view]').

    \b
    Examples:
      tbp view --prompt "def main():" --out run.html
      tbp view --checkpoint checkpoints/attnres --compare checkpoints/pydoc --prompt "x = 1" --out attnres.html
      tbp view --prompt "The cat sat on the mat" --sparse lessismore --budget 8 --out sparse.html
    """
    _claim(out, force)
    run = the_run(run, ("text", "pairs"))
    model, tok, _ = load_run(run, best=best)        # first: it names what is not a run
    runs = _runs(run, more)
    if strategy is not None:
        check_strategy(model.config, strategy)
    if model.reads_source:
        ids, _ = source_tokens(tok, prompt, model.config.n_ctx, seq2seq=True)
    else:
        ids, _ = start_tokens(tok, prompt)
        if len(ids) > model.config.n_ctx:
            raise click.BadParameter(f"the prompt is {len(ids):,} tokens; this model's context is "
                                     f"{model.config.n_ctx:,}", param_hint="--prompt")
    from ..look.view import page
    src = _library_beside(out) if plotly_mode == "beside" else None
    text = page(runs, model, tok, ids, strategy, title=f"tbp view · {Path(run).name}", plotly_src=src)
    atomic_write_text(out, text)
    console.print(f"wrote {out} ({len(text) / 2 ** 20:.1f} MiB, {len(ids)} prompt tokens)")


def _library_beside(out: Path) -> str:
    """Plotly's bundle written next to ``out`` unless that file is already there and the same;
    a file of that name with other contents is not tbp's to replace. Returns its name."""
    from ..look.view import plotly_file
    name, js = plotly_file()
    lib = out.parent / name
    if lib.exists():
        if not lib.is_file() or lib.read_text(encoding="utf-8", errors="replace") != js:
            raise TbpError(f"{lib}: exists and is not this Plotly's bundle; move it, or use --plotly inline")
        return name
    atomic_write_text(lib, js)
    console.print(f"wrote {lib} (the chart library, shared by pages in {out.parent or '.'})")
    return name
