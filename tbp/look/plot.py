"""Pictures of training and of attention, drawn with matplotlib (the optional extra ``tbp[plot]``).

Numbers in, a ``matplotlib.figure.Figure`` out: nothing here reads a run or prints. The figures
are built with the object API on the Agg canvas (no pyplot, no display, no global state), so
they work headless and in tests. matplotlib is imported when a figure is made, so tbp starts
without it.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..errors import TbpError

INSTALL = "pictures need matplotlib: pip install 'tbp[plot]' (or: pip install matplotlib)"


def _require_matplotlib() -> None:
    """The line saying how to get matplotlib, before a function imports pieces of it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise TbpError(INSTALL) from None


def figure(width: float, height: float):
    """An empty Figure on the Agg canvas (no pyplot), or the line saying how to get matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise TbpError(INSTALL) from None
    return Figure(figsize=(width, height), layout="constrained")


def save(fig, path) -> None:
    """Write a figure as PNG or SVG (by the file's suffix), atomically: drawn in memory, then
    renamed into place, so a full disk keeps the old picture and a symlink at ``path`` is
    replaced, never written through."""
    import io
    from ..files.atomic import atomic_write_bytes
    suffix = str(path).rsplit(".", 1)[-1].lower()
    if suffix not in ("png", "svg"):
        raise TbpError(f"{path}: the picture must be a .png or .svg file")
    if Path(path).is_dir():
        raise TbpError(f"{path}: is a folder; give a picture's file name")
    buf = io.BytesIO()
    fig.savefig(buf, format=suffix, dpi=120)
    atomic_write_bytes(path, buf.getvalue())


# --- training curves ----------------------------------------------------------------------------
def layers_figure(label: str, metrics: list[dict]):
    """A run's per-layer statistics (layerstats.py) over training: each layer's gradient norm
    and update ratio against the step, and the RMS of what each sublayer reads at each eval."""
    evals = [m for m in metrics if "layers" in m]
    if not evals:
        raise TbpError(f"{label}: no per-layer statistics in its metrics (runs record them at each "
                       f"evaluation since this release)")
    fig = figure(15, 4.6)
    axes = fig.subplots(1, 3)
    steps = [m["step"] for m in evals]
    for ax, key, title in zip(axes, ("grad_norm", "update_ratio"), ("gradient norm", "update / weight")):
        groups = list(evals[-1]["layers"].get(key, {}))
        colours = [f"C{i % 10}" for i in range(len(groups))]
        for g, c in zip(groups, colours):
            ax.plot(steps, [m["layers"][key].get(g, np.nan) for m in evals], color=c, lw=1,
                    ls="-" if ".ln" not in g and g != "ln_f" else ":", label=g)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(f"{label}: {title} per layer", fontsize=10)
    axes[0].legend(fontsize=6, ncol=2)
    ax = axes[2]
    for i, m in enumerate(evals):
        rms = m["layers"].get("stream_rms")
        if rms:
            ax.plot(range(len(rms)), rms, marker="o", ms=2, lw=1, color=(0.2, 0.3 + 0.6 * i / max(1, len(evals) - 1), 0.8),
                    label=f"step {m['step']}" if i in (0, len(evals) - 1) else None)
    ax.set_yscale("log")
    ax.set_xlabel("sublayer (2 per block; last: the state for ln_f)")
    ax.set_title("RMS of what each sublayer reads", fontsize=10)
    ax.legend(fontsize=7)
    return fig



def training_figure(runs: list[dict]):
    """Loss against steps and against tokens, bits per byte, learning rate and gradient norm.

    runs: [{"label": str, "metrics": [metrics.jsonl lines], "tokens_per_step": int}, ...], one
    colour each, overlaid. The best validation point of each run is marked. Steps are on a log
    scale when a run is long enough for the first hundred steps to matter (more than 1,000; not
    for bits per byte, whose evaluations start late).
    """
    fig = figure(11, 7.5)
    grid = fig.add_gridspec(2, 3, height_ratios=[2.2, 1])
    by_step, by_tokens = fig.add_subplot(grid[0, :2]), fig.add_subplot(grid[0, 2])
    bpb, lr, gnorm = (fig.add_subplot(grid[1, i]) for i in range(3))
    longest = max((m["step"] for r in runs for m in r["metrics"]), default=1)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, color in zip(runs, colors):
        ms = run["metrics"]
        steps = np.array([m["step"] for m in ms])
        train = np.array([m.get("train_loss", np.nan) for m in ms], dtype=float)
        evals = [m for m in ms if "val_loss" in m]
        ev_steps = np.array([m["step"] for m in evals])
        val = np.array([m["val_loss"] for m in evals])
        tokens = run.get("tokens_per_step") or 0
        by_step.plot(steps, train, color=color, alpha=0.35, lw=1)
        name = f"{run['label']} (val)"
        if len(val):                 # the best value in the legend: labels beside stars collide in an overlay
            best = int(np.argmin(val))
            by_step.plot(ev_steps[best], val[best], marker="*", ms=14, color=color, mec="black", zorder=5)
            name = f"{run['label']} (val; best {val[best]:.4g} at step {ev_steps[best]:,})"
        by_step.plot(ev_steps, val, color=color, lw=2, marker="o", ms=3, label=name)
        final = [m for m in evals if "val_split_loss" in m]
        if final:                    # the run's final figure: the whole split, not the fixed batches
            by_step.plot(final[-1]["step"], final[-1]["val_split_loss"], marker="D", ms=7, color=color, mec="black",
                         ls="none", label=f"{run['label']} (the whole split: {final[-1]['val_split_loss']:.4g})")
        if tokens:
            by_tokens.plot(steps * tokens, train, color=color, alpha=0.35, lw=1)
            by_tokens.plot(ev_steps * tokens, val, color=color, lw=2, marker="o", ms=3)
        bpb.plot(ev_steps, [m.get("val_bpb", np.nan) for m in evals], color=color, marker="o", ms=3)
        lr.plot(steps, [m.get("lr", np.nan) for m in ms], color=color)
        gnorm.plot(steps, [m.get("grad_norm", np.nan) for m in ms], color=color, alpha=0.8, lw=1)
    by_step.set(title="loss (thin: train batches; thick: validation batches; star: best; diamond: whole split)",
                xlabel="step",
                ylabel="cross-entropy (nats per token)")
    by_tokens.set(title="against tokens seen", xlabel="tokens")
    bpb.set(title="validation bits per byte", xlabel="step")
    lr.set(title="learning rate", xlabel="step")
    gnorm.set(title="gradient norm (before clipping)", xlabel="step")
    gnorm.set_yscale("log")
    _require_matplotlib()
    from matplotlib.ticker import EngFormatter, FuncFormatter, LogLocator, NullFormatter
    by_tokens.xaxis.set_major_formatter(EngFormatter(sep=""))          # 150k, not 150000
    # decades as plain numbers (0.001, 0.01, 1, 10), and no crowded labels between them
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    norms = [m["grad_norm"] for r in runs for m in r["metrics"] if m.get("grad_norm", 0) > 0]
    narrow = bool(norms) and max(norms) / min(norms) < 30        # within about a decade: label 2, 3, 5 too
    gnorm.yaxis.set_major_locator(LogLocator(base=10))
    gnorm.yaxis.set_major_formatter(plain)
    gnorm.yaxis.set_minor_locator(LogLocator(base=10, subs=(2, 3, 5) if narrow else ()))
    gnorm.yaxis.set_minor_formatter(plain if narrow else NullFormatter())
    for ax in (by_step, lr, gnorm):
        if longest > 1000:
            ax.set_xscale("log")
    for ax in (by_step, by_tokens, bpb, lr, gnorm):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    return fig


# --- attention ----------------------------------------------------------------------------------
def token_label(text: str, width: int = 8) -> str:
    """A token's text made visible as a tick label: escapes for newlines and tabs, cut short."""
    shown = text.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "·")
    return shown if len(shown) <= width else shown[:width - 1] + "…"


def attention_figure(weights: dict, tokens: list[str], title: str = "layer {layer} · head {head}",
                     label: str = "attention weight", keys: list[str] | None = None, causal: bool = False,
                     xlabel: str = "key: the token attended to", ylabel: str = "query: the token attending"):
    """One heat map per head (columns) and layer (rows): row t is query token t, column j the
    weight it gives key token j. weights: {layer: (H, Tq, Tk) array}; tokens: Tq strings, and
    ``keys`` the Tk key tokens where they differ (cross-attention's source). ``causal``: the
    future (j > t), which no query may read, is left blank rather than painted as a weight of 0,
    and so is every NaN (a source an operation does not read). ``title`` is formatted with the
    layer and head; ``label`` names the colour scale, which is the terminal's: the square root
    of the weight, so that 0.1 (a query spread over ten tokens) still shows."""
    _require_matplotlib()
    from matplotlib import colormaps
    from matplotlib.colors import PowerNorm
    layers = sorted(weights)
    H, T, Tk = weights[layers[0]].shape
    cell = min(0.3, 5.0 / max(T, Tk, 1))
    side, width = max(1.8, T * cell), max(1.8, Tk * cell)
    # several layers: a row of H heads each; one layer: its heads in a near-square grid, so that
    # the picture stays readable at the width of a page or a screen
    cols = H if len(layers) > 1 else math.ceil(math.sqrt(H))
    rows = len(layers) if len(layers) > 1 else math.ceil(H / cols)
    fig = figure(min(1.2 + cols * width, 40), min(0.8 + rows * (side + 0.5), 60))
    grid = np.atleast_2d(fig.subplots(rows, cols, squeeze=False))
    for ax in grid.flat[len(layers) * H:]:
        ax.set_visible(False)
    axes = grid.reshape(-1)[:len(layers) * H].reshape(len(layers), H)
    labels = [token_label(t) for t in tokens]
    key_labels = labels if keys is None else [token_label(t) for t in keys]
    step = max(1, math.ceil(max(T, Tk) / 40))        # at most ~40 tick labels per axis
    cmap = colormaps["viridis"].with_extremes(bad="white")
    norm = PowerNorm(0.5, vmin=0, vmax=1)
    hidden = np.triu(np.ones((T, Tk), bool), k=1 + Tk - T) if causal else np.zeros((T, Tk), bool)
    for row, layer in zip(axes, layers):
        for h, ax in enumerate(row):
            shown = np.ma.masked_array(weights[layer][h], mask=hidden | ~np.isfinite(weights[layer][h]))
            image = ax.imshow(shown, norm=norm, cmap=cmap, interpolation="nearest")
            ax.set_title(title.format(layer=layer, head=h), fontsize=9)
            ax.set_xticks(range(0, Tk, step), key_labels[::step], rotation=90, fontsize=7, family="monospace")
            ax.set_yticks(range(0, T, step), labels[::step], fontsize=7, family="monospace")
    for ax in grid[-1]:
        ax.set_xlabel(xlabel, fontsize=8)
    for ax in grid[:, 0]:
        ax.set_ylabel(ylabel, fontsize=8)
    fig.colorbar(image, ax=grid, shrink=0.6, label=f"{label} (square-root scale, as in the terminal)")
    return fig
