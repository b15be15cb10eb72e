"""`tbp view`: one self-contained HTML page of a run -- its training, its layers, and what it
computes for a prompt -- that any browser opens with no server and no network.

The charts are Plotly's (the ``view`` extra): its JavaScript is inlined when the page is
written, never fetched. The numbers come from the run's metrics.jsonl and from
:mod:`tbp.look.inside`, the same source as `tbp attention --json`, rounded the same way (6
decimals). The page's own script (view.js, beside this module) only wires the controls: the
layer and head selectors, and the token strip, where hovering a token shades what it reads
(blue) and what reads it (orange).
"""
from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np

from . import inside
from ..nn import build
from ..errors import TbpError

MARKER = '<meta name="generator" content="tbp view">'       # a page tbp wrote (and may replace)
ROUND = 6


def _plotly():
    try:
        import plotly
        import plotly.graph_objects as go
    except ImportError:
        raise TbpError("tbp view needs Plotly: pip install 'tbp[view]'") from None
    return plotly, go


def _text(s: str) -> str:
    """A name from the data (a run label, a layer name, a token) as Plotly text: Plotly renders
    a subset of HTML in titles, legends, ticks and hover labels, so ``<``, ``>`` and ``&`` are
    written as entities, which it shows as the characters themselves."""
    return html.escape(str(s), quote=False)


def _script_json(obj) -> str:
    """``obj`` as JSON to inline in a <script>: ``<``, ``>`` and ``&`` as \\u escapes, so that no
    string in the data can close the script, open a comment or start markup."""
    return json.dumps(obj).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _r(a) -> list:
    """Rounded in the array's own dtype, as tbp attention --json does: the same numbers."""
    return np.asarray(a).round(ROUND).tolist()


def curves_figure(go, runs: list[dict]) -> dict:
    """Training and validation loss against steps, one colour per run."""
    fig = go.Figure()
    for i, run in enumerate(runs):
        ms = run["metrics"]
        colour = f"hsl({(i * 67) % 360}, 65%, 45%)"
        fig.add_scatter(x=[m["step"] for m in ms], y=[m["train_loss"] for m in ms], mode="lines",
                        name=f"{_text(run['label'])}: train", line={"color": colour, "width": 1}, opacity=0.6)
        ev = [m for m in ms if "val_loss" in m]
        fig.add_scatter(x=[m["step"] for m in ev], y=[m["val_loss"] for m in ev], mode="lines+markers",
                        name=f"{_text(run['label'])}: validation", line={"color": colour, "width": 3})
    fig.update_layout(xaxis_title="step", yaxis_title="loss (nats per token)", height=420,
                      margin={"t": 30}, legend={"orientation": "h"})
    return fig


def layers_figures(go, metrics: list[dict]) -> dict[str, object]:
    """Per-layer statistics over training (layerstats.py): heat maps of each group's gradient
    norm and update ratio (log10) against the evaluation step, and the RMS of what each
    sublayer reads, one line per evaluation."""
    evals = [m for m in metrics if "layers" in m]
    if not evals:
        return {}
    steps = [m["step"] for m in evals]
    out = {}
    for key, title in (("grad_norm", "log10 gradient norm"), ("update_ratio", "log10 update / weight")):
        groups = list(evals[-1]["layers"].get(key, {}))
        if not groups:
            continue
        z = [[np.log10(max(m["layers"][key].get(g, 0.0), 1e-30)) for m in evals] for g in groups]
        fig = go.Figure(go.Heatmap(z=_r(z), x=steps, y=list(range(len(groups))), colorscale="Viridis",
                                   colorbar={"title": "log10"}, customdata=[[_text(g)] * len(steps) for g in groups],
                                   hovertemplate="%{customdata} at step %{x}: %{z}<extra></extra>"))
        fig.update_layout(title=title, xaxis_title="step", height=max(320, ROW_PX * len(groups) + 120),
                          margin={"t": 40}, yaxis=_row_axis(groups))
        out[key] = fig
    if any("stream_rms" in m["layers"] for m in evals):
        fig = go.Figure()
        for m in evals:
            rms = m["layers"].get("stream_rms")
            if rms:
                fig.add_scatter(x=list(range(len(rms))), y=_r(rms), mode="lines+markers", name=f"step {m['step']}")
        fig.update_layout(title="RMS of what each sublayer reads (last: the state for ln_f)",
                          xaxis_title="sublayer (2 per block)", yaxis_title="RMS", yaxis_type="log", height=380,
                          margin={"t": 40})
        out["stream_rms"] = fig
    return out


def _tick(token: str) -> str:
    """A token as an axis label, its whitespace made visible (a space would leave a row unnamed)."""
    return _text(token.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥") or "∅")


ROW_PX = 20                 # a heat map's row: room for its label, so that every row is named


def _row_axis(labels: list[str], title: str | None = None) -> dict:
    """A heat map's rows as positions 0 .. n-1 with every one labelled: given as categories,
    Plotly drops labels that would crowd (every other one on a tall map); given as explicit
    ticks, with a row tall enough for its text, each row keeps its name."""
    axis = {"tickvals": list(range(len(labels))), "ticktext": [_tick(t) for t in labels],
            "autorange": "reversed", "tickfont": {"size": 11}}
    return {**axis, "title": title} if title else axis


def heatmap(go, z, x, y, title: str, xlabel: str, ylabel: str, colorscale=None):
    scale = {"colorscale": "Blues", "reversescale": True} if colorscale is None else {"colorscale": colorscale}
    fig = go.Figure(go.Heatmap(z=z, x=list(range(len(x))), y=list(range(len(y))), **scale,
                               customdata=[[_text(f"{y[r]!r} → {x[c]!r}") for c in range(len(x))]
                                           for r in range(len(y))],
                               hovertemplate="%{customdata}: %{z}<extra></extra>"))
    fig.update_layout(title=title, xaxis={"title": xlabel, "tickvals": list(range(len(x))),
                                          "ticktext": [_tick(t) for t in x], "tickfont": {"size": 11}},
                      yaxis=_row_axis(y, ylabel), height=max(360, ROW_PX * len(y) + 160), margin={"t": 40})
    return fig


def chart_figure(go, chart):
    """A design's chart (variant.Chart): one labelled heat map, or one map per head behind a menu."""
    maps = chart.maps
    if len(maps) == 1 and chart.x is not None:
        return heatmap(go, maps[0], chart.x, chart.y, _text(chart.title), chart.xlabel, chart.ylabel,
                       "RdBu" if chart.signed else None)
    scale = {"colorscale": "RdBu", "zmid": 0} if chart.signed else {"colorscale": "Blues", "reversescale": True}
    fig = go.Figure()
    for h, z in enumerate(maps):
        fig.add_trace(go.Heatmap(z=z, **scale, visible=h == 0, name=f"head {h}"))
    menu = [{"label": f"head {h}", "method": "update", "args": [{"visible": [j == h for j in range(len(maps))]}]}
            for h in range(len(maps))]
    fig.update_layout(title=_text(chart.title), xaxis_title=chart.xlabel, yaxis_title=chart.ylabel, height=300,
                      margin={"t": 60}, updatemenus=[{"buttons": menu, "x": 1, "y": 1.25}] if len(maps) > 1 else [])
    return fig


# a dropped position (0) salmon, a kept one (a share of heads, up to 1) pale to dark blue; a
# future position has no value (None) and shows the grey of the plot behind it
KEPT_COLOURS = [[0.0, "#f4a582"], [1e-6, "#deebf7"], [1.0, "#08519c"]]


def kept_map(kept: list[list[float]]) -> list[list[float | None]]:
    """tbp.look.inside's kept map (row t: 1 kept, 0 not) with the positions after t (not yet
    written when token t is decoded) as None, so that dropped and future never share a colour."""
    return [[v if c <= r else None for c, v in enumerate(row)] for r, row in enumerate(kept)]


def data_for_prompt(model, tok, ids: list[int], rule=None) -> dict:
    """Everything the page shows of the prompt, as lists (the numbers of tbp attention --json)."""
    d: dict = {}
    if model.reads_source:
        c = inside.cross(model, tok, ids)
        d["cross"] = {"source": c["source"], "target": c["target"], "maps": [_r(m) for m in c["maps"]]}
        return d
    d["tokens"] = [tok.decode([i]) for i in ids]
    d["ids"] = list(map(int, ids))
    d["attention"] = [_r(m) for m in inside.self_attention(model, ids)]
    if rule is not None:
        d["kept"] = {"rule": rule.kind, "budget": rule.budget, "map": _r(inside.kept_positions(model, ids, rule))}
    for variant in build.active(model.config):      # what each design shows of itself (its inspect)
        for section, shown in (variant.inspect(model, ids) if variant.inspect else {}).items():
            if shown:
                d[section] = _plain(shown)
    return d


def _plain(obj):
    """A design's inspection as JSON: keys as strings, arrays as rounded lists, names as they are."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list) and all(isinstance(v, str) for v in obj):
        return obj
    if isinstance(obj, list):                         # arrays of their own shapes (a depth map's rows)
        return [_plain(v) for v in obj]
    return _r(obj)


NOTES = {   # one line under each chart: what to look for in it
    "curves": "What to look for: both curves falling is learning; validation flattening or rising while "
              "training still falls is the model memorising its training text (overfitting). The gap between "
              "them at the end is what more data or dropout would close.",
    "grad_norm": "What to look for: a row orders of magnitude darker than the others learns little (its "
                 "gradient vanishes on the way back); a bright column across every row is a loss spike.",
    "update_ratio": "What to look for: how far each step moves a group relative to its size. Around -3 (a "
                    "thousandth per step) is a common rule of thumb for a healthy pace; rows far above it move "
                    "too fast to be stable, rows far below barely train.",
    "stream_rms": "What to look for: the residual stream grows with depth, since each sublayer adds to it; "
                  "growth that steepens over training means late layers drown what earlier ones wrote.",
    "overview": "Every layer's heads at once, the same maps in small: click one to open it above. Look for "
                "heads that repeat across layers and the few with a sharp pattern (a line, a column).",
    "kept": "Blue: kept (darker where more heads keep it); salmon: cached but dropped; grey: not yet "
            "written when that row is decoded. Look for the positions every row keeps (often the first tokens "
            "and the latest): what the rule finds indispensable.",
}


def run_table(model, metrics: list[dict]) -> list[list[str]]:
    """(what, value) rows of the run's configuration: the model's shape, every setting that is
    not its default, its size, and where training stopped."""
    cfg = model.config
    rows = [["parameters", f"{sum(int(p.size) for p in model.params.values()):,}"]]
    defaults = type(cfg).defaults()
    for name, value in cfg.flat().items():
        if name in ("n_layer", "n_head", "d_model", "n_ctx", "vocab_size") or value != defaults.get(name):
            rows.append([name, str(value)])
    evals = [m for m in metrics if "val_loss" in m]
    if metrics:
        rows.append(["steps", f"{metrics[-1]['step']:,}"])
    if evals:
        best = min(evals, key=lambda m: m["val_loss"])
        rows.append(["validation loss", f"{evals[-1]['val_loss']:.4f} last, {best['val_loss']:.4f} best "
                                        f"(step {best['step']:,})"])
    return [[_text(a), _text(b)] for a, b in rows]


def plotly_file() -> tuple[str, str]:
    """(file name, text) of the Plotly bundle for pages that load it from beside themselves."""
    plotly, _ = _plotly()
    return f"plotly-{plotly.__version__}.min.js", plotly.offline.get_plotlyjs()


def page(runs: list[dict], model, tok, ids: list[int], rule=None, title: str = "tbp view",
         plotly_src: str | None = None) -> str:
    """The whole HTML document: Plotly inlined (one self-contained file), or with ``plotly_src``
    read from that file beside the page (:func:`plotly_file`), which pages in one folder share."""
    plotly, go = _plotly()
    figs = {"curves": curves_figure(go, runs), **layers_figures(go, runs[0]["metrics"])}
    data = data_for_prompt(model, tok, ids, rule)
    if "kept" in data:
        k = data["kept"]
        figs["kept"] = heatmap(go, kept_map(k["map"]), data["tokens"], data["tokens"],
                               f"{k['rule']}, K = {k['budget']}: the positions each decoding step keeps",
                               "cached position", "token being decoded", colorscale=KEPT_COLOURS)
        figs["kept"].update_layout(plot_bgcolor="#e8e8e8")
    sections = []                                   # what each design draws of itself (its declaration's draw)
    for variant in build.active(model.config):
        for section in variant.draw(data) if variant.draw else ():
            for chart in section.charts:
                figs[chart.key] = chart_figure(go, chart)
            sections.append({"title": section.title, "caption": section.caption, "look_for": section.look_for,
                             "charts": [chart.key for chart in section.charts]})
    cfg = model.config
    about = {"runs": [r["label"] for r in runs],
             "model": f"{cfg.n_layer} layer{'s' * (cfg.n_layer > 1)} × {cfg.d_model}, {cfg.n_head} heads",
             "prompt_tokens": len(ids), "config": run_table(model, runs[0]["metrics"])}
    return TEMPLATE.format(
        marker=MARKER, title=html.escape(title),
        plotly=(f"<script>{plotly.offline.get_plotlyjs()}</script>" if plotly_src is None
                else f'<script src="{html.escape(plotly_src)}"></script>'),
        about=html.escape(json.dumps(about)),
        data=_script_json({"about": about, "prompt": data, "notes": NOTES, "sections": sections,
                           "figures": {k: json.loads(f.to_json()) for k, f in figs.items()}}),
        script=(Path(__file__).with_name("view.js")).read_text(encoding="utf-8"))


TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">{marker}
<title>{title}</title>
<style>
body {{ font: 15px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1180px; padding: 0 18px 60px; color: #222; }}
h1 {{ font-size: 1.5em; }} h2 {{ font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }}
.note {{ color: #555; }} select {{ font: inherit; margin-right: 1em; }}
#tokens {{ font-family: ui-monospace, monospace; line-height: 2.1; padding: 8px; border: 1px solid #ddd; }}
#tokens span {{ display: inline-block; padding: 2px 1px; border-radius: 3px; white-space: pre; cursor: pointer; }}
#tokens span.focus {{ outline: 2px solid #222; }}
#config td {{ padding: 1px 12px 1px 0; font-size: 13px; }} #config td:first-child {{ color: #555; }}
#overview {{ display: grid; gap: 10px; }}
#overview figure {{ margin: 0; cursor: pointer; text-align: center; font-size: 12px; color: #555; }}
#overview canvas {{ width: 100%; image-rendering: pixelated; border: 1px solid #ccc; }}
#overview figure.current canvas {{ outline: 2px solid #222; }}
</style></head>
<body>
<h1>{title}</h1>
<p class="note" id="about"></p>
<details id="run"><summary>The run's configuration</summary><table id="config"></table></details>
<section id="training"><h2>Training</h2><div id="fig-curves"></div>
<div id="fig-grad_norm"></div><div id="fig-update_ratio"></div><div id="fig-stream_rms"></div></section>
<section id="attention"><h2>Attention</h2>
<p class="note">Hover a token: <span style="background:rgba(31,119,180,.6)">blue</span> is what it reads
(its row of the head's map), <span style="background:rgba(255,127,14,.6)">orange</span> what reads it (its
column). Shades follow the square root of the weight, so small weights still show.</p>
<p class="note">What to look for: heads that look one token back (a bright line just under the
diagonal of the map), heads that hold on to the first token (a bright first column: a place to put
weight that is not needed), and heads whose row for a token lights up an earlier copy of the token
that followed it (the matching that in-context copying needs). In self-attention a token reads only
itself and earlier tokens, so the map's upper right is empty by construction; cross-attention reads
the whole source.</p>
<label>layer <select id="layer"></select></label><label>head <select id="head"></select></label>
<div id="tokens"></div><p class="note" id="reading"></p><div id="fig-map"></div>
<h2>All layers and heads</h2><p class="note" id="note-overview"></p><div id="overview"></div></section>
<section id="more"></section>
{plotly}
<script type="application/json" id="tbp-data">{data}</script>
<script>{script}</script>
</body></html>
"""
