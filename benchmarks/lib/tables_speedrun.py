"""The speedrun's tables (docs/explanation/performance.md), from results/speedrun.jsonl
(benchmarks/studies/speedrun.py) and results/nanogpt_step.jsonl (benchmarks/peers/nanogpt_step.py)."""
import statistics

import records
import stats


def _loss(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    m, h = stats.mean_ci(values)
    return f"{m:.4f} ± {h:.4f}"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def budgets(rows: list[dict]) -> str:
    """Per arm and budget, each seed's newest record: the held-out half's loss (mean ± 95 %
    interval), the whole split's (nanoGPT's figure, both halves), half A's (what tuning read),
    the time to the target, tokens and steps."""
    groups: dict = {}
    for r in records.newest(rows, lambda r: (r["arm"], r["budget_s"], r["seed"])):
        groups.setdefault((r["budget_s"], r["arm"]), []).append(r)
    out = ["| budget | recipe | seeds | validation loss, held-out half (B) | whole split | half A (tuning) | reached "
           f"{rows[0]['target']:g} | time to {rows[0]['target']:g}, median | tokens | steps | threads |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (budget, arm), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], min(r["half_a"] for r in kv[1]))):
        reached = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
        out.append(f"| {_minutes(budget)} | {arm} | {len(runs)} | {_loss([r['half_b'] for r in runs])} | "
                   f"{_loss([r['val_split'] for r in runs])} | {_loss([r['half_a'] for r in runs])} | {len(reached)} of {len(runs)} | "
                   f"{_minutes(statistics.median(reached)) if reached else '—'} | "
                   f"{statistics.median(r['tokens'] for r in runs):,.0f} | "
                   f"{statistics.median(r['steps'] for r in runs):,.0f} | {runs[0]['threads']} |")
    note = ("Losses in nats per character over every window of the context, final weights; mean ± 95 % "
            "interval over seeds. The time to the target is the command's, from its start to the first "
            "evaluation whose estimate (about 64 windows of the whole split) reaches it.")
    return "\n".join(out) + f"\n\n{note} {records.provenance(rows)}"


def engines(rows: list[dict]) -> str:
    """nanoGPT's recipe, one step of 64 x 256 tokens: the median over rounds of each engine's
    median step time, and each against tbp's."""
    by: dict = {}
    for r in rows:
        by.setdefault(r["engine"], []).append(r["median_step_s"])
    tbp = statistics.median(by["tbp"]) if "tbp" in by else None
    out = ["| engine | rounds | step time, median | tokens/s | tbp's speed against it |",
           "| --- | ---: | ---: | ---: | ---: |"]
    for engine, times in sorted(by.items(), key=lambda kv: statistics.median(kv[1])):
        t = statistics.median(times)
        ratio = f"{t / tbp:.2f}×" if tbp and engine != "tbp" else ""
        out.append(f"| {engine} | {len(times)} | {t:.2f} s | {64 * 256 / t:,.0f} | {ratio} |")
    extra = sorted({f"PyTorch {r['torch']}, nanoGPT {r['nanogpt_commit']}" for r in rows if r["engine"] != "tbp"})
    return "\n".join(out) + f"\n\n{'; '.join(extra)}. {records.provenance(rows)}"


def defaults(rows: list[dict]) -> str:
    """The default run against candidate defaults (benchmarks/studies/defaults.py): per arm, the
    whole split's loss over the seeds, its difference from the default paired by seed, and the
    run's time against the default's."""
    rows = records.newest(rows, lambda r: (r["arm"], r["seed"]))
    by = {}
    for r in rows:
        by.setdefault(r["arm"], {})[r["seed"]] = r
    base = by.get("default", {})
    out = ["| arm | options | seeds | validation loss, whole split | − default, paired by seed | time a run, median | "
           "× the default's |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    base_time = statistics.median(r["elapsed_s"] for r in base.values()) if base else float("nan")
    for arm, runs in by.items():
        losses = {s: r["val_split_loss"] for s, r in runs.items()}
        diff = "" if arm == "default" else "{:+.4f} ± {:.4f} ({})".format(
            *stats.paired(losses, {s: r["val_split_loss"] for s, r in base.items()})[:2],
            ", ".join(f"{losses[s] - base[s]['val_split_loss']:+.4f}" for s in sorted(set(losses) & set(base))))
        t = statistics.median(r["elapsed_s"] for r in runs.values())
        options = " ".join(next(iter(runs.values()))["options"]) or "(none)"
        out.append(f"| {arm} | `{options}` | {len(runs)} | {_loss(list(losses.values()))} | {diff} | {t:.0f} s | "
                   f"{t / base_time:.2f} |")
    r = rows[0]
    out += ["", f"The default run (`tbp train`: {r['model']['n_layer']} × {r['model']['d_model']}, context "
                f"{r['model']['n_ctx']}, {r['train']['max_iters']:,} steps on the built-in corpus) with the options "
                f"shown; the loss of the final weights over the whole validation split ({r['val_split_tokens']:,} "
                f"tokens), mean ± 95 % t interval over the seeds; the difference paired by seed (the same "
                f"initialisation and batches), then each seed's. Runs two at a time, a thread each: the times "
                f"compare the arms with each other. {records.provenance(rows)} `benchmarks/studies/defaults.py`."]
    return "\n".join(out)
