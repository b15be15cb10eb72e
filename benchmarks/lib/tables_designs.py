"""The FlashAttention and cross-attention tables of the documentation, from their records
(long_context.py, seq2seq_tasks.py)."""
import statistics

import records
import stats


def flash_long_context(rows: list[dict]) -> str:
    rows = records.newest(rows, lambda r: (r["T"], r["impl"]))
    by = {(r["T"], r["impl"]): r for r in rows}
    lengths = sorted({r["T"] for r in rows})
    out = ["| T | dense step | flash step | flash / dense | dense peak | flash peak |",
           "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for T in lengths:
        d, f = by.get((T, "dense")), by.get((T, "flash"))
        if d is None or f is None:
            continue
        # the ratio of each round's pair (the kernels ran one after the other), then the median
        ratios = [fs / ds for ds, fs in zip(d["step_s_rounds"], f["step_s_rounds"])]
        cell = lambda r: f"{r['step_s']:.3g} s ({min(r['step_s_rounds']):.3g}–{max(r['step_s_rounds']):.3g})"
        out.append(f"| {T:,} | {cell(d)} | {cell(f)} | {statistics.median(ratios):.2f} "
                   f"({min(ratios):.2f}–{max(ratios):.2f}) | {d['peak_mib']:,.0f} MiB | {f['peak_mib']:,.0f} MiB |")
    r0 = rows[0]
    out += ["", f"One training step (forward, backward, clipping, AdamW) of a 4-layer, 4-head, 128-wide rotary model, "
                f"batch 1, random tokens: each cell the median over {r0['rounds']} rounds (range in brackets) of a "
                f"process's median of {r0['steps']} steps after a warm-up; the kernels' order alternated from round "
                f"to round, and the ratio is the median of the rounds' ratios. Peak: the process's peak resident set "
                f"size, Python and NumPy included (about 40 MiB), the largest of the rounds. {records.provenance(rows)}",
            "", "`python benchmarks/speed/long_context.py`"]
    return "\n".join(out)


def seq2seq_curves(rows: list[dict]) -> str:
    """Exact match on the held-out strings by step, each architecture over the seeds, and the
    step at which each run first gets 99 % right."""
    rows = records.newest(rows, lambda r: (r["task"], r["arch"], r["seed"], r["iters"], r["step"]))
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    steps = sorted({r["step"] for r in rows})
    shown = [s for s in steps if s in (250, 500, 750, 1000, 1500, 2000) or s == steps[-1]]
    out = ["| model | " + " | ".join(f"step {s:,}" for s in shown) + " | first step ≥ 99 % | encoder zeroed |",
           "| --- |" + " ---: |" * len(shown) + " --- | --- |"]
    for arch in archs:
        mine = [r for r in rows if r["arch"] == arch]
        seeds = sorted({r["seed"] for r in mine})
        cells = []
        for s in shown:
            got = [r["exact_match"] for r in mine if r["step"] == s]
            if not got:
                cells.append("")
                continue
            m, h = stats.mean_ci(got)
            cells.append(f"{100 * m:.1f} %" + ("" if h != h else f" ± {100 * h:.1f}"))
        first = []
        for seed in seeds:
            hit = [r["step"] for r in sorted(mine, key=lambda r: r["step"]) if r["seed"] == seed and r["exact_match"] >= 0.99]
            first.append(f"{hit[0]:,}" if hit else "never")
        zeroed = [r for r in mine if "zeroed_exact_match" in r]
        z = ", ".join(f"{100 * r['zeroed_token_accuracy']:.0f} % / {100 * r['zeroed_exact_match']:.0f} %" for r in zeroed)
        out.append(f"| {arch} | " + " | ".join(cells) + f" | {', '.join(first)} | {z or '—'} |")
    r0 = rows[0]
    out += ["", f"Task `{r0['task']}`: greedy exact match on the 1,000 held-out strings (`tbp eval`), mean ± 95 % t "
                f"interval over seeds {', '.join(map(str, sorted({r['seed'] for r in rows})))}; "
                f"\"first step ≥ 99 %\" per seed, in steps of {steps[0]:,} (evaluations every {steps[0]:,} steps of one "
                f"{r0['iters']:,}-step schedule); \"encoder zeroed\": next-token accuracy / exact match of the "
                f"encoder-decoder with its encoder's output zeroed at the end. The encoder-decoder has 2 + 2 layers "
                f"× 64 (237k parameters), the GPT 4 layers × 64 with the loss on the target (203k). "
                f"{records.provenance(rows)}",
            "", "`python benchmarks/studies/seq2seq_tasks.py --task reverse --seeds 1 2 3`"]
    return "\n".join(out)
