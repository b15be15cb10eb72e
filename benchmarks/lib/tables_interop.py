"""The tables of models that leave tbp: GGUF files in llama.cpp, and tbp serve under load."""
import statistics
import records


def _shape(m: dict) -> str:
    return f"{m['n_layer']} × {m['d_model']}, context {m['n_ctx']}, vocabulary {m['vocab_size']:,}"


def gguf_agree(rows: list[dict]) -> str:
    """The newest record per (checkpoint, type): logits, loss and greedy text against tbp."""
    rows = records.newest(rows, lambda r: (r["checkpoint"], r["type"]))
    out = ["| file | size | largest logit difference (vs tbp exact / vs tbp with llama.cpp's GELU table) | "
           "loss, tbp → llama.cpp (nats) | greedy 64 tokens identical |",
           "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| `{r['checkpoint']}` {r['type']} | {r['bytes'] / 2 ** 20:.2f} MiB | "
                   f"{r['logits_vs_exact']:.1e} / {r['logits_vs_gelu_table']:.1e} | "
                   f"{r['loss_tbp_float64']:.6f} → {r['loss_llama_cpp']:.6f} | "
                   f"{r['greedy_identical']} of {r['greedy_prompts']} |")
    r = rows[-1]
    out += ["", f"Logit differences relative to the largest logit, over the {r['windows']} windows of the "
                f"validation split ({r['tokens']:,} positions); losses over the same positions (tbp in float64). "
                f"Model: {_shape(r['model'])}, a {r['tokenizer']} tokenizer. llama-cpp-python {r['llama_cpp_python']} "
                f"(float32 KV cache), gguf {r['gguf']}. {records.provenance(rows)} "
                f"`benchmarks/peers/gguf_check.py agree`."]
    return "\n".join(out)


def gguf_speed(rows: list[dict]) -> str:
    """The newest record per (checkpoint, threads): batch-1 decoding, tbp and llama.cpp per file type."""
    # per machine too: who wins changes with the CPU (records made before the SIMD was recorded say so)
    rows = records.newest(rows, lambda r: (r["cpu"], r.get("simd"), r["checkpoint"], r["threads"]))
    out = ["| CPU | model | threads | tbp (float32) | llama.cpp f32 | llama.cpp f16 | llama.cpp q8_0 |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        t = r["tokens_per_s"]
        # a row whose tbp timing included folding the weights for decoding (older records) is marked
        fold = "" if r.get("tbp_fold") == "before timing" else " *"
        out.append(f"| {r['cpu']} ({r.get('simd') or 'SIMD not recorded'}) | `{r['checkpoint']}`: {_shape(r['model'])} | {r['threads']} | "
                   f"{t['tbp']:,.0f}{fold} | {t['f32']:,.0f} | {t['f16']:,.0f} | {t['q8_0']:,.0f} |")
    out += ["", "Tokens per second, batch 1, greedy, after a 16-token prompt: "
                + "; ".join(sorted({f"`{r['checkpoint']}` {r['new_tokens']} new tokens, median of {r['rounds']}"
                                    for r in rows}))
                + ", the programs interleaved in each round. tbp's products through NumPy's BLAS; llama.cpp "
                  f"through llama-cpp-python {rows[-1]['llama_cpp_python']}, one Python call per token for both. "
                  "Each program's preparation is made before timing: llama.cpp's load of the file, and tbp's fold "
                  "of the layer norms into the weights (in the rows marked *, tbp's fold was timed in each round). "
                  f"{records.provenance(rows)} `benchmarks/peers/gguf_check.py speed`."]
    return "\n".join(out)


def serve_load(rows: list[dict]) -> str:
    """The alternated load rounds: for each model, load beside the server and BLAS threads (the
    newest record of each), --parallel 1 against --parallel N over the rounds."""
    latest = {}
    for r in rows:
        if "summary" in r:               # the rounds' records (older ones measured one setting after another)
            latest[(r["checkpoint"], r["busy_core"], r["threads"])] = r
    out = ["| model | beside it | --threads | rounds | tokens/s, --parallel 1 | tokens/s, --parallel N | "
           "ratio, worst / median round | slowest answer / its round's median | errors | answers unlike alone |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (name, busy, threads), r in sorted(latest.items(), key=lambda kv: (kv[1]["model"]["d_model"] or 0, kv[0][1], kv[0][2])):
        m, n = r["model"], r["parallel"]
        one = statistics.median(x["parallel 1"]["tokens_per_s"] for x in r["per_round"])
        many = statistics.median(x[f"parallel {n}"]["tokens_per_s"] for x in r["per_round"])
        s = r["summary"]
        out.append(f"| {m['n_layer']} × {m['d_model']}, vocabulary {m['vocab_size']:,} | "
                   f"{'a core kept busy' if busy else 'nothing'} | {threads} | {r['rounds']} | {one:,.0f} | "
                   f"{many:,.0f} (N = {n}) | {s['ratio_min']:.2f} / {s['ratio_median']:.2f} | "
                   f"{s['worst_max_over_median_latency']:.2f} | {s['errors']} | {s['mismatched_answers']} |")
    shown = list(latest.values())
    r = shown[-1]
    shares = "; ".join(sorted({f"{x['seconds']:.0f} s at {x['model']['n_layer']} × {x['model']['d_model']}" for x in shown}))
    out += ["", f"{r['clients']} clients stream completions of {r['max_tokens']} tokens back to back on loopback, "
                f"drawn from {r['pairs']} fixed (prompt, seed) pairs whose answers were first asked alone; every "
                f"answer under load is compared with its pair's. Each round gives each setting its share of time "
                f"({shares}), the order alternating; the two servers run as `tbp serve` processes, the clients in "
                f"a third, all on the same cores. \"A core kept busy\": one more process spinning throughout. "
                f"{records.provenance(shown)} `benchmarks/speed/serve_load.py`."]
    return "\n".join(out)


def serve_matrix(rows: list[dict]) -> str:
    """The newest client-count by --parallel grid: median tokens/s (the worst round), slowest answer."""
    r = rows[-1]
    counts = sorted({c["clients"] for c in r["cells"]})
    settings = sorted({c["parallel"] for c in r["cells"]})
    cell = {(c["clients"], c["parallel"]): c for c in r["cells"]}
    out = ["| clients | " + " | ".join(f"--parallel {p}: tokens/s (worst round), slowest answer" for p in settings) + " |",
           "| ---: | " + " | ".join("---:" for _ in settings) + " |"]
    for n in counts:
        out.append(f"| {n} | " + " | ".join(
            f"{cell[(n, p)]['tokens_per_s']:,.0f} ({cell[(n, p)]['tokens_per_s_min']:,.0f}), {cell[(n, p)]['latency_max_s']:.2f} s"
            for p in settings) + " |")
    m = r["model"]
    errors = sum(c["errors"] for c in r["cells"])
    wrong = sum(c["mismatched_answers"] for c in r["cells"])
    out += ["", f"Model {m['n_layer']} × {m['d_model']} (`{r['checkpoint']}`), completions of {r['max_tokens']} tokens, "
                f"{r['rounds']} rounds of {r['seconds']:.0f} s per cell, the three servers' order alternating; "
                f"{errors} errors, {wrong} answers unlike the same request alone. {records.provenance([r])} "
                f"`benchmarks/speed/serve_load.py --matrix`."]
    return "\n".join(out)


def serve_soak(rows: list[dict]) -> str:
    """Every soak of tbp serve (benchmarks/reliability/serve_soak.py), oldest first: the fresh
    client's worst and median answer, /health's worst, the answers and the wrong ones, memory."""
    out = ["| commit | minutes | load | fresh client, worst / median | /health, worst | answers (wrong) | "
           "resident memory, after 1 min → end | exit |",
           "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        health = f"{r['health_max_s']:.2f} s" if r.get("health_max_s") is not None else "—"
        out.append(f"| {r['commit']} | {r['minutes']:g} | {r['clients']} clients, {r['idle_sockets']:,} idle sockets, "
                   f"{r['tricklers']} tricklers | {r['probe_max_s']:.2f} s / {r['probe_p50_s']:.2f} s | {health} | "
                   f"{r['answers']:,} ({r['wrong']}) | {r['rss_after_1min_mib']:.1f} → {r['rss_end_mib']:.1f} MiB | "
                   f"{r['exit_code']} |")
    m = rows[-1].get("model")
    model = f"a {m['n_layer']} × {m['d_model']} model" if m else "the default run's model (4 × 128)"
    out += ["", f"`tbp serve --parallel {rows[-1]['parallel']}` with {model} under `ulimit -n 1024`, on loopback: the clients ask completions of {rows[-1]['max_tokens']} tokens "
                f"back to back and compare each answer with the same request asked alone; the idle sockets are "
                f"reopened as the server closes them; half the tricklers send headers a byte a second, half a "
                f"body; a fresh client asks /health and a short completion every two seconds on new connections. "
                f"{records.provenance(rows)} `benchmarks/reliability/serve_soak.py`."]
    return "\n".join(out)
