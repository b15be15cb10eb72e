"""The speed tables of docs/reference/performance.md and benchmarks/README.md, from the records
of paired_torch.py, compare_torch.py, ops.py, kv_cache.py, gpt2_124m.py and sliding_generation.py.
Each table shows the newest record of each row and names the CPU and commit it ran on."""
import statistics

import records


def _foot(rows: list[dict], how: str, command: str) -> list[str]:
    return ["", f"{how} {records.provenance(rows)}",
            "", f"`{command}`"]


def _case(label: str) -> str:
    """paired_torch's label, e.g. "train 4L-128 V65 T64 B12, 2 thread(s)", as the table says it."""
    if label.startswith("generate"):
        _, shape, ctx, batch = label.split()
        layers, width = shape.split("-")
        return f"generation, {layers[:-1]} × {width}, context {ctx[1:]}, batch {batch[1:]}"
    head, threads = label.split(", ")
    _, shape, vocab, ctx, batch = head.split()
    layers, width = shape.split("-")
    return (f"training, {layers[:-1]} × {width}, vocabulary {int(vocab[1:]):,}, context {ctx[1:]}, "
            f"batch {batch[1:]}, {threads.replace('(s)', 's' if not threads.startswith('1 ') else '')}")


def paired_torch(rows: list[dict]) -> str:
    """tbp (and tbp + MKL) against PyTorch in one process, taking turns: the median of the
    per-round ratios with its quartiles, and PyTorch's tokens/s."""
    rows = records.newest(rows, lambda r: r["label"])
    has_mkl = any("tbp+mkl" in r["arms"] for r in rows)
    out = ["| case | tbp / PyTorch | " + ("tbp + MKL / PyTorch | " if has_mkl else "") + "tbp, tokens/s | "
           "PyTorch, tokens/s |", "| --- | --- | " + ("--- | " if has_mkl else "") + "---: | ---: |"]
    for r in rows:
        arms = r["arms"]

        def ratio(name):
            if name not in arms:
                return "(the same code)" if name == "tbp+mkl" else "—"
            q = arms[name]["quartiles"]
            return f"{arms[name]['ratio']:.2f}× ({q[0]:.2f}–{q[1]:.2f})"
        out.append(f"| {_case(r['label'])} | {ratio('tbp')} | " + (f"{ratio('tbp+mkl')} | " if has_mkl else "")
                   + f"{arms['tbp']['tokens_per_s']:,.0f} | {arms['torch']['tokens_per_s']:,.0f} |")
    rounds = sorted({r["rounds"] for r in rows})
    return "\n".join(out + _foot(rows, f"A ratio above 1: tbp is faster. Medians of {', '.join(map(str, rounds))} "
                                       f"rounds in which the engines take turns (the order reversed each round); "
                                       f"quartiles of the per-round ratios in brackets. PyTorch "
                                       f"{', '.join(sorted({r['torch'] for r in rows}))}.",
                                 "PYTHONPATH=. .torchenv/bin/python benchmarks/peers/paired_torch.py --mkl "
                                 ".venv/lib/libmkl_rt.so.3 --threads 2,1 --record"))


def compare_torch(rows: list[dict]) -> str:
    """Each engine in a process of its own, alternated: medians of the repeats, tokens/s."""
    rows = records.newest(rows, lambda r: r["case"])
    out = ["| case | tbp, tokens/s | PyTorch, tokens/s | tbp / PyTorch | tbp's products |",
           "| --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        out.append(f"| {r['case']} | {r['tbp']:,.0f} | {r['torch']:,.0f} | {r['ratio']:.2f}× | {r['gemm_used']} |")
    repeats = sorted({len(r["tbp_runs"]) for r in rows})
    return "\n".join(out + _foot(rows, f"Medians of {', '.join(map(str, repeats))} runs of each engine, alternated.",
                                 "python benchmarks/peers/compare_torch.py --torch-python .torchenv/bin/python --repeats 5 "
                                 "--gemm numpy,auto"))


def ops(rows: list[dict]) -> str:
    """Per operation (forward + backward, one worker's rows, one thread), ms per step: each
    operation's median time times its count in a step (the linear layers' four products of
    every layer; a layer norm before each sublayer and the last), tbp with the faster of its
    libraries; then their sum."""
    rows = records.newest(rows, lambda r: (r["model"], r["op"]))
    models = list(dict.fromkeys(r["model"] for r in rows))
    per_step = {}
    for r in rows:
        tbp = min(r["numpy_ms"], r.get("mkl_ms", float("inf")))
        per_step[(r["model"], r["op"])] = (r["count"] * tbp, r["count"] * r["torch_ms"])
    out = ["| operation (ms a step) | " + " | ".join(f"{m}: tbp | {m}: PyTorch | {m}: tbp / PyTorch"
                                                     for m in models) + " |",
           "| --- |" + " ---: | ---: | ---: |" * len(models)]
    every = list(dict.fromkeys(r["op"] for r in rows))
    for name, parts in [*((op, (op,)) for op in every), ("sum", tuple(every))]:
        cells = []
        for m in models:
            got = [per_step[(m, op)] for op in parts if (m, op) in per_step]
            ours, theirs = sum(g[0] for g in got), sum(g[1] for g in got)
            cells.append(f"{ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}" if got else "— | — | —")
        label = f"**{name}**" if name == "sum" else name
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    shapes = "; ".join(f"{m}: {r['shape']['L']} × {r['shape']['C']}, context {r['shape']['T']}, "
                       f"{r['shape']['B'] // 2} sequences" for m, r in {r["model"]: r for r in rows}.items())
    libs = sorted({f"MKL {r['mkl']}" if r.get("mkl") else "NumPy's BLAS" for r in rows})
    return "\n".join(out + _foot(rows, f"{shapes} (one data-parallel worker's rows). Medians of "
                                       f"{', '.join(sorted({str(r['rounds']) for r in rows}))} rounds, the engines "
                                       f"alternated operation by operation; tbp with {', '.join(libs)} where faster "
                                       f"than NumPy's, PyTorch {', '.join(sorted({r['torch'] for r in rows}))} "
                                       f"through autograd.",
                                 "PYTHONPATH=. .torchenv/bin/python benchmarks/peers/ops.py --mkl .venv/lib/libmkl_rt.so.3"))


def kv_cache(rows: list[dict]) -> str:
    """Seconds to generate n tokens with and without the KV cache."""
    rows = records.newest(rows, lambda r: r["tokens"])
    out = ["| tokens | cached | uncached | uncached / cached |", "| ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['tokens']:,} | {r['cached_s']:.2f} s | {r['uncached_s']:.2f} s | "
                   f"{r['uncached_s'] / r['cached_s']:.0f}× |")
    c = rows[0]["config"]
    if len(rows) >= 2:
        a, b = rows[-2], rows[-1]
        growth = (f" From {a['tokens']:,} to {b['tokens']:,} tokens ({b['tokens'] / a['tokens']:.1f}×) the cached "
                  f"time grows {b['cached_s'] / a['cached_s']:.1f}×, the uncached {b['uncached_s'] / a['uncached_s']:.0f}×.")
    else:
        growth = ""
    return "\n".join(out + _foot(rows, f"{c['n_layer']} × {c['d_model']}, context {c['n_ctx']:,}, batch 1, from one "
                                       f"token; medians of {rows[0]['rounds']} rounds, cached and uncached in turn."
                                       + growth, "python benchmarks/speed/kv_cache.py"))


def gpt2_124m(rows: list[dict]) -> str:
    """GPT-2 124M's shape with random weights: memory, cached generation, a LoRA step."""
    r = rows[-1]
    gib = 2 ** 10
    # the first records counted the parameters after adding LoRA (base + adapters, the adapters
    # being the trainable ones); later ones record the base model's count
    base = r.get("base_params", r.get("params", 0) - r["trainable"])
    out = ["| what | figure |", "| --- | ---: |",
           f"| parameters | {base:,} ({base * 4 / 2 ** 20:,.0f} MiB of float32) |",
           f"| peak memory, built | {r['built_rss_mib'] / gib:.2f} GiB |",
           f"| cached generation, batch 1 | {r['generate_tokens'] / r['generate_s']:.1f} tokens/s "
           f"(KV cache {r['kv_cache_bytes'] / 2 ** 20:,.0f} MiB) |",
           f"| peak memory, generating | {r['generate_rss_mib'] / gib:.2f} GiB |",
           f"| LoRA rank {r['lora_rank']} step, batch 1 × {r['train_ctx']} tokens ({r['trainable']:,} trainable) | "
           f"{r['lora_step_s']:.2f} s ({r['train_ctx'] / r['lora_step_s']:.0f} tokens/s) |",
           f"| peak memory, LoRA step | {r['lora_rss_mib'] / gib:.2f} GiB |"]
    return "\n".join(out + _foot([r], f"Median of {len(r['lora_step_all'])} LoRA steps; generation from one token, "
                                      f"{r['generate_tokens']} tokens, top-k 40.", "python benchmarks/speed/gpt2_124m.py"))


def sliding_generation(rows: list[dict]) -> str:
    """Generation past the context: ms per token once the context is full, and the tokens/s
    of each block, for rotary positions (a sliding cache) and learned ones (refilled)."""
    rows = records.newest(rows, lambda r: r["positions"])
    out = ["| positions | past the context: median ms a token | p99 | max | tokens/s per block: lowest – highest |",
           "| --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        ms, rates = r["past_context_ms"], r["block_tokens_per_s"]
        out.append(f"| {r['positions']} | {ms['median']:.2f} | {ms['p99']:.2f} | {ms['max']:.1f} | "
                   f"{min(rates):,.0f} – {max(rates):,.0f} (median {statistics.median(rates):,.0f}) |")
    r = rows[0]
    return "\n".join(out + _foot(rows, f"4 × 128, context {r['n_ctx']:,}, {r['tokens']:,} tokens at batch 1 from one "
                                       f"token, blocks of {r['block']}; one run each.",
                                 "python benchmarks/speed/sliding_generation.py --tokens 5000 --n-ctx 1024"))


def _mpi_medians(rows: list[dict]) -> dict:
    """model -> layout -> the median of each phase over the newest commit's rounds."""
    newest = rows[-1]["commit"]
    out: dict = {}
    for r in rows:
        if r["commit"] == newest:
            out.setdefault(r["model"], {}).setdefault(r["layout"], []).append(r)
    return {m: {lay: {"rounds": rs, **{k: statistics.median(x[k] for x in rs)
                                        for k in ("step", "compute", "compute_max", "allreduce", "update")
                                        if k in rs[0]}}
                for lay, rs in layouts.items()} for m, layouts in out.items()}


def mpi_measured(rows: list[dict]) -> str:
    """One machine, 1 process x 2 threads against 2 ranks x 1 thread, phase by phase."""
    out = ["| model | 1 process × 2 threads | 2 ranks × 1 thread | Allreduce in the step (incl. waiting for the "
           "slower rank) | Allreduce of the gradient alone | 64 MiB in 4 MiB pieces / as one call |",
           "| --- | --- | --- | --- | --- | --- |"]
    medians = _mpi_medians(rows)
    for model, got in medians.items():
        one, two = got["1x2"], got["2x1"]
        r0 = one["rounds"][0]
        tokens, grad = r0["tokens_per_step"], r0["grad_bytes"]

        def alone(field, size):
            return statistics.median(r[field][str(size)] for r in two["rounds"])
        t = alone("allreduce_s_by_bytes", grad)
        big = int(next(iter(two["rounds"][0]["allreduce_one_call_s"])))
        out.append(f"| {model} | {one['step'] * 1e3:,.1f} ms ({tokens / one['step']:,.0f} tokens/s) | "
                   f"{two['step'] * 1e3:,.1f} ms ({tokens / two['step']:,.0f} tokens/s) | "
                   f"{two['allreduce'] * 1e3:.1f} ms ({two['allreduce'] / two['step']:.0%}) | "
                   f"{t * 1e3:.2f} ms for {grad / 2 ** 20:.1f} MiB ({grad / t / 1e9:.1f} GB/s) | "
                   f"{alone('allreduce_s_by_bytes', big) * 1e3:.1f} / {alone('allreduce_one_call_s', big) * 1e3:.1f} ms |")
    steps = sorted({r["steps"] for r in rows})
    n = max(len(x["rounds"]) for g in medians.values() for x in g.values())
    return "\n".join(out + _foot(rows, f"Medians of {', '.join(map(str, steps))} steps × {n} rounds, the layouts "
                                       f"alternating round by round.", "python benchmarks/mpi/mpi_scaling.py --rounds 5"))


def mpi_projection(rows: list[dict]) -> str:
    """The measured one-machine step plus a ring Allreduce of the gradient over M machines."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi"))
    from mpi_scaling import project
    med = _mpi_medians(rows)
    models = list(med)
    out = ["| machines | link | " + " | ".join(f"{m}: Allreduce | {m}: speed-up, batch per machine fixed | "
                                                f"{m}: global batch fixed" for m in models) + " |",
           "| --- | --- |" + " ---: | ---: | ---: |" * len(models)]
    for link in (1, 10):
        for M in (2, 4, 8):
            cells = []
            for m in models:
                one = med[m]["1x2"]
                comm = project(one["rounds"][0]["grad_bytes"], link, M)
                weak = M * one["step"] / (one["step"] + comm)
                strong = one["step"] / (one["compute"] / M + one["update"] + comm)
                cells.append(f"{comm * 1e3:,.1f} ms | {weak:.2f}× | {strong:.2f}×")
            out.append(f"| {M} | {link} Gbit/s | " + " | ".join(cells) + " |")
    return "\n".join(out + _foot(rows, "Projected from the medians above: each machine 1 process × 2 threads, a ring "
                                       "Allreduce of 2 (M − 1) / M of the gradient per machine at the link's rate plus "
                                       "50 µs a hop, after the backward.", "python benchmarks/mpi/mpi_scaling.py --rounds 5"))
