"""`tbp info`: what a checkpoint or a dataset holds."""
from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path

import click
from rich.table import Table

from ..runs import disk
from ..nn.config import ModelConfig
from ..files.atomic import from_recorded
from ..files.locks import RunLock, is_held
from ..errors import TbpError
from ..train.layerstats import groups
from ..nn import build
from .common import console, fmt_bytes, fmt_loss, kv_table, split_figure, the_run
from .prepare import summary

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 48) -> str:
    if not values:
        return ""
    if len(values) > width:                      # average into `width` buckets
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [sum(values[a:b]) / max(1, b - a) for a, b in zip(edges, edges[1:])]
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(7, int((v - lo) / span * 7.999))] for v in values)


def param_groups(params: dict) -> "OrderedDict[str, int]":
    """Parameter counts per layer: wte, wpe, h.0.ln_1, h.0.attn, ..., ln_f, lm_head (an
    encoder-decoder's encoder first, under enc.): the groups of layerstats."""
    return OrderedDict((g, sum(int(math.prod(params[n])) for n in names)) for g, names in groups(params).items())


def _list_runs(root: Path, runs: list[Path], as_json: bool) -> None:
    """A folder of runs (checkpoints/): one line each."""
    rows = []
    for run in runs:
        try:
            cfg = disk.read_config(run)
            state = disk.read_state(run)
        except TbpError:
            continue
        m = cfg.get("model") or {}
        rows.append({"run": str(run), "kind": "lora" if cfg.get("lora") else "model",
                     "shape": f"{m.get('n_layer')}L × {m.get('d_model')}, ctx {m.get('n_ctx')}",
                     "step": state.get("step"), "best_val_loss": state.get("best_val_loss")})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    t = Table(title=f"runs under {root}", title_justify="left")
    for col in ("run", "kind", "shape", "step", "best val"):
        t.add_column(col, justify="right" if col in ("step", "best val") else "left")
    for r in rows:
        best = fmt_loss(r['best_val_loss']) if r["best_val_loss"] is not None else "-"
        t.add_row(r["run"], r["kind"], r["shape"], str(r["step"] if r["step"] is not None else "-"), best)
    console.print(t)


def run_info(run: Path) -> dict:
    cfg = disk.read_config(run)
    lora = cfg.get("lora")
    header = disk.read_header(disk.weights_path(run))
    shapes = {k: list(shape) for k, (shape, _) in header.items()}
    state = disk.read_state(run)
    metrics = disk.read_metrics(run)
    # the lock file stays between trainings (it is how a writer is found): it is the run's
    # state, "being written", only while a live process holds it
    files = {p.name: p.stat().st_size for p in sorted(run.iterdir()) if p.is_file() and p.name != RunLock.NAME}
    return {"writing": is_held(run), "kind": "lora" if lora else "model", "path": str(run), "model": cfg.get("model"),
            "train": cfg.get("train"), "lora": lora, "base": cfg.get("base"), "data": cfg.get("data"),
            "dtype": next(iter(header.values()))[1] if header else None,
            "parameters": sum(int(math.prod(s)) for s in shapes.values()),
            "layers": param_groups(shapes), "state": state, "metrics": metrics, "files": files}


@click.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path), required=False)
@click.option("--checkpoint", "run", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The run (or dataset, or folder of runs) to show, as the other commands take it; the same as PATH.")
@click.option("--json", "as_json", is_flag=True, help="Print everything as one JSON object on stdout.")
def info(path, run, as_json):
    """Show what a checkpoint (or a prepared dataset) holds.

    For a run: the model's configuration, parameters per layer, the training state and the
    loss curve. For a dataset folder: its tokenizer, token counts and source. For a folder
    of runs (checkpoints/): one line per run.

    \b
    Examples:
      tbp info                      # the default run (see tbp runs)
      tbp info checkpoints/pydoc --json
      tbp info data/pydoc
      tbp info checkpoints
    """
    if path is not None and run is not None and path != run:
        raise click.UsageError(f"give the run once: PATH {path} or --checkpoint {run}")
    path = path or run or the_run(None)
    runs = sorted(p.parent for p in path.glob("*/config.json")) if not (path / "config.json").is_file() else []
    if runs:
        _list_runs(path, runs, as_json)
        return
    if (path / "meta.json").is_file() and not (path / "config.json").is_file():
        from ..data.datasets import Dataset
        meta = Dataset.load(path).meta        # what training would refuse, info refuses alike
        if as_json:
            click.echo(json.dumps(meta, indent=2))
            return
        summary({**meta, "path": str(path)})
        return
    if not (path / "config.json").is_file():
        raise TbpError(f"{path}: neither a run (config.json) nor a dataset (meta.json)")
    d = run_info(path)
    if as_json:
        click.echo(json.dumps(d, indent=2))
        return
    m = d["model"]
    shape = ("n_layer", "n_head", "d_model", "n_ctx", "vocab_size")
    t = kv_table(f"{d['path']} ({'LoRA adapter run' if d['lora'] else 'model'})")
    cfg = disk.read_model_config(Path(d["path"]))
    layers = f"{m['n_layer']} layer{'s' * (m['n_layer'] != 1)}"
    if cfg.arch != ModelConfig.defaults()["arch"]:            # its own row (its declaration) says the rest
        layers = f"{cfg.arch}: {layers}"
    t.add_row("model", f"{layers} · {m['n_head']} heads · d_model {m['d_model']} · "
                       f"context {m['n_ctx']} · vocabulary {m['vocab_size']}")
    t.add_row("attention", f"{cfg.attention} · {cfg.attn_kernel} kernel{' (auto)' * (cfg.attn_impl == 'auto')} · "
                           f"{cfg.positions} positions")
    for variant in build.active(cfg):                  # each variant's own row (nn/variant.py)
        if variant.describe is not None:
            t.add_row(*variant.describe(cfg))
    defaults = ModelConfig.defaults()
    # the shape and the axes have rows above; a design's options, its own row
    shown = set(shape) | {"d_qk", "arch", "attention", "attn_impl", "positions", "residual"}
    shown |= {f.name for v in build.VARIANTS if v.options is not None for f in v.options.flags()}
    changed = [f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in cfg.flat().items()
               if k not in shown and v != defaults.get(k)]
    if cfg.d_qk != cfg.d_v:
        changed.insert(0, f"d_qk {cfg.d_qk}")
    t.add_row("options", " · ".join(changed) or "GPT-2's (every other option at its default)")
    trained = f" · trained with {d['train'].get('precision', 'fp32')} products" if d["train"] else ""
    t.add_row("weights", f"{d['parameters']:,} parameters ({d['dtype']}){trained}")
    if d["lora"]:
        t.add_row("LoRA", f"rank {d['lora']['rank']} · alpha {d['lora']['alpha']:g} · "
                          f"{', '.join(d['lora']['targets'])}")
        t.add_row("base", f"{from_recorded(Path(d['path']), d['base']['path']).resolve()} (SHA-256 {d['base']['sha256'][:12]}…)")
    st = d["state"]
    if st:
        tr = d["train"] or {}
        total = tr.get("max_iters")
        of = f" of {total:,}" if isinstance(total, int) else ""
        t.add_row("trained", f"step {st.get('step', 0):,}{of} · {st.get('tokens_seen', 0):,} tokens · "
                             f"{st.get('elapsed_s', 0):.0f}s")
        if st.get("best_val_loss") is not None:
            t.add_row("best (estimate)", f"{fmt_loss(st['best_val_loss'])} at step {st['best_step']:,}")
    evals = [x for x in d["metrics"] if "val_loss" in x]
    if evals:
        last = evals[-1]
        if "val_split_loss" in last:
            t.add_row("final val loss", split_figure(last))
        t.add_row("last eval", f"step {last['step']}: train {fmt_loss(last['eval_train_loss'])} · "
                               f"val {fmt_loss(last['val_loss'])} ({last['val_bpb']:.3f} bits/byte), the fixed "
                               f"batches' estimate")
    losses = [x["train_loss"] for x in d["metrics"]]
    if losses:
        t.add_row("train loss", f"{sparkline(losses)}  {losses[0]:.2f} → {losses[-1]:.2f}")
    t.add_row("data", str(d["data"]))
    t.add_row("files", " · ".join(f"{k} {fmt_bytes(v)}" for k, v in d["files"].items()))
    if d["writing"]:
        t.add_row("now", "a training is writing this run (its lock is held): these figures are of its last save")
    console.print(t)
    stats = next((x for x in reversed(evals) if "layers" in x), None)      # the last eval's per-layer figures
    title = "parameters per layer" + (f"; gradient and update at step {stats['step']:,}" if stats else "")
    layers = Table(title=title, title_justify="left")
    layers.add_column("layer")
    layers.add_column("parameters", justify="right")
    layers.add_column("share", justify="right")
    if stats:
        layers.add_column("grad norm", justify="right")
        layers.add_column("update / weight", justify="right")
    for name, n in d["layers"].items():
        row = [name, f"{n:,}", f"{100 * n / max(1, d['parameters']):.1f}%"]
        if stats:
            g, u = stats["layers"].get("grad_norm", {}).get(name), stats["layers"].get("update_ratio", {}).get(name)
            row += [f"{g:.3g}" if g is not None else "", f"{u:.2e}" if u is not None else ""]
        layers.add_row(*row)
    console.print(layers)
    if stats and stats["layers"].get("stream_rms"):
        rms = stats["layers"]["stream_rms"]
        console.print(f"what each sublayer reads, RMS at step {stats['step']:,}: {sparkline(rms)}  "
                      f"{rms[0]:.3g} → {rms[-1]:.3g} ({len(rms)} inputs, the last ln_f's; "
                      f"{stats['layers'].get('stats_ms', 0):.1f} ms to measure)")
    if len(evals) > 1:
        curve = Table(title="evaluations", title_justify="left")
        for col in ("step", "lr", "train", "val", "val bits/byte"):
            curve.add_column(col, justify="right")
        stride = max(1, len(evals) // 12)
        for x in evals[::stride] + ([evals[-1]] if (len(evals) - 1) % stride else []):
            curve.add_row(str(x["step"]), f"{x['lr']:.2e}", fmt_loss(x['eval_train_loss']), fmt_loss(x['val_loss']),
                          f"{x['val_bpb']:.3f}")
        console.print(curve)
