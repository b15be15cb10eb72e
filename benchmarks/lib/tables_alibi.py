"""The ALiBi table of the documentation, from results/alibi_positions.jsonl (alibi_positions.py):
each positions scheme's validation loss at its trained context, and what it reads past it."""
import records
import stats

NAMES = {"learned": "learned", "rope": "rotary (rope)", "alibi": "ALiBi"}
READS = ("window 256", "full 256", "window 512", "full 512")


def _cell(values: list[float]) -> str:
    if not values:
        return "—"
    m, h = stats.mean_ci(values)
    return f"{m:.3f}" + ("" if h != h else f" ± {h:.3f}")


def positions(rows: list[dict]) -> str:
    rows = records.newest(rows, lambda r: (r["positions"], r["seed"]))
    runs = {p: {r["seed"]: r for r in rows if r["positions"] == p} for p in NAMES}
    base = {s: r["val_split_loss"] for s, r in runs["learned"].items()}
    out = ["| positions | seeds | context 128 | − learned, paired | " + " | ".join(f"{k.split()[0]} {k.split()[1]}"
                                                                           for k in READS) + " |",
           "| --- | ---: | ---: | ---: |" + " ---: |" * len(READS)]
    for p, got in runs.items():
        if not got:
            continue
        loss = {s: r["val_split_loss"] for s, r in got.items()}
        diff = ""
        if p != "learned" and base:
            d, h, n = stats.paired(loss, base)
            diff = f"{d:+.3f}" + ("" if h != h else f" ± {h:.3f}") + f" ({n})"
        reads = [_cell([r["reads"][k]["past_context_loss"] for r in got.values() if k in r["reads"]]) for k in READS]
        out.append(f"| {NAMES[p]} | {len(got)} | {_cell(list(loss.values()))} | {diff} | " + " | ".join(reads) + " |")
    r0 = rows[0]
    out += ["", f"Validation loss (nats per token) of the default run ({r0['model']['n_layer']} × {r0['model']['d_model']}, "
                f"{r0['model']['n_head']} heads, context {r0['model']['n_ctx']}, {r0['steps']:,} steps, learning rate "
                f"{r0['train']['lr']:g} for every scheme, not swept per scheme): \"context 128\" over the whole validation "
                f"split; the other columns read the split in windows of 256 or 512 tokens and give the loss at the "
                f"positions past the trained context only (128 .. L − 1). **window**: the model as trained, each query "
                f"reading at most the last 128 positions; **full**: the same weights built with a context of L, each "
                f"query reading every earlier position (distances up to L − 1, never seen in training). Learned positions "
                f"have no vector past 128. Mean ± 95 % t interval over the seeds; the paired difference pairs seeds. "
                f"{records.provenance(rows)}",
            "", "`python benchmarks/studies/alibi_positions.py --jobs 2`"]
    return "\n".join(out)
