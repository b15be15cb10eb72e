"""Attention Residuals against the residual sum: validation loss, step time, what depth is read.

Three variants of the same GPT, trained with the same recipe, data and seeds:

- sum: the standard pre-LN residual stream;
- full: Attention Residuals, every sublayer's input a learned softmax over the embedding and
  every earlier sublayer's output (``--residual attention``);
- block: the same over 4 blocks of summed sublayers (``--residual-blocks 4``).

Two recipes: ``default`` is `tbp train`'s own (4 layers x 128, context 128, 1,500 steps on the
built-in corpus); ``deep`` the same with a deep, narrow model (12 layers x 64, 4 heads).
Validation loss is `tbp eval` over the whole held-out split. Runs already finished are kept
and a run stopped part-way is resumed, so the script can be stopped and started again. Run
one training at a time (each uses every core: two at once oversubscribe BLAS).

    python benchmarks/attention_residuals.py train          # both recipes, 3 seeds, one run at a time
    python benchmarks/attention_residuals.py timing        # quiet machine: step times, interleaved
    python benchmarks/attention_residuals.py report        # tables and docs/images/attention_residuals.png
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

from runner import tbp

RECIPES = {"default": [], "deep": ["--n-layer", "12", "--d-model", "64", "--n-head", "4"]}
VARIANTS = {"sum": [], "full": ["--residual", "attention"],
            "block": ["--residual", "attention", "--residual-blocks", "4"]}


def run_dir(work: Path, recipe: str, variant: str, seed: int) -> Path:
    return work / f"{recipe}-{variant}-s{seed}"


def finished(run: Path) -> bool:
    try:
        state = json.loads((run / "state.json").read_text())
        cfg = json.loads((run / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return state.get("step") == cfg["train"]["max_iters"]


def train(args) -> None:
    work = Path(args.work)
    data = work / "data"
    if not (data / "meta.json").exists():
        tbp("prepare", "--out", data)
    results = work / "results.jsonl"
    # seeds outermost: a partial sweep has every recipe and variant at the seeds it reached
    for seed in args.seeds:
        for recipe in args.recipes:
            for variant in args.variants:
                run = run_dir(work, recipe, variant, seed)
                if finished(run):
                    continue
                extra = ["--max-iters", args.max_iters] if args.max_iters else []
                if (run / "state.json").exists():       # stopped part-way: continue it (tbp resumes exactly)
                    tbp("train", "--out", run, "--resume", "--threads", args.threads, *extra, "-q")
                else:
                    tbp("train", "--data", data, "--out", run, "--force", "--seed", seed, "--threads", args.threads,
                        *RECIPES[recipe], *VARIANTS[variant], *extra, "-q")
                ev = json.loads(tbp("eval", "--checkpoint", run, "--json"))
                state = json.loads((run / "state.json").read_text())
                row = {"recipe": recipe, "variant": variant, "seed": seed, "val_loss": ev["val_loss"],
                       "train_s": state["elapsed_s"], "threads": args.threads}
                with results.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


def timing(args) -> None:
    """`tbp bench` training step of each variant, rounds interleaved; medians."""
    rows = {}
    for recipe in args.recipes:
        times = {v: [] for v in VARIANTS}
        gen = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for variant, flags in VARIANTS.items():
                d = json.loads(tbp("bench", *RECIPES[recipe], *flags, "--vocab-size", "103", "--iters", "5",
                                   "--gen-tokens", "128", "--json"))
                times[variant].append(d["train_ms_per_iter"])
                gen[variant].append(d["generate_tokens_per_s"])
        rows[recipe] = {v: {"train_ms": statistics.median(times[v]), "generate_tok_s": statistics.median(gen[v])}
                        for v in VARIANTS}
        rows[recipe]["machine"] = d.get("machine")
        print(recipe, json.dumps(rows[recipe]), flush=True)
    (Path(args.work) / "timing.json").write_text(json.dumps(rows, indent=1))


def sublayer_outputs(model, idx):
    """Each sublayer's output (N, C) in order, and each Attention Residuals operation's mean
    depth weights (K,), for the tokens idx (B, T)."""
    outs = []
    model.forward(idx, outputs=outs)
    return outs, [op.weights().mean(axis=1) for op in model.residual.ops(model.blocks)]


def report(args) -> None:
    import numpy as np
    import tbp as tbp_lib
    from tbp.data import Dataset
    work = Path(args.work)
    rows = [json.loads(line) for line in (work / "results.jsonl").read_text().splitlines() if line.strip()]
    timing_rows = json.loads((work / "timing.json").read_text()) if (work / "timing.json").exists() else {}
    print("| recipe | residual | val loss, mean ± std | per seed | Δ vs sum, same seed | train time (s) "
          "| step (ms) | generation (tokens/s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for recipe in RECIPES:
        base = {r["seed"]: r["val_loss"] for r in rows if r["recipe"] == recipe and r["variant"] == "sum"}
        for variant in VARIANTS:
            got = {r["seed"]: r for r in rows if r["recipe"] == recipe and r["variant"] == variant}
            if not got:
                continue
            seeds = sorted(got)
            losses = [got[s]["val_loss"] for s in seeds]
            std = statistics.stdev(losses) if len(losses) > 1 else float("nan")
            deltas = [got[s]["val_loss"] - base[s] for s in seeds if s in base]
            delta = "" if variant == "sum" or not deltas else \
                f"{statistics.mean(deltas):+.4f} ± {statistics.stdev(deltas) if len(deltas) > 1 else float('nan'):.4f}"
            t = timing_rows.get(recipe, {}).get(variant, {})
            print(f"| {recipe} | {variant} | {statistics.mean(losses):.4f} ± {std:.4f} | "
                  f"{', '.join(f'{x:.4f}' for x in losses)} | {delta} | "
                  f"{statistics.mean(got[s]['train_s'] for s in seeds):.0f} | {t.get('train_ms', float('nan')):.0f} | "
                  f"{t.get('generate_tok_s', float('nan')):.0f} |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    val = Dataset.load(work / "data").val
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(val) - 129, 32)
    idx = np.stack([np.asarray(val[s:s + 128], dtype=np.int64) for s in starts])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), gridspec_kw={"width_ratios": [1, 1, 1.2]})
    for ax, recipe in zip(axes[:2], RECIPES):
        model = tbp_lib.load(run_dir(work, recipe, "full", args.seeds[0]))
        _, weights = sublayer_outputs(model, idx)
        S = len(weights) + 1                       # sources: the embedding and every sublayer
        grid = np.full((len(weights), S), np.nan)
        for r, w in enumerate(weights):
            grid[r, :len(w)] = w
        im = ax.imshow(grid, cmap="viridis", vmin=0, aspect="auto")
        names = ["emb"] + [f"{'a' if i % 2 == 0 else 'm'}{i // 2}" for i in range(S - 1)]
        ax.set_xticks(range(S), names, rotation=90, fontsize=6 if S > 12 else 8)
        ax.set_yticks(range(len(weights)), names[2:] + ["final"], fontsize=6 if S > 12 else 8)
        ax.set_xlabel("source (a: attention output, m: MLP output)")
        ax.set_ylabel("operation: the input of")
        L = model.config.n_layer
        ax.set_title(f"{recipe} ({L} x {model.config.d_model}): mean depth weights, full AttnRes")
        fig.colorbar(im, ax=ax, fraction=0.046)
    ax = axes[2]
    for recipe, style in zip(RECIPES, ("-", "--")):
        for variant, colour, marker in zip(VARIANTS, ("black", "tab:blue", "tab:orange"), "os^"):
            model = tbp_lib.load(run_dir(work, recipe, variant, args.seeds[0]))
            outs, _ = sublayer_outputs(model, idx)
            rms = [float(np.sqrt(np.mean(v.astype(np.float64) ** 2))) for v in outs]
            ax.plot(np.linspace(0, 1, len(rms)), rms, style, color=colour, marker=marker, markersize=3,
                    label=f"{recipe}, {variant}")
    ax.set_yscale("log")
    ax.set_xlabel("depth (sublayer / number of sublayers)")
    ax.set_ylabel("RMS of the sublayer's output")
    ax.set_title("sublayer output RMS across depth")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(args.picture)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["train", "timing", "report"])
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-iters", type=int, default=None, help="train: fewer steps than the recipe's (a trial)")
    ap.add_argument("--rounds", type=int, default=5, help="timing: interleaved rounds")
    ap.add_argument("--work", default="bench-attnres")
    ap.add_argument("--picture", default="docs/images/attention_residuals.png")
    args = ap.parse_args()
    {"train": train, "timing": timing, "report": report}[args.action](args)


if __name__ == "__main__":
    sys.exit(main())
