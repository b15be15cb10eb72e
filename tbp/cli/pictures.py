"""`tbp plot` and `tbp attention`: pictures of training and of attention."""
from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np
from rich.table import Table
from rich.text import Text

from ..look import inside, plot
from ..nn import build
from ..runs import disk
from ..errors import TbpError
from .common import console, the_run, load_run
from .generate import source_tokens, start_tokens
from .options import check_strategy, strategy_name, strategy_options


def _run_curves(run: Path) -> dict:
    cfg = disk.read_config(run)
    metrics = disk.read_metrics(run)
    if not metrics:
        raise TbpError(f"{run}: no metrics.jsonl lines to plot yet")
    train, model = cfg.get("train") or {}, cfg.get("model") or {}
    tokens = train.get("batch_size", 0) * train.get("grad_accum", 1) * model.get("n_ctx", 0)
    return {"label": run.name, "metrics": metrics, "tokens_per_step": tokens}


def _picture(ctx, param, value):
    """--out names a picture: its suffix says the format, checked before any work (a usage error)."""
    if value is not None and value.suffix.lower() not in (".png", ".svg"):
        raise click.BadParameter(f"{value}: a picture is a .png or .svg file")
    return value


@click.command("plot")
@click.argument("runs", nargs=-1, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--checkpoint", "more", multiple=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A run, as the other commands take it (repeat it for several); the same as RUNS. None: the "
                   "default run.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, callback=_picture,
              help="The picture: a .png or .svg file.")
@click.option("--layers", is_flag=True, help="Per-layer statistics instead of the curves: each layer's gradient "
                                             "norm and update ratio, and the RMS of what each sublayer reads.")
def plot_runs(runs, more, out, layers):
    """Draw training curves of one or more runs into a picture (needs tbp[plot]).

    Loss against steps (train batches thin, validation thick, the best point starred) and
    against tokens; validation bits per byte, learning rate and gradient norm below. Several
    runs are overlaid, one colour each, to compare seeds or options.

    \b
    Examples:
      tbp plot checkpoints/pydoc --out curves.png
      tbp plot checkpoints/seed1 checkpoints/seed2 checkpoints/rope --out compare.svg
      tbp plot checkpoints/pydoc --layers --out layers.png
    """
    runs = tuple(runs) + tuple(r for r in more if r not in runs) or (the_run(None),)
    if layers:
        if len(runs) > 1:
            raise click.UsageError("--layers draws one run's layers: give one run")
        curves = _run_curves(runs[0])
        plot.save(plot.layers_figure(curves["label"], curves["metrics"]), out)
        console.print(f"wrote {out}")
        return
    fig = plot.training_figure([_run_curves(r) for r in runs])
    plot.save(fig, out)
    console.print(f"wrote {out}")


SHADES = " ░▒▓█"


def _key_ruler(labels: list[str], n_keys: int) -> Text:
    """The keys' labels above the grid, one two-character cell each: a token's first character,
    and every fifth key's position below it, so that a column can be told from its neighbours."""
    first = Text("".join((labels[j][:1] if j < len(labels) else "?").ljust(2) for j in range(n_keys)), style="dim")
    marks = "".join(str(j).ljust(10)[:10] if j % 5 == 0 else "" for j in range(n_keys))
    first.append("\n" + marks[:2 * n_keys].rstrip(), style="dim")
    return first


def _terminal_map(weights: np.ndarray, labels: list[str], title: str) -> Table:
    """One head's (T, T) weights as shaded blocks, a row per query token, on a square-root
    scale so that a weight of 0.1 (a query spread over ten tokens) still shows; the keys'
    labels head the columns."""
    t = Table(title=title, show_header=False, box=None, title_justify="left", pad_edge=False)
    t.add_column(justify="right", style="dim")
    t.add_column()
    t.add_row("key →", _key_ruler(labels, weights.shape[-1]))
    for label, row in zip(labels, weights):
        cells = Text()
        for w in np.sqrt(np.clip(row, 0, 1)):
            cells.append(SHADES[min(4, int(w * 4.999))] * 2, style=f"rgb({int(60 + 195 * w)},{int(60 + 120 * w)},80)")
        t.add_row(label, cells)
    return t


@click.command("attention")
@click.option("--checkpoint", "run", type=click.Path(path_type=Path), default=None,
              help="Run directory. Default: TBP_CHECKPOINT, else the newest text or pairs run under checkpoints/ that did not abort (tbp runs).")
@click.option("--prompt", required=True, help="The text whose attention to show.")
@click.option("--layer", type=click.IntRange(min=0), default=None,
              help="Only this layer (default: every layer; in the terminal, the last one).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, callback=_picture,
              help="Write a picture (.png or .svg, needs tbp[plot]) instead of drawing in the terminal.")
@click.option("--json", "as_json", is_flag=True, help="Print the weights as JSON on stdout.")
@click.option("--best", is_flag=True, help="Use the weights with the best validation loss.")
@strategy_options("show instead", budget=16)
@click.option("--depth", is_flag=True,
              help="Attention Residuals: what each sublayer's input takes from the embedding and each earlier "
                   "output (mean over the prompt's tokens) instead of the heads' maps.")
def attention(run, prompt, layer, out, as_json, best, depth, strategy=None):
    """Show what each attention head looks at, for a prompt, from the model's own forward.

    Row t of a head's map is query token t; its cells are the weights that token gives each
    earlier token (they sum to 1). In the terminal the shades follow the square root of the
    weight, so small weights still show. A prompt longer than the context keeps its last tokens.

    \b
    Examples:
      tbp attention --prompt "def main():"                      # the last layer, in the terminal
      tbp attention --checkpoint checkpoints/pydoc --prompt "The quick brown fox" --out attn.png
      tbp attention --prompt "hello" --layer 0 --json
      tbp attention --prompt "def main():" --depth               # Attention Residuals' depth weights
    """
    if strategy is not None and depth:
        raise click.UsageError(f"--depth shows the weights over depth, --{strategy_name(strategy)} a decoder's "
                               f"choices: give one of them")
    run = the_run(run, ("text", "pairs"))
    model, tok, _ = load_run(run, best=best)
    if strategy is not None:
        check_strategy(model.config, strategy)
    if model.reads_source:
        _show_cross(model, tok, prompt, layer, out, as_json, run)
        return
    ids, _ = start_tokens(tok, prompt)
    ids = ids[-model.config.n_ctx:]
    if depth:
        if not model.residual.ops(model.blocks):
            raise click.UsageError("--depth shows Attention Residuals' weights over depth; this model adds its "
                                   "sublayers into one residual sum (trained without --residual attention)")
        _show_depth(model, ids, out, as_json, run)
        return
    maps = inside.self_attention(model, ids)                      # L x (H, T, T)
    L = len(maps)
    if layer is not None and layer >= L:
        raise click.BadParameter(f"the model has {L} layer{'s' * (L != 1)} (0 .. {L - 1})", param_hint="--layer")
    tokens = [tok.decode([i]) for i in ids]
    if strategy is not None:
        _show_kept(model, ids, tokens, strategy, out, as_json, run)
        return
    chosen = [layer] if layer is not None else (list(range(L)) if out or as_json else [L - 1])
    weights = {i: maps[i] for i in chosen}                            # layer -> (H, T, T)
    if as_json:
        click.echo(json.dumps({"run": str(run), "tokens": tokens, "ids": ids,
                               "layers": {str(i): w.round(6).tolist() for i, w in weights.items()}}))
        return
    if out is not None:
        plot.save(plot.attention_figure(weights, tokens, causal=model.config.causal), out)
        console.print(f"wrote {out} ({len(chosen)} layer(s) × {maps[0].shape[0]} heads, {len(ids)} tokens)")
        return
    labels = [plot.token_label(t) for t in tokens]
    for i, w in weights.items():
        for h in range(w.shape[0]):
            console.print(_terminal_map(w[h], labels, f"layer {i} · head {h}"))


def _show_depth(model, ids, out, as_json, run) -> None:
    # the design that mixes the stream over depth shows it (its declaration's inspect: Attention Residuals)
    d = next(shown["depth"] for v in build.active(model.config) if v.inspect
             for shown in [v.inspect(model, ids)] if "depth" in shown)
    ops, sources, grid, per_op = d["operations"], d["sources"], d["mean"], d["per_token"]
    if as_json:
        click.echo(json.dumps({"run": str(run), "operations": ops, "sources": sources, "mean": grid.round(6).tolist(),
                               "per_token": [w.round(6).tolist() for w in per_op]}))
        return
    if out is not None:
        unread = np.full_like(grid, np.nan)                 # a source an operation does not read: blank
        for r, w in enumerate(per_op):
            unread[r, :len(w)] = grid[r, :len(w)]
        plot.save(plot.attention_figure({0: unread[None]}, ops, title=f"mean depth weights over {len(ids)} tokens",
                                        label="depth weight", keys=sources,
                                        xlabel="source: the embedding, then each block's output",
                                        ylabel="operation: a sublayer's input"), out)
        console.print(f"wrote {out} ({len(ops)} operations × {len(sources)} sources, {len(ids)} tokens)")
        return
    console.print("depth weights: a row per operation (the input of a sublayer, then the final state), "
                  "a column per source: " + ", ".join(sources))
    console.print(_terminal_map(grid, ops, ""))


def _show_cross(model, tok, prompt, layer, out, as_json, run) -> None:
    """An encoder-decoder's cross-attention (look/inside.cross)."""
    ids, _ = source_tokens(tok, prompt, model.config.n_ctx, seq2seq=True)
    c = inside.cross(model, tok, ids)
    maps, source, rows = c["maps"], c["source"], c["target"]
    L = len(maps)
    if layer is not None and layer >= L:
        raise click.BadParameter(f"the model has {L} layer{'s' * (L != 1)} (0 .. {L - 1})", param_hint="--layer")
    chosen = [layer] if layer is not None else (list(range(L)) if out or as_json else [L - 1])
    weights = {i: maps[i] for i in chosen}                                # layer -> (H, T, S)
    if as_json:
        click.echo(json.dumps({"run": str(run), "source": source, "target": rows, "kind": "cross-attention",
                               "layers": {str(i): w.round(6).tolist() for i, w in weights.items()}}))
        return
    if out is not None:
        plot.save(plot.attention_figure(weights, rows, "cross-attention · layer {layer} · head {head}",
                                        keys=source, xlabel="source token (key)",
                                        ylabel="target token predicted (query)"), out)
        console.print(f"wrote {out} ({len(chosen)} layer(s) × {maps[0].shape[0]} heads, "
                      f"{len(rows)} target × {len(source)} source tokens)")
        return
    console.print(f"[dim]source {''.join(source)!r} → target {''.join(rows[:-1])!r}; row: the target token "
                  f"predicted, cells: the source tokens {' '.join(plot.token_label(t) for t in source)}[/]")
    labels = [plot.token_label(t) for t in rows]
    for i, w in weights.items():
        for h in range(w.shape[0]):
            console.print(_terminal_map(w[h], labels, f"cross-attention · layer {i} · head {h}"))


def _show_kept(model, ids, tokens, rule, out, as_json, run) -> None:
    kept = inside.kept_positions(model, ids, rule)
    if as_json:
        click.echo(json.dumps({"run": str(run), "tokens": tokens, "ids": ids, "rule": rule.kind,
                               "budget": rule.budget, "kept": kept.round(6).tolist()}))
        return
    name = f"{rule.kind}, K = {rule.budget}: kept positions"
    if out is not None:
        plot.save(plot.attention_figure({0: kept[None]}, tokens, title=name, label="kept (share of heads)",
                                        causal=True, xlabel="cached position", ylabel="token being decoded"), out)
        console.print(f"wrote {out} ({len(ids)} tokens)")
        return
    console.print(_terminal_map(kept, [plot.token_label(t) for t in tokens], name))
