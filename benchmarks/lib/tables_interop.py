"""The tables of models that leave tbp: GGUF files in llama.cpp, and tbp serve under load."""
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
    rows = records.newest(rows, lambda r: (r["checkpoint"], r["threads"]))
    out = ["| model | threads | tbp (float32) | llama.cpp f32 | llama.cpp f16 | llama.cpp q8_0 |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        t = r["tokens_per_s"]
        out.append(f"| `{r['checkpoint']}`: {_shape(r['model'])} | {r['threads']} | {t['tbp']:,.0f} | "
                   f"{t['f32']:,.0f} | {t['f16']:,.0f} | {t['q8_0']:,.0f} |")
    out += ["", "Tokens per second, batch 1, greedy, after a 16-token prompt: "
                + "; ".join(sorted({f"`{r['checkpoint']}` {r['new_tokens']} new tokens, median of {r['rounds']}"
                                    for r in rows}))
                + ", the programs interleaved in each round. tbp's products through NumPy's BLAS; llama.cpp "
                  f"through llama-cpp-python {rows[-1]['llama_cpp_python']}, one Python call per token for both. "
                  f"{records.provenance(rows)} `benchmarks/peers/gguf_check.py speed`."]
    return "\n".join(out)


def serve_load(rows: list[dict]) -> str:
    """The newest load test: each setting's throughput, latency and errors."""
    r = rows[-1]
    out = ["| clients | --parallel | requests | tokens/s (all clients) | latency p50 / p99 | first text p50 / p99 | "
           "errors | answers unlike alone |",
           "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in r["settings"].values():
        out.append(f"| {s['clients']} | {s['parallel']} | {s['requests']:,} | {s['tokens_per_s']:,.0f} | "
                   f"{s['latency_p50_s']:.2f} / {s['latency_p99_s']:.2f} s | "
                   f"{s['ttft_p50_s'] * 1000:.0f} / {s['ttft_p99_s'] * 1000:.0f} ms | {s['errors']} | "
                   f"{s['mismatched_answers']} |")
    out += ["", f"Each client streams completions of {r['max_tokens']} tokens back to back for {r['seconds']:.0f} s "
                f"on loopback, drawn from {r['pairs']} fixed (prompt, seed) pairs whose answers were first asked "
                f"alone; every answer under load is compared with its pair's. Model: `{r['checkpoint']}`; the "
                f"clients in one process, the server in another, on the same cores. CPU: {r['cpu']}; commit {r['commit']}. "
                f"`benchmarks/speed/serve_load.py`."]
    return "\n".join(out)
