"""The tables of docs/how-to/precision.md, from results/precision_*.jsonl (see precision.py and
paired_torch.py --bf16)."""
import statistics

import records
import stats


def quality(rows: list[dict]) -> str:
    """Final whole-split validation loss per precision over the seeds, and bf16 - fp32 paired by
    seed. bf16 runs are evaluated with fp32 products (``evaluated_with``); the first bf16 records,
    evaluated with bf16 products, are their own row."""
    rows = [r for r in rows if not r.get("extra")]
    arms = {"fp32": lambda r: r["precision"] == "fp32",
            "bf16 (oneDNN)": lambda r: r["precision"] == "bf16" and r.get("evaluated_with") == "fp32"
            and r["products"].startswith("oneDNN"),
            "bf16 (MKL)": lambda r: r["precision"] == "bf16" and r.get("evaluated_with") == "fp32"
            and r["products"].startswith("MKL"),
            "bf16 (MKL), evaluated with bf16 products": lambda r: r["precision"] == "bf16" and "evaluated_with" not in r}
    by = {arm: {r["seed"]: r["val_split_loss"] for r in rows if keep(r)} for arm, keep in arms.items()}
    by = {arm: losses for arm, losses in by.items() if losses}
    out = ["| training products | evaluated with | seeds | validation loss, whole split (mean ± 95 % t) | "
           "− fp32, paired by seed |", "| --- | --- | ---: | ---: | ---: |"]
    for arm, losses in by.items():
        m, h = stats.mean_ci(list(losses.values()))
        d = "" if arm == "fp32" else "{:+.4f} ± {:.4f} ({})".format(
            *stats.paired(losses, by["fp32"])[:2],
            ", ".join(f"{losses[s] - by['fp32'][s]:+.4f}" for s in sorted(set(losses) & set(by["fp32"]))))
        evaluated = "bf16" if "evaluated with bf16" in arm else "fp32"
        out.append(f"| {arm.split(',')[0]} | {evaluated} | {len(losses)} | {m:.4f} ± {h:.4f} | {d} |")
    out += ["", f"Paired: the same initialisation and batches; the difference's mean ± 95 % t interval, then each "
                f"seed's. The default run: 4 × 128, context 128, 1,500 steps, {rows[0]['val_split_tokens']:,} "
                f"validation tokens, one thread a run (a run repeats bit for bit at a given thread count). "
                f"{records.provenance(rows)}"]
    return "\n".join(out)


ARMS = ("tbp", "tbp+mkl", "tbp-bf16", "torch", "torch-bf16")


def speed(rows: list[dict]) -> str:
    """Training tokens/s of every arm, paired in one process, with bf16's gain over fp32 in each
    engine: the newest record per case, thread count and library of tbp's bf16 products (the
    first records, without that field, ran MKL's)."""
    def library(r):
        return r.get("bf16_library") or ("mkl" if r.get("mkl") else "numpy twin")
    rows = records.newest(rows, lambda r: (library(r), r["case"], r["threads"]))
    rows.sort(key=lambda r: (library(r) != "onednn", ("small", "wide", "gpt2", "gpt2-1024").index(r["case"]), r["threads"]))
    out = ["| case | threads | tbp bf16 by | " + " | ".join(ARMS) + " | tbp bf16 / tbp fp32 | PyTorch bf16 / fp32 | "
           "tbp bf16 / PyTorch bf16 |", "| --- | ---: | --- |" + " ---: |" * (len(ARMS) + 3)]
    names = {"onednn": "oneDNN", "mkl": "MKL", "numpy twin": "NumPy twin"}
    for r in rows:
        arms = r["arms"]
        best32 = max(arms[a]["tokens_per_s"] for a in ("tbp", "tbp+mkl") if a in arms)
        cells = [f"{arms[a]['tokens_per_s']:,.0f}" if a in arms else "" for a in ARMS]
        out.append(f"| {r['label'].split(',')[0].removeprefix('train ')} | {r['threads']} | {names[library(r)]} | "
                   + " | ".join(cells) + f" | {arms['tbp-bf16']['tokens_per_s'] / best32:.2f}× | "
                   f"{arms['torch-bf16']['ratio']:.2f}× | {arms['tbp-bf16']['ratio_torch_bf16']:.2f}× |")
    out += ["", f"Tokens/s are medians over {', '.join(sorted({str(r['rounds']) for r in rows}))} rounds in which "
                f"the arms take turns (`benchmarks/peers/paired_torch.py --bf16`). The two PyTorch columns' ratios are "
                f"medians of the rounds' ratios; tbp bf16 / tbp fp32 is the ratio of the medians, fp32 being the "
                f"faster of tbp's two libraries (NumPy's OpenBLAS, `tbp`, or MKL, `tbp+mkl`). MKL "
                f"{', '.join(sorted({str(r['mkl']) for r in rows}))}, PyTorch {', '.join(sorted({r['torch'] for r in rows}))}; "
                f"bf16 units: {', '.join(sorted({str(r['bf16_units']) for r in rows}))}. {records.provenance(rows)}"]
    return "\n".join(out)


PRODUCT_ARMS = ("numpy sgemm", "mkl sgemm", "mkl bf16 with conversion", "mkl bf16 product alone",
                "onednn bf16 with conversion")


def products(rows: list[dict]) -> str:
    """GFLOP/s of each training product, one thread, fp32 and bf16, and the conversion's share."""
    out = ["| model | m × k × n | " + " | ".join(PRODUCT_ARMS) + " | NumPy's conversion, share of MKL's converted product |",
           "| --- | --- |" + " ---: |" * (len(PRODUCT_ARMS) + 1)]
    rows = records.newest(rows, lambda r: (r["model"], r["m"], r["k"], r["n"], tuple(r["transposed"])))
    for r in rows:
        share = r["ms"]["conversion alone"] / r["ms"]["mkl bf16 with conversion"]
        out.append(f"| {r['model']} | {r['m']} × {r['k']} × {r['n']} | "
                   + " | ".join(f"{r['gflops'][a]:.0f}" if a in r["gflops"] else "" for a in PRODUCT_ARMS)
                   + f" | {100 * share:.0f} % |")
    peak = statistics.median(r["peak_fp32_gflops"] for r in rows)
    out += ["", f"GFLOP/s, one thread, medians of {rows[0]['rounds']} paired rounds; this machine's float32 "
                f"matmul peak (1,024³, NumPy): {peak:.0f} GFLOP/s. MKL {', '.join(sorted({r['mkl'] for r in rows}))}"
                f"{'; oneDNN ' + ', '.join(sorted({r['onednn'] for r in rows if r.get('onednn')})) if any(r.get('onednn') for r in rows) else ''}; "
                f"bf16 units: {', '.join(sorted({str(r['bf16_units']) for r in rows}))}. {records.provenance(rows)}"]
    return "\n".join(out)


def decode_weights(rows: list[dict]) -> str:
    """One token's products at GPT-2 124M's shapes per weight storage and library, newest record
    per CPU, beside the machine's read bandwidth (decode_weights.py)."""
    out = []
    for r in records.newest(rows, lambda r: r["cpu"]):
        roof = r["read_gb_s"]["2"]
        out += [f"**{r['cpu']}** (bf16 units: {r['bf16_units'] or 'none'}; read bandwidth {r['read_gb_s']['1']:.1f} "
                f"GB/s on one thread, {roof:.1f} on two):", "",
                "| weights through | bytes per weight | ms per token | GB/s read | share of the two-thread read bandwidth |",
                "| --- | ---: | ---: | ---: | ---: |"]
        for name, a in r["arms"].items():
            out.append(f"| {name} | {a['bytes_per_weight']} | {a['ms_per_token']:.1f} | {a['gb_s']:.1f} | "
                       f"{a['gb_s'] / roof:.0%} |")
        out += ["", f"{r['weights'] / 1e6:.1f} M weights (12 blocks and the tied head of GPT-2 124M), one row "
                    f"vector each, batch 1; medians of {r['rounds']} rounds, the arms interleaved; NumPy's BLAS: "
                    f"{r['numpy_blas']}; MKL {r['mkl']}"
                    f"{'; oneDNN ' + r['onednn'] if r.get('onednn') else ''}; commit {r['commit']}.", ""]
    return "\n".join(out).rstrip()


def decode_int8(rows: list[dict]) -> str:
    """oneDNN's int8-weight product against NumPy's float32 one, one token at GPT-2 124M's shapes,
    newest record per CPU (decode_int8.py)."""
    out = ["| CPU | oneDNN | weights through | MB per token | ms per token | GB/s of its bytes |",
           "| --- | --- | --- | ---: | ---: | ---: |"]
    for r in records.newest(rows, lambda r: (r["cpu"], r.get("simd"))):
        for name, a in r["arms"].items():
            out.append(f"| {r['cpu']} ({r.get('simd') or '?'}) | {r['onednn']} | {name} | {a['mb']} | "
                       f"{a['ms_per_token']:.1f} | {a['gb_s']:.1f} |")
    out += ["", "Batch 1, 12 blocks and the head of GPT-2 124M; int8 weights quantised per output column, "
                "checked against the dequantised weights in float64 before timing; medians, the arms "
                f"interleaved. {records.provenance(rows)} `benchmarks/speed/decode_int8.py`."]
    return "\n".join(out)


def decode_layout(rows: list[dict]) -> str:
    """Each decoding product read in both forms, and the whole step with the MLP's c_proj read
    transposed or as stored, newest record per CPU (decode_layout.py)."""
    out = []
    for r in records.newest(rows, lambda r: (r["cpu"], r.get("simd"))):
        out += [f"**{r['cpu']}** ({r.get('simd') or '?'}), {r['threads']} BLAS threads:", "",
                "| product (in x out) | as stored, x @ W: GB/s | transposed, W^T x: GB/s |", "| --- | ---: | ---: |"]
        for p in r["products"]:
            out.append(f"| {p['product']} | {p['x @ W GB/s']:.1f} | {p['W^T x GB/s']:.1f} |")
        out += ["", "| decoding step, 12 x 768, vocabulary " f"{r['vocab']:,} | ms per token | tokens/s |",
                "| --- | ---: | ---: |"]
        for arm, a in r["step"].items():
            out.append(f"| {arm} | {a['ms_per_token']:.2f} | {a['tokens_per_s']:.1f} |")
        out.append("")
    out.append(f"Medians of {rows[-1]['rounds']} rounds, the arms interleaved. {records.provenance(rows)} "
               "`benchmarks/speed/decode_layout.py`.")
    return "\n".join(out)
