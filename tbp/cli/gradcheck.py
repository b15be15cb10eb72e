"""`tbp gradcheck`: the table proving every handwritten gradient."""
from __future__ import annotations

import json
import time

import click
from rich.markup import escape
from rich import box
from rich.table import Table

from .. import gradcheck as gc
from .common import console
from .options import FiniteFloat


@click.command()
@click.option("--layer", type=click.Choice(gc.LAYERS), default=None,
              help="Check only this layer's cases (default: every layer and the whole model).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed for the random instances, probes and directions.")
@click.option("--eps", type=FiniteFloat(min=0, min_open=True, max=1e-2), default=gc.DEFAULT_EPS,
              show_default=True, help="Finite-difference step.")
@click.option("--rtol", type=FiniteFloat(min=0, min_open=True), default=gc.DEFAULT_RTOL,
              show_default=True, help="Largest relative error that passes.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON on stdout.")
def gradcheck(layer, seed, eps, rtol, as_json):
    """Check every handwritten gradient against centred finite differences, in float64.

    Small random instances (batch 2, 5 tokens, 2 heads) of every layer under every option,
    then the whole model: each parameter's and the input's gradient is compared on sampled
    entries and along one random direction. Exits 1 if any tensor fails.

    \b
    Example:
      tbp gradcheck --layer attention --seed 3
    """
    t0 = time.perf_counter()
    rows = gc.run(seed=seed, eps=eps, rtol=rtol, layer=layer)
    elapsed = time.perf_counter() - t0
    failed = [r for r in rows if not r.passed]
    if as_json:
        click.echo(json.dumps({"eps": eps, "rtol": rtol, "seed": seed, "passed": not failed,
                               "rows": [r.to_dict() for r in rows]}, indent=1))
    else:
        table = Table(title=f"gradcheck: float64, centred differences, eps {eps:g}, rtol {rtol:g}",
                      caption="probed: entries checked one by one; every tensor also along one random "
                              "direction.\nzero: exactly 0 by design: the key bias (softmax shift invariance, "
                              "paper §3.2) and a padded position read as a key (masked).",
                      caption_justify="left", box=box.SIMPLE_HEAD)
        for col, width in (("tensor", 20), ("shape", 7), ("probed", 6), ("abs err", 7), ("rel err", 7),
                           ("verdict", 7)):
            table.add_column(col, justify="right" if col in ("probed", "abs err", "rel err") else "left",
                             no_wrap=True, min_width=width)
        last = None
        for r in rows:
            if r.layer != last:
                table.add_row(f"[bold]{escape(r.layer)}[/]")
                last = r.layer
            verdict = "[green]ok[/]" if r.passed else "[bold red]FAIL[/]"
            if r.note.startswith("zero"):
                verdict = "[green]zero ok[/]" if r.passed else "[bold red]FAIL[/] (not zero)"
            elif r.note:
                verdict += f" [dim]({r.note})[/]"
            table.add_row("  " + escape(r.tensor), "×".join(map(str, r.shape)), str(r.checked),
                          f"{r.max_abs:.1e}", f"{r.max_rel:.1e}", verdict)
        console.print(table)
    worst = max((r.max_rel for r in rows if not r.note.startswith("zero")), default=0.0)
    console.print(f"{len(rows) - len(failed)}/{len(rows)} tensors pass, worst relative error "
                  f"{worst:.1e} (rtol {rtol:g}), {elapsed:.1f}s")
    if failed:
        raise SystemExit(1)
