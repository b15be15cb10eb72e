"""`tbp gradcheck`: the table proving every handwritten gradient."""
from __future__ import annotations

import json
import time

import click
from rich.markup import escape

from ..check import gradcheck as gc
from .common import console
from .options import FiniteFloat


def _layer(ctx, param, value):
    """--layer: one of gc.LAYERS (a former spelling is read as its new one)."""
    if value is None:
        return None
    value = gc.FORMER_NAMES.get(value, value)
    if value not in gc.LAYERS:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(gc.LAYERS)}", param=param)
    return value


@click.command()
@click.option("--layer", callback=_layer, default=None, metavar="NAME",
              help="Check only this layer's cases: " + ", ".join(gc.LAYERS) + " (default: every layer and "
                   "the whole model).")
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
        for line in report_lines(rows, eps, rtol):
            console.print(line, soft_wrap=True)
    worst = max((r.max_rel for r in rows if not r.note.startswith("zero")), default=0.0)
    console.print(f"{len(rows) - len(failed)}/{len(rows)} tensors pass, worst relative error "
                  f"{worst:.1e} (rtol {rtol:g}), {elapsed:.1f}s")
    if failed:
        raise SystemExit(1)


WIDTH = 80             # the table fits an 80-column terminal, and a log
COLUMNS = (("tensor", 30, "<"), ("shape", 9, "<"), ("probed", 6, ">"), ("abs err", 7, ">"), ("rel err", 7, ">"),
           ("verdict", 0, "<"))


def _fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` in the middle, keeping both ends (h.11.att…c_attn.bias[q])."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def report_lines(rows, eps: float, rtol: float) -> list[str]:
    """The table as lines of at most WIDTH characters (rich markup for colour only): a heading
    line per case, then a line per tensor; a name too long for its column is cut with "…"."""
    def line(cells) -> str:
        return " ".join(f"{_fit(c, w):{a}{w}}" if w else c for c, (_, w, a) in zip(cells, COLUMNS))
    out = [f"[bold]gradcheck: float64, centred differences, eps {eps:g}, rtol {rtol:g}[/]",
           line([name for name, _, _ in COLUMNS]), "─" * WIDTH]
    last = None
    for r in rows:
        if r.layer != last:
            out.append(f"[bold]{escape(_fit(r.layer, WIDTH))}[/]")
            last = r.layer
        if r.note.startswith("zero"):
            verdict = "[green]zero ok[/]" if r.passed else "[bold red]FAIL[/] (not zero)"
        else:
            verdict = ("[green]ok[/]" if r.passed else "[bold red]FAIL[/]") + (f" [dim]({escape(r.note)})[/]"
                                                                                  if r.note else "")
        cells = ["  " + r.tensor, "×".join(map(str, r.shape)), str(r.checked), f"{r.max_abs:.1e}", f"{r.max_rel:.1e}"]
        out.append(escape(line(cells + [""])) + verdict)
    out += ["", "probed: entries checked one by one; each tensor also along a random direction.",
            "zero: exactly 0 by design: the key bias (softmax shift invariance, paper §3.2)",
            "and a padded position read as a key (masked)."]
    return out
