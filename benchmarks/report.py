"""Every results table in the README and the documentation, made from the records in
benchmarks/results/.

    python benchmarks/report.py           # rewrite the tables between their markers
    python benchmarks/report.py --check   # exit 1 if a committed table differs from the records

A table lives in README.md or a page under docs/ between ``<!-- report:NAME -->`` and
``<!-- /report:NAME -->``;
TABLES maps NAME to the function that makes it from its records. Nobody types a result
number into a table.
"""
import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))      # records, stats, tables_*
import records  # noqa: E402
import tables_alibi
import tables_designs
import tables_gatt
import tables_gpt2
import tables_gqa
import tables_interop
import tables_speculative
import tables_speedrun
import tables_mta
import tables_precision
import tables_sparse
import tables_speed

ROOT = Path(__file__).resolve().parents[1]


def pages() -> list[Path]:
    """README.md and every documentation page: wherever a results table may live."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _gb(nbytes: int) -> str:
    return f"{nbytes / 2 ** 30:.2f} GiB"


def prepare_scale(rows: list[dict]) -> str:
    """tbp prepare at each corpus size: the newest record per (label, size, kind)."""
    newest = {}
    for r in rows:
        newest[(r["label"], r["size"], r["kind"])] = r
    order = {"before": 0, "after": 1}
    keys = sorted(newest, key=lambda k: (order.get(k[0], 2), records_size(k[1]), k[2]))
    out = ["| code | corpus | tokenizer | time | throughput | peak memory | commit |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for k in keys:
        r = newest[k]
        m = r["metrics"]
        if m["exit"] != 0:
            out.append(f"| {r['label']} | {_gb(r['corpus_bytes'])} | {r['kind']} | failed: {m['error']} | | | "
                       f"{r['commit']} |")
            continue
        out.append(f"| {r['label']} | {_gb(r['corpus_bytes'])} | {r['kind']}"
                   f"{' 4,096' if r['kind'] == 'bpe' else ''} | {m['seconds']:.0f} s | {m['mb_per_s']:.1f} MB/s | "
                   f"{_gb(m['peak_rss_bytes'])} | {r['commit']} |")
    cpus = sorted({r["cpu"] for r in rows})
    out.append("")
    out.append(f"CPU: {'; '.join(cpus)}. BPE time includes training the tokenizer on its sample.")
    return "\n".join(out)


def records_size(text: str) -> float:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)


def bpe_encode(rows: list[dict]) -> str:
    """BPE encoding on all cores, the newest run of each way."""
    newest = {r["way"]: r for r in rows}
    out = ["| way | throughput | median of | corpus | commit |", "| --- | --- | --- | --- | --- |"]
    for way, r in newest.items():
        out.append(f"| {way} | {r['metrics']['mb_per_s']:.2f} MB/s | {r['rounds']} rounds, interleaved | "
                   f"{r['corpus_mb']} MB, BPE {r['vocab_size']:,} | {r['commit']} |")
    out += ["", f"CPU: {'; '.join(sorted({r['cpu'] for r in rows}))}; each time includes starting the processes."]
    return "\n".join(out)


def prepare_paired(rows: list[dict]) -> str:
    """Before and after in turn: medians of each, and the median of the per-round ratios."""
    import statistics
    groups = {}
    for r in rows:
        groups.setdefault((r["size"], r["kind"]), {}).setdefault(r["round"], {})[r["label"]] = r
    out = ["| corpus | tokenizer | before: median time, peak | after: median time, peak | speed-up (median of "
           "rounds, min-max) | rounds |", "| --- | --- | --- | --- | --- | --- |"]
    for (size, kind), rounds in sorted(groups.items()):
        whole = [v for v in rounds.values() if "before" in v and "after" in v]
        if not whole:
            continue
        ratios = [v["before"]["metrics"]["seconds"] / v["after"]["metrics"]["seconds"] for v in whole]
        cell = {}
        for label in ("before", "after"):
            ms = [v[label]["metrics"] for v in whole]
            cell[label] = (f"{statistics.median(m['seconds'] for m in ms):.1f} s, "
                           f"{_gb(statistics.median(m['peak_rss_bytes'] for m in ms))}")
        out.append(f"| {_gb(whole[0]['after']['corpus_bytes'])} | {kind} | {cell['before']} | {cell['after']} | "
                   f"{statistics.median(ratios):.1f}× ({min(ratios):.1f}-{max(ratios):.1f}) | {len(whole)} |")
    out += ["", f"CPU: {'; '.join(sorted({r['cpu'] for r in rows}))}; before {rows[0]['commit'] if rows else ''} "
            f"and after in turn, the order reversed each round."]
    return "\n".join(out)


ARMS = ("sum", "sum-scaled", "attnres")


def _fmt(m: float, h: float, sign: bool = False) -> str:
    body = f"{m:+.3f}" if sign else f"{m:.3f}"
    return body if h != h else f"{body} ± {h:.3f}"


def attnres_sweep(rows: list[dict]) -> str:
    """Validation loss of each arm at each learning rate (first seed); the best in bold."""
    sweep = [r for r in rows if r["phase"] == "sweep"]
    lrs = sorted({r["lr"] for r in sweep})
    out = ["| layers | arm | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "| --- | --- |" + " --- |" * len(lrs)]
    for depth in sorted({r["n_layer"] for r in sweep}):
        for arm in ARMS:
            got = {r["lr"]: r["val_loss"] for r in sweep if r["n_layer"] == depth and r["arm"] == arm}
            if not got:
                continue
            best = min(got, key=got.get)
            cells = [("**%.3f**" if lr == best else "%.3f") % got[lr] if lr in got else "" for lr in lrs]
            out.append(f"| {depth} | {arm} | " + " | ".join(cells) + " |")
    seeds = sorted({r["seed"] for r in sweep})
    out += ["", f"Seed {', '.join(map(str, seeds))}; CPU: {'; '.join(sorted({r['cpu'] for r in rows}))}; "
                f"commits {', '.join(sorted({r['commit'] for r in rows}))}."]
    return "\n".join(out)


def attnres_depth(rows: list[dict]) -> str:
    """Each arm at its best learning rate over every seed: mean and 95 % t interval, and the
    paired difference of AttnRes against each sum (same seeds: same batches)."""
    import stats
    out = ["| layers | arm | best lr | steps | seeds | val loss (95 % CI) | AttnRes − this arm, paired |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for depth in sorted({r["n_layer"] for r in rows}):
        at = [r for r in rows if r["n_layer"] == depth]
        best, loss = {}, {}
        for arm in ARMS:
            sweep = [r for r in at if r["arm"] == arm and r["phase"] == "sweep"]
            if not sweep:
                continue
            best[arm] = min(sweep, key=lambda r: r["val_loss"])["lr"]
            loss[arm] = {r["seed"]: r["val_loss"] for r in at if r["arm"] == arm and r["lr"] == best[arm]}
        for arm in best:
            m, h = stats.mean_ci(list(loss[arm].values()))
            steps = next(r["steps"] for r in at if r["arm"] == arm)
            diff = ""
            if arm != "attnres" and "attnres" in loss:
                d, dh, n = stats.paired(loss["attnres"], loss[arm])
                diff = f"{_fmt(d, dh, sign=True)} ({n} seed{'s' * (n > 1)})" if n else ""
            out.append(f"| {depth} | {arm} | {best[arm]:g} | {steps:,} | {len(loss[arm])} | {_fmt(m, h)} | {diff} |")
    out += ["", "Validation loss: `tbp eval` over the whole held-out split, nats per character. A negative "
                "difference favours Attention Residuals."]
    return "\n".join(out)


def _best_lrs(depth_rows: list[dict]) -> dict:
    """(layers, arm) -> the learning rate of its lowest whole-split validation loss in the sweep."""
    best = {}
    for r in depth_rows:
        if r["phase"] == "sweep":
            key = (r["n_layer"], r["arm"])
            if key not in best or r["val_loss"] < best[key]["val_loss"]:
                best[key] = r
    return {k: r["lr"] for k, r in best.items()}


def attnres_localise(rows: list[dict]) -> str:
    """Where the 4-layer deficit comes from: each arm's validation loss over the seeds, and its
    paired difference from the sum."""
    import stats
    rows = records.newest(rows, lambda r: (r["arm"], r["seed"]))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    loss = {a: {r["seed"]: r["val_loss"] for r in rows if r["arm"] == a} for a in arms}
    out = ["| arm | seeds | validation loss | − sum, paired | − sum at epsilon 0, paired |",
           "| --- | ---: | ---: | ---: | ---: |"]

    def minus(a, base):
        if a == base or not loss.get(base):
            return ""
        d, dh, n = stats.paired(loss[a], loss[base])
        return f"{d:+.4f}" + ("" if dh != dh else f" ± {dh:.4f}") + f" ({n})"
    for a in arms:
        m, h = stats.mean_ci(list(loss[a].values()))
        cell = f"{m:.4f}" + ("" if h != h else f" ± {h:.4f}")
        same_eps = minus(a, "sum, eps 0") if a.endswith("eps 0") else ""
        out.append(f"| {a} | {len(loss[a])} | {cell} | {minus(a, 'sum')} | {same_eps} |")
    r0 = rows[0]
    out += ["", f"4 layers × 64, every arm at learning rate {r0['lr']:g} (the 4-layer sums' best) for "
                f"{r0['steps']:,} steps, the same schedule: not a race, a comparison of functions and of "
                f"optimisation. c is the factor on the depth logits (--residual-query-scale): c = 0 freezes the "
                f"pseudo-queries at zero (the sum's function), c < 1 lets them learn at c times the rate "
                f"(Adam). `tbp eval` over the whole validation split; mean ± 95 % t interval over the seeds, "
                f"the differences paired by seed; an arm at layer-norm epsilon 0 also against the sum at "
                f"epsilon 0, where c = 0 and the sum compute one function. CPU: {records.cpus(rows)}; TBP_GEMM "
                f"{', '.join(sorted({r.get('tbp_gemm', 'auto') for r in rows}))}; commits "
                f"{', '.join(sorted({r['commit'] for r in rows}))}.",
            "", "`python benchmarks/studies/attention_residuals.py localise --seeds 1 2 3 --jobs 2`"]
    return "\n".join(out)


def attnres_at_budget(rows: list[dict]) -> str:
    """Each arm at its best learning rate: the fixed batches' validation estimate at AttnRes's
    budget (1,000 steps) and at the end, mean over seeds: the sums at 1,000 steps are not yet
    annealed (their schedules run longer), so this favours AttnRes."""
    import stats
    best = _best_lrs(records.read("attnres_depth"))
    out = ["| layers | arm | best lr | seeds | at step 1,000 | at its last step |", "| --- | --- | --- | --- | --- | --- |"]
    for (depth, arm), lr in sorted(best.items(), key=lambda kv: (kv[0][0], ARMS.index(kv[0][1]))):
        runs = [r for r in rows if (r["n_layer"], r["arm"], r["lr"]) == (depth, arm, lr)]
        if not runs:
            continue
        m1, h1 = stats.mean_ci([dict(zip(r["eval_steps"], r["val_estimate"]))[1000] for r in runs])
        m2, h2 = stats.mean_ci([r["val_estimate"][-1] for r in runs])
        out.append(f"| {depth} | {arm} | {lr:g} | {len(runs)} | {_fmt(m1, h1)} | {_fmt(m2, h2)} |")
    out += ["", "The estimate each evaluation logs (20 fixed validation batches, so not the whole split), 95 % t "
                "intervals over the seeds."]
    return "\n".join(out)


def attnres_timing(rows: list[dict]) -> str:
    newest = {(r["n_layer"], r["arm"]): r for r in rows}
    out = ["| layers | sum step | AttnRes step | AttnRes / sum | rounds |", "| --- | --- | --- | --- | --- |"]
    for depth in sorted({d for d, _ in newest}):
        s, a = newest.get((depth, "sum")), newest.get((depth, "attnres"))
        if s and a:
            out.append(f"| {depth} | {s['step_ms']:.1f} ms | {a['step_ms']:.1f} ms | "
                       f"{a['step_ms'] / s['step_ms']:.2f}× | {a['rounds']}, interleaved |")
    out += ["", f"`tbp bench` training steps (batch 12, context 128, {rows[0]['threads']} threads), medians; "
                f"CPU: {'; '.join(sorted({r['cpu'] for r in rows}))}. The sums train AttnRes's steps × this ratio."]
    return "\n".join(out)


def _link(gbit) -> str:
    return "free" if gbit is None else f"{gbit:g} Gbit/s"


def _rounds(rows: list[dict]) -> dict:
    """(model, link) -> the rounds of the newest commit measured for it."""
    newest: dict = {}
    for r in rows:
        newest.setdefault((r["model"], r["link_gbit"]), {}).setdefault(r["commit"], []).append(r)
    return {k: list(v.values())[-1] for k, v in newest.items()}


def _median(values) -> float:
    import statistics
    return statistics.median(values)


def mpi_overlap(rows: list[dict]) -> str:
    """Per model and link: the step with no communication, with one allreduce after the
    backward, and overlapped; the overlap's change to the step, paired by round (mean, 95 % t);
    and, where the communication costs at least a fifth of the step, the share of its cost the
    overlap hid, (plain - overlap) / (plain - alone), over the rounds' medians."""
    from stats import mean_ci
    out = ["| model | link | gradient | its sum alone | step, no communication | allreduce after the backward | "
           "overlapped | overlapped − after (95 % CI) | cost hidden |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (model, link), rr in sorted(_rounds(rows).items(), key=lambda kv: (kv[0][0], -(kv[0][1] or 1e9))):
        step = {m: _median(r[m]["step_max_ms"] for r in rr) for m in ("alone", "plain", "overlap")}
        d, h = mean_ci([r["overlap"]["step_max_ms"] - r["plain"]["step_max_ms"] for r in rr])
        cost = step["plain"] - step["alone"]
        hidden = f"{100 * (step['plain'] - step['overlap']) / cost:.0f} %" if cost >= 0.2 * step["alone"] else \
            "— (the sum costs under a fifth of the step)"
        out.append(f"| {model} | {_link(link)} | {rr[0]['grad_bytes'] / 2 ** 20:.1f} MiB | "
                   f"{_median(r['allreduce_alone_ms'] for r in rr):.1f} ms | {step['alone']:.1f} ms | "
                   f"{step['plain']:.1f} ms | {step['overlap']:.1f} ms | {d:+.1f} ms (± {h:.1f}) | {hidden} |")
    r0 = rows[-1]
    batches = ", ".join(f"{m} {b}" for m, b in sorted({(r["model"], r["batch"]) for r in rows}))
    out += ["", f"Two hosts (network namespaces joined by veth pairs, TCP), one rank each with 1 thread; steps "
                f"of batch {batches} (each rank half), medians of {r0['steps']} steps "
                f"× {len(rr)} interleaved rounds, the slower rank's time. CPU: "
                f"{'; '.join(sorted({r['cpu'] for r in rows}))}; commit {r0['commit']}."]
    return "\n".join(out)


def mpi_zero(rows: list[dict]) -> str:
    """The sharded optimizer against the whole one, per rank, at 2 ranks, and scaled to 8."""
    out = ["| model | link | AdamW update per rank: whole / sharded | moments per rank: whole / sharded | "
           "at 8 ranks, sharded (scaled) | step: allreduce / sharded (reduce-scatter + allgather) |",
           "| --- | --- | --- | --- | --- | --- |"]
    for (model, link), rr in sorted(_rounds(rows).items(), key=lambda kv: (kv[0][0], -(kv[0][1] or 1e9))):
        if link not in (None, 1.0):
            continue
        up = {m: _median(r[m]["update_ms"] for r in rr) for m in ("plain", "sharded")}
        mom = {m: rr[0][m]["moments_bytes"] for m in ("plain", "sharded")}
        step = {m: _median(r[m]["step_max_ms"] for r in rr) for m in ("plain", "sharded")}
        ranks = rr[0]["ranks"]
        out.append(f"| {model} | {_link(link)} | {up['plain']:.1f} / {up['sharded']:.1f} ms | "
                   f"{mom['plain'] / 2 ** 20:.1f} / {mom['sharded'] / 2 ** 20:.1f} MiB | "
                   f"{up['sharded'] * ranks / 8:.1f} ms, {mom['sharded'] * ranks / 8 / 2 ** 20:.1f} MiB | "
                   f"{step['plain']:.1f} / {step['sharded']:.1f} ms |")
    out += ["", "The same records as the table above. At 8 ranks each slice is a quarter of the 2-rank "
                "slice: the update (element-wise, one pass per entry) and the moments scale with it; the "
                "traffic does not change (an allreduce is a reduce-scatter and an allgather)."]
    return "\n".join(out)


def _parity(r: dict) -> list[str]:
    """A parity record's table (logits, loss, every gradient, the AdamW steps) and its line of
    losses, versions, CPU and commit: what the GPT-2 and the Llama comparisons share."""
    f64, s64, s32 = r["float64"], r["float64_steps"], r["float32_steps"]
    worst = max(f64["grads"], key=f64["grads"].get)
    return ["| what | largest difference | bound |", "| --- | ---: | ---: |",
            f"| logits, float64 (relative to the largest) | {f64['logits']:.1e} | 10⁻¹⁰ |",
            f"| loss, float64 (relative) | {f64['loss']:.1e} | 10⁻¹⁰ |",
            f"| every gradient, float64 ({len(f64['grads'])} tensors; the worst: `{worst}`) | "
            f"{f64['grad_max']:.1e} | 10⁻¹⁰ |",
            f"| loss at each of {r['steps']} AdamW steps, float64 (absolute) | {s64['max_abs_diff']:.1e} | 10⁻⁶ |",
            f"| loss at each of {r['steps']} AdamW steps, float32 (absolute) | {s32['max_abs_diff']:.1e} | 10⁻² |"]


def _parity_line(r: dict) -> str:
    s64 = r["float64_steps"]
    return (f"Losses, float64, step 1 → {r['steps']}: {s64['tbp'][0]:.6f} → {s64['tbp'][-1]:.6f} (PyTorch "
            f"{s64['torch'][0]:.6f} → {s64['torch'][-1]:.6f}). Weights: {r['weights']}; batch "
            f"{r['batch'][0]} × {r['batch'][1]}; torch {r['torch']}, transformers {r['transformers']}, NumPy "
            f"{r['numpy']}. CPU: {r['cpu']}; commit {r['commit']}.")


def gpt2_parity(rows: list[dict]) -> str:
    """The newest full-size comparison with transformers: each quantity's largest relative
    difference, and the AdamW steps' largest loss difference (the reduced shape of the suite's
    fixture, --small, is not this table's)."""
    r = [x for x in rows if x["config"]["n_layer"] == 12][-1]
    return "\n".join(_parity(r) + ["", _parity_line(r)])


def llama_parity(rows: list[dict]) -> str:
    """The newest comparison with transformers' LlamaForCausalLM at SmolLM2-135M's shape: as
    gpt2_parity, and the same float64 comparison with transformers as shipped (its float32 steps)."""
    r = [x for x in rows if x["shape"]["n_layer"] == 30][-1]
    shipped = r["float64_as_shipped"]
    return "\n".join(_parity(r) + [f"| logits / every gradient, float64 against transformers as shipped | "
                                   f"{shipped['logits']:.1e} / {shipped['grad_max']:.1e} | (its float32 steps) |",
                                   "", _parity_line(r)])


def llama_lora(rows: list[dict]) -> str:
    """The newest LoRA-step comparison at SmolLM2-135M's shape: median step time and peak memory
    per arm, and tbp's ratio to PyTorch + peft with and without recomputation."""
    r = rows[-1]
    m = r["medians"]
    names = {"tbp": "tbp", "tbp-recompute": "tbp `--recompute`", "torch": "PyTorch + peft",
             "torch-checkpointing": "PyTorch + peft, gradient checkpointing"}
    out = ["| arm | step (median) | peak memory | steps/s against PyTorch + peft |", "| --- | ---: | ---: | ---: |"]
    for arm, name in names.items():
        if arm in m:
            peer = m["torch-checkpointing" if "recompute" in arm or "checkpointing" in arm else "torch"]
            out.append(f"| {name} | {m[arm]['step_s']:.2f} s | {m[arm]['peak_bytes'] / 2 ** 30:.2f} GiB | "
                       f"{peer['step_s'] / m[arm]['step_s']:.2f}× |")
    out += ["", f"B {r['batch'][0]} × T {r['batch'][1]}, rank {r['rank']} (alpha {r['alpha']:g}) on every projection, "
                f"AdamW on the adapters; {r['threads']} threads; medians of {r['rounds']} interleaved rounds, each arm "
                f"in a fresh process ({r['steps'] - 1} timed steps after a warmup). torch {r['torch']}, "
                f"transformers {r['transformers']}, peft {r['peft']}. CPU: {r['cpu']}; commit {r['commit']}. "
                f"A recomputing arm is compared with PyTorch's checkpointing arm."]
    return "\n".join(out)


TABLES = {"prepare_paired": (prepare_paired, "prepare_paired"), "prepare_scale": (prepare_scale, "prepare_scale"), "bpe_encode": (bpe_encode, "bpe_encode"),
          "attnres_sweep": (attnres_sweep, "attnres_depth"), "attnres_depth": (attnres_depth, "attnres_depth"),
          "attnres_timing": (attnres_timing, "attnres_timing"),
          "attnres_localise": (attnres_localise, "attnres_localise"), "attnres_at_budget": (attnres_at_budget, "attnres_curves"),
          "mpi_overlap": (mpi_overlap, "mpi_hosts"), "mpi_zero": (mpi_zero, "mpi_hosts"),
          "sparse_crossover": (tables_sparse.sparse_crossover, "sparse_crossover"),
          "sparse_repeats": (tables_sparse.sparse_repeats, "sparse_crossover"),
          "retrieval": (tables_sparse.retrieval, "retrieval"),
          "retrieval_depth": (tables_sparse.retrieval_depth, "retrieval"),
          "retrieval_train": (tables_sparse.retrieval_train, "retrieval_train"), "sparse_text": (tables_sparse.sparse_text, "sparse_text"),
          "mta_timing": (tables_mta.timing, "mta_timing"), "mta_sweep": (tables_mta.sweep, "mta_find_block"),
          "mta_seeds": (tables_mta.seeds, "mta_find_block"), "mta_matched": (tables_mta.matched, "mta_find_block"),
          "gatt_keeps": (tables_gatt.keeps, "ghost_attention"), "gatt_paired": (tables_gatt.paired, "ghost_attention"),
          "gatt_parts": (tables_gatt.parts, "ghost_attention"),
          "gatt_attention": (tables_gatt.attention, "ghost_attention"),
          "gatt_ft_keeps": (tables_gatt.keeps, "ghost_attention_ft"), "gatt_ft_paired": (tables_gatt.paired, "ghost_attention_ft"),
          "precision_quality": (tables_precision.quality, "precision_quality"),
          "precision_speed": (tables_precision.speed, "precision_speed"),
          "precision_products": (tables_precision.products, "precision_products"),
          "decode_weights": (tables_precision.decode_weights, "decode_weights"),
          "decode_int8": (tables_precision.decode_int8, "decode_int8"),
          "decode_layout": (tables_precision.decode_layout, "decode_layout"),
          "gpt2_parity": (gpt2_parity, "gpt2_parity"), "llama_parity": (llama_parity, "llama_parity"),
          "llama_lora": (llama_lora, "llama_lora"),
          "gqa_quality": (tables_gqa.quality, "gqa_quality"), "gqa_speed": (tables_gqa.speed, "gqa_speed"),
          "gqa_uptrain": (tables_gqa.uptrain, "gqa_uptrain"),
          "gguf_agree": (tables_interop.gguf_agree, "gguf_agree"), "gguf_speed": (tables_interop.gguf_speed, "gguf_speed"),
          "serve_load": (tables_interop.serve_load, "serve_load"),
          "serve_soak": (tables_interop.serve_soak, "serve_soak"),
          "serve_matrix": (tables_interop.serve_matrix, "serve_matrix"),
          "speculative": (tables_speculative.speculative, "speculative"),
          "speculative_costs": (tables_speculative.costs, "speculative_costs"),
          "speedrun": (tables_speedrun.budgets, "speedrun"),
          "nanogpt_step": (tables_speedrun.engines, "nanogpt_step"),
          "defaults": (tables_speedrun.defaults, "defaults"),
          "recompute_memory": (tables_gpt2.recompute_memory, "recompute_memory"),
          "gpt2_generation": (tables_gpt2.gpt2_generation, "gpt2_generation"),
          "llmc_race": (tables_gpt2.llmc_race, "llmc_race"),
          "alibi_positions": (tables_alibi.positions, "alibi_positions"),
          "flash_long_context": (tables_designs.flash_long_context, "flash_long_context"),
          "seq2seq_curves": (tables_designs.seq2seq_curves, "seq2seq_curves"),
          "paired_torch": (tables_speed.paired_torch, "paired_torch"),
          "compare_torch": (tables_speed.compare_torch, "compare_torch"), "ops": (tables_speed.ops, "ops"),
          "kv_cache": (tables_speed.kv_cache, "kv_cache"), "gpt2_124m": (tables_speed.gpt2_124m, "gpt2_124m"),
          "sliding_generation": (tables_speed.sliding_generation, "sliding_generation"),
          "mpi_measured": (tables_speed.mpi_measured, "mpi_scaling"),
          "mpi_projection": (tables_speed.mpi_projection, "mpi_scaling")}


def render(text: str) -> str:
    for name, (make, source) in TABLES.items():
        rows = records.read(source)
        if not rows:
            continue
        pattern = re.compile(rf"(<!-- report:{name} -->\n)(.*?)(<!-- /report:{name} -->)", re.S)
        text = pattern.sub(lambda m: m.group(1) + make(rows) + "\n" + m.group(3), text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a table differs from the records")
    args = ap.parse_args()
    stale = []
    for page in pages():
        old = page.read_text(encoding="utf-8")
        new = render(old)
        if new == old:
            continue
        name = page.relative_to(ROOT).as_posix()
        if args.check:
            stale.append(name)
        else:
            page.write_text(new, encoding="utf-8")
            print(f"{name}: tables rewritten from benchmarks/results/")
    if stale:
        sys.exit(f"{', '.join(stale)}: a results table differs from benchmarks/results/; "
                 f"run python benchmarks/report.py")


if __name__ == "__main__":
    main()
