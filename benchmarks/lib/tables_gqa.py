"""The tables of docs/designs/grouped-query-attention.md, from results/gqa_*.jsonl (gqa_quality.py)."""
import numpy as np

import records
import stats


def _verdict(m: float, h: float, margin: float) -> str:
    """Read against the margin declared before the runs: equivalent, worse, better, or neither."""
    if abs(m) + h <= margin:
        return f"equivalent (within ±{margin})"
    if m - h > 0:
        return "worse"
    if m + h < 0:
        return "better"
    return "not settled"


def quality(rows: list[dict]) -> str:
    """Per arm at the chosen rate: the whole-split validation loss over seeds 1-5, and its paired
    difference from the full-head arm; then the learning rates tried, with their losses."""
    margin = rows[0]["margin"]
    sweep = {}
    for r in rows:
        if r["n_kv_head"] == 4 and r["seed"] in (1, 2):
            sweep.setdefault(r["lr"], {})[r["seed"]] = r["val_split_loss"]
    full = {lr: v for lr, v in sweep.items() if len(v) == 2}
    lr = min(full, key=lambda x: np.mean(list(full[x].values())))
    at = {kv: {r["seed"]: r for r in rows if r["n_kv_head"] == kv and r["lr"] == lr} for kv in (4, 2, 1)}
    base = {s: r["val_split_loss"] for s, r in at[4].items()}
    out = ["| key/value heads | parameters | KV cache per token | seeds | validation loss, whole split | "
           "− full heads, paired by seed | reading |", "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for kv, runs in at.items():
        if not runs:
            continue
        r0 = next(iter(runs.values()))
        losses = {s: r["val_split_loss"] for s, r in runs.items()}
        m, h = stats.mean_ci(list(losses.values()))
        if kv == 4:
            diff, reading = "", ""
        else:
            d, dh, n = stats.paired(losses, base)
            diff, reading = f"{d:+.4f} ± {dh:.4f}", _verdict(d, dh, margin)
        out.append(f"| {kv}{' (standard)' if kv == 4 else ' (multi-query)' if kv == 1 else ''} | {r0['params']:,} | "
                   f"{r0['cache_bytes_per_token']:,} B | {len(runs)} | {m:.4f} ± {h:.4f} | {diff} | {reading} |")
    tried = sorted({(r["n_kv_head"], r["lr"]) for r in rows})
    cells = []
    for kv, x in tried:
        v = [r["val_split_loss"] for r in rows if r["n_kv_head"] == kv and r["lr"] == x and r["seed"] in (1, 2)]
        seeds = sorted(r["seed"] for r in rows if r["n_kv_head"] == kv and r["lr"] == x and r["seed"] in (1, 2))
        cells.append(f"{kv} head{'s' * (kv != 1)} at {x:g}: {np.mean(v):.4f} (seed{'s' if len(seeds) > 1 else ''} "
                     f"{', '.join(map(str, seeds))})")
    out += ["", f"The default run (4 × 128, 4 query heads, context 128, 1,500 steps, "
                f"{rows[0]['val_split_tokens']:,} validation tokens); every arm at peak rate {lr:g} (the full-head "
                f"arm's best of the sweep), the minimum a tenth of it. Mean ± 95 % t interval over the seeds; the "
                f"difference paired by seed. Declared before the runs: equivalent if the interval lies within "
                f"±{margin} nats. Rates tried, mean loss over seeds 1 and 2 where both ran, else seed 1: "
                f"{'; '.join(cells)}. "
                f"{records.provenance(rows)}"]
    return "\n".join(out)


def speed(rows: list[dict]) -> str:
    """Decoding tokens/s per arm, the newest record per case."""
    out = ["| case | cached tokens | 4 key/value heads | 2 | 1 | cache bytes, 4 / 2 / 1 |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    shown = records.newest(rows, lambda r: r["case"])
    for r in shown:
        t, c = r["tokens_per_s"], r["cache_bytes"]
        out.append(f"| {r['case']} | {r['cache_tokens'] - r['tokens']:,} → {r['cache_tokens']:,} | {t['4']:.0f} | "
                   f"{t['2']:.0f} ({t['2'] / t['4']:.2f}×) | {t['1']:.0f} ({t['1'] / t['4']:.2f}×) | "
                   f"{c['4']:,} / {c['2']:,} / {c['1']:,} |")
    r = shown[-1]
    out += ["", f"Tokens/s decoding {r['tokens']} tokens after a prompt that fills the rest of the context, batch 1, "
                f"random weights (speed needs the shape only), 4 × 128 with 4 query heads; the median of {r['rounds']} "
                f"rounds, the arms interleaved in one process. {records.provenance(shown)}"]
    return "\n".join(out)


def uptrain(rows: list[dict]) -> str:
    """Pooled from full heads, then trained on: each arm's loss minus its own seed's full-head
    source, as converted, after each uptraining length at its chosen rate, and from scratch."""
    margin = rows[0]["margin"]
    source = {r["seed"]: r["val_split_loss"] for r in rows if r["arm"] == "source"}
    steps = next(r["steps"] for r in rows if r["arm"] == "source")       # the pre-training's
    lengths = sorted({r["uptrain_steps"] for r in rows if r["arm"] == "uptrained"})
    tried = {}
    for r in rows:
        if r["arm"] == "uptrained" and r["seed"] == 1:
            tried.setdefault((r["n_kv_head"], r["uptrain_steps"]), {})[r["uptrain_lr"]] = r["val_split_loss"]
    chosen = {k: min(v, key=v.get) for k, v in tried.items()}

    def cell(arm_rows: list[dict]) -> str:
        if not arm_rows:
            return ""
        d, h, n = stats.paired({r["seed"]: r["val_split_loss"] for r in arm_rows}, source)
        return f"{d:+.4f} ± {h:.4f} ({n})" if n > 1 else f"{d:+.4f} (1)"

    m, h = stats.mean_ci(list(source.values()))
    head = (["as converted"] + [f"after {n:,} steps ({100 * n / steps:.3g} %)" for n in lengths]
            + [f"from scratch, {steps:,} steps"])
    out = [f"| key/value heads | {' | '.join(head)} |", "| ---: |" + " ---: |" * len(head)]
    for kv in (2, 1):
        at = lambda arm, **k: [r for r in rows if r["arm"] == arm and r["n_kv_head"] == kv
                               and all(r.get(f) == v for f, v in k.items())]
        cells = [cell(at("pooled"))] + [cell(at("uptrained", uptrain_steps=n, uptrain_lr=chosen.get((kv, n))))
                                        for n in lengths] + [cell(at("scratch"))]
        out.append(f"| {kv}{' (multi-query)' if kv == 1 else ''} | {' | '.join(cells)} |")
    lr = rows[0]["source_lr"]
    sweep = "; ".join(f"{kv} head{'s' * (kv != 1)}, {n} steps: " +
                      ", ".join(f"{x:g} → {v:.4f}" for x, v in sorted(t.items())) for (kv, n), t in sorted(tried.items()))
    out += ["", f"Validation loss over the whole split minus the same seed's full-head model (4 key/value heads, "
                f"peak rate {lr:g}, {steps:,} steps: {m:.4f} ± {h:.4f} over {len(source)} seeds); mean ± 95 % t interval "
                f"of the paired differences (seeds). As converted: the full-head model with its key/value heads "
                f"mean-pooled, untrained; after N steps: trained on from there (warmup N/10, batches of another "
                f"seed), at the peak rate that gave seed 1 the lowest loss of those tried ({sweep}); from scratch: "
                f"the shared-head model trained like the full-head one. The margin declared for the quality table "
                f"is ±{margin} nats. {records.provenance(rows)}"]
    return "\n".join(out)
