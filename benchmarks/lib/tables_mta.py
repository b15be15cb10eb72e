"""The Multi-Token Attention tables of the documentation, from their records (report.py runs
them): step times, the learning-rate sweep, and every arm over the seeds."""
import records
import stats

NAMES = {"standard": "standard attention", "mta": "MTA 2 × 9", "mta-1x1": "MTA 1 × 1", "mta-1x3": "MTA 1 × 3",
         "mta-1x9": "MTA 1 × 9"}


def timing(rows: list[dict]) -> str:
    newest = {r["arm"]: r for r in rows}
    ref = newest["mta"]["step_ms"]
    out = ["| arm | step | MTA 2 × 9 / this | rounds |", "| --- | ---: | ---: | --- |"]
    for arm, r in newest.items():
        out.append(f"| {NAMES[arm]} | {r['step_ms']:.1f} ms | {ref / r['step_ms']:.2f}× | {r['rounds']}, interleaved |")
    out += ["", f"`tbp bench` training steps at the study's shape (4 layers × 64, 2 heads, batch 32, context 80), "
                f"medians. Each arm trains MTA 2 × 9's steps × this ratio: the same wall time. {records.provenance(rows)}"]
    return "\n".join(out)


POOL = 300_000          # the study's training examples (mta_find_block.py --examples), drawn with replacement


def repeated(draws: int, pool: int = POOL) -> float:
    """The expected share of ``draws`` examples, drawn uniformly with replacement from ``pool``,
    that repeat one drawn before: 1 - E[distinct] / draws, E[distinct] = pool (1 - (1 - 1/pool)^draws)."""
    return 1 - pool * (1 - (1 - 1 / pool) ** draws) / draws


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def sweep(rows: list[dict]) -> str:
    swept = [r for r in rows if r["phase"] == "sweep"]
    lrs = sorted({r["lr"] for r in swept})
    out = ["| arm | steps | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "| --- | ---: |" + " ---: |" * len(lrs)]
    for arm in NAMES:
        budgets = sorted({r["steps"] for r in swept if r["arm"] == arm})
        for steps in budgets:              # one row per budget; the longest one's best is the arm's rate
            got = {r["lr"]: r for r in swept if r["arm"] == arm and r["steps"] == steps}
            best = min(got, key=lambda lr: (got[lr]["error"], got[lr]["val_loss"])) if steps == budgets[-1] else None
            cells = [("**%s**" if lr == best else "%s") % f"{_pct(got[lr]['error'])} ({got[lr]['val_loss']:.3f})"
                     if lr in got else "" for lr in lrs]
            out.append(f"| {NAMES[arm]} | {steps:,} | " + " | ".join(cells) + " |")
    out += ["", f"Held-out error (validation loss on the answers in brackets), seed {swept[0]['seed']}; the best "
                f"in bold is each arm's learning rate for the other seeds (the ablation arms take MTA 2 × 9's)."]
    return "\n".join(out)


def seeds(rows: list[dict]) -> str:
    """Every arm's runs after the sweep (each at the learning rate the sweep chose for it) over
    the seeds: error per seed with Wilson's interval, the mean with a t interval, and the paired
    difference against standard attention."""
    rows = [r for r in rows if r["phase"] != "sweep" and "pool" not in r]     # the fixed pool's (matched: below)
    if not rows:
        return "(no runs after the sweep yet)"
    longest = {arm: max((r["steps"] for r in rows if r["arm"] == arm), default=0) for arm in NAMES}
    rows = [r for r in rows if r["steps"] == longest[r["arm"]]]     # each arm's longest budget: one budget a row
    runs = {arm: {r["seed"]: r for r in rows if r["arm"] == arm} for arm in NAMES}
    seed_list = sorted({s for got in runs.values() for s in got})
    out = ["| arm | lr | steps | repeats | " + " | ".join(f"seed {s}" for s in seed_list) + " | mean error | − standard, paired |",
           "| --- | ---: | ---: | ---: |" + " ---: |" * len(seed_list) + " ---: | ---: |"]
    error = {arm: {s: r["error"] for s, r in got.items()} for arm, got in runs.items()}
    for arm, got in runs.items():
        if not got:
            continue
        r0 = next(iter(got.values()))
        cells = []
        for s in seed_list:
            if s in got:
                r = got[s]
                lo, hi = stats.binomial_ci(round(r["error"] * r["examples"]), r["examples"])
                cells.append(f"{_pct(r['error'])} ({100 * lo:.1f}–{100 * hi:.1f})")
            else:
                cells.append("")
        m, h = stats.mean_ci(list(error[arm].values()))
        diff = ""
        if arm != "standard" and error["standard"]:
            d, dh, n = stats.paired(error[arm], error["standard"])
            diff = f"{100 * d:+.1f} ± {100 * dh:.1f} points ({n} seeds)" if n > 1 else f"{100 * d:+.1f} points (1 seed)"
        mean = _pct(m) + ("" if h != h else f" ± {100 * h:.1f}")
        draws = r0["steps"] * r0["config"]["train"]["batch_size"]
        out.append(f"| {NAMES[arm]} | {r0['lr']:g} | {r0['steps']:,} | {100 * repeated(draws):.0f} % | " + " | ".join(cells)
                   + f" | {mean} | {diff} |")
    n = rows[0]["examples"]
    out += ["", f"Repeats: the expected share of an arm's training draws (steps × batch) that repeat an example "
                f"already drawn, the batches being drawn with replacement from {POOL:,} examples. "
                f"Error = 1 − greedy exact match on {n:,} held-out examples, with Wilson's 95 % interval per run; the "
                f"mean's ± is a 95 % t interval over the seeds, and the paired difference pairs seeds (the same "
                f"initial draw and batches). {records.provenance(rows)}"]
    return "\n".join(out)


def matched(rows: list[dict]) -> str:
    """The runs with matched repeats (each drawn from a pool sized to its draws): per arm, rate
    and budget, the error on each seed and its mean, and the difference from MTA 2 × 9 at its
    swept rate -- unpaired (Welch): runs of different pools share no batches."""
    rows = [r for r in rows if "pool" in r]
    if not rows:
        return "(no runs with matched repeats yet)"
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["arm"], r["lr"], r["steps"], r["pool"]), {})[r["seed"]] = r
    ref_key = next((k for k, got in groups.items()
                    if k[0] == "mta" and next(iter(got.values()))["factor"] == 1
                    and next(iter(got.values()))["swept_lr"]), None)
    ref = [r["error"] for r in groups[ref_key].values()] if ref_key else []
    seed_list = sorted({r["seed"] for r in rows})
    out = ["| arm | lr | budget | steps | pool | repeats | " + " | ".join(f"seed {s}" for s in seed_list)
           + " | mean error | − MTA 2 × 9 at its rate |",
           "| --- | ---: | --- | ---: | ---: | ---: |" + " ---: |" * len(seed_list) + " ---: | ---: |"]
    order = sorted(groups, key=lambda k: (k != ref_key, list(NAMES).index(k[0]) if k[0] in NAMES else 99, k[2], -k[1]))
    for key in order:
        got = groups[key]
        arm, lr, _, _ = key
        r0 = next(iter(got.values()))
        cells = []
        for s in seed_list:
            if s in got:
                lo, hi = stats.binomial_ci(round(got[s]["error"] * got[s]["examples"]), got[s]["examples"])
                cells.append(f"{_pct(got[s]['error'])} ({100 * lo:.1f}–{100 * hi:.1f})")
            else:
                cells.append("")
        errors = [r["error"] for r in got.values()]
        m, h = stats.mean_ci(errors)
        diff = ""
        if key != ref_key and ref:
            d, dh = stats.welch(errors, ref)
            diff = f"{100 * d:+.1f}" + ("" if dh != dh else f" ± {100 * dh:.1f}") + " points"
        draws = r0["steps"] * r0["config"]["train"]["batch_size"]
        budget = ("matched" if r0["factor"] == 1 else f"{r0['factor']} × matched") + \
            ("" if r0["swept_lr"] else ", off the swept rate")
        out.append(f"| {NAMES[arm]} | {lr:g} | {budget} | {r0['steps']:,} | {r0['pool']:,} | "
                   f"{100 * repeated(draws, r0['pool']):.0f} % | " + " | ".join(cells)
                   + f" | {_pct(m) + ('' if h != h else f' ± {100 * h:.1f}')} | {diff} |")
    out += ["", f"Each run draws its batches with replacement from its own pool of examples, sized to its draws "
                f"(steps × batch), so the expected share of repeated draws (repeats) is the same for every run; the "
                f"pools are prefixes of one stream, and the {rows[0]['examples']:,} held-out examples, drawn from "
                f"another, are the same for all (and not those of the tables above). Budget: the wall time of "
                f"MTA 2 × 9's steps (matched), or a multiple of it; each arm at the rate its sweep chose, or at a "
                f"lower one. Error = 1 − greedy exact match, with Wilson's 95 % interval per run; the mean's ± is a "
                f"95 % t interval over the seeds; the difference is unpaired (runs of different pools share no "
                f"batches), with Welch's 95 % interval. {records.provenance(rows)}"]
    return "\n".join(out)
