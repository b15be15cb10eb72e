"""The tables of GPT-2 124M at full size: full fine-tuning's memory, and generation."""
import records


def recompute_memory(rows: list[dict]) -> str:
    """The newest record per (context, recompute): peak memory against tbp's estimate, step time."""
    newest = {(r["context"], r["recompute"]): r for r in records.newest(rows, lambda r: (r["context"], r["recompute"]))}
    out = ["| B × T | --recompute | peak memory (measured) | estimate: weights + gradients + AdamW | estimate: activations | "
           "step | tokens/s |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (T, rc), r in sorted(newest.items()):
        e = r["estimate_bytes"]
        fixed = e["weights"] + e["gradients"] + e["AdamW moments"]
        out.append(f"| {r['batch']} × {T} | {'yes' if rc else 'no'} | {r['peak_rss_bytes'] / 2 ** 30:.2f} GiB | "
                   f"{fixed / 2 ** 30:.2f} GiB | {e['activations'] / 2 ** 30:.2f} GiB | {r['step_s_median']:.1f} s | "
                   f"{r['batch'] * T / r['step_s_median']:.0f} |")
    r = rows[-1]
    out += ["", f"Full fine-tuning steps (forward, backward, AdamW over all 124M weights) of a model of GPT-2 124M's "
                f"shape on random tokens, one thread, each configuration in a fresh process; peak memory is the "
                f"process's peak resident set (ru_maxrss); step time the median of steps 2-{r['steps']}. "
                f"{records.provenance(rows)} `benchmarks/speed/recompute_memory.py`."]
    return "\n".join(out)


def gpt2_generation(rows: list[dict]) -> str:
    """The newest record per prompt length: the first token's latency, then decoding speed."""
    newest = {r["prompt_tokens"]: r for r in records.newest(rows, lambda r: r["prompt_tokens"])}
    out = ["| prompt | first token (prefill and one sample) | then, tokens/s |", "| ---: | ---: | ---: |"]
    for n, r in sorted(newest.items()):
        out.append(f"| {n:,} token{'s' * (n != 1)} | {r['first_token_s'] * 1000:,.0f} ms | {r['decode_tokens_per_s']:.1f} |")
    r = rows[-1]
    out += ["", f"Batch 1, KV cache, greedy, random weights of GPT-2 124M's shape (context 1,024); {r['new_tokens']} "
                f"new tokens after each prompt, median of {r['rounds']}; threads: the machine's. "
                f"{records.provenance(rows)} `benchmarks/speed/gpt2_generation.py`."]
    return "\n".join(out)


def llmc_race(rows: list[dict]) -> str:
    """The newest record per context and thread count: tbp and llm.c's full fine-tuning steps,
    and the ratio."""
    newest = {(r["context"], r["threads"]): r for r in records.newest(rows, lambda r: (r["context"], r["threads"]))}
    out = ["| B × T | threads | tbp, tokens/s | llm.c, tokens/s | tbp ÷ llm.c | llm.c's first validation loss | tbp's, "
           "the same batches |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (T, t), r in sorted(newest.items()):
        out.append(f"| {r['batch']} × {T:,} | {t} | {r['tbp_tokens_per_s']:.1f} | {r['llmc_tokens_per_s']:.1f} | "
                   f"{r['tbp_tokens_per_s'] / r['llmc_tokens_per_s']:.2f}× | {r['val_loss_llmc']:.4f} | "
                   f"{r['val_loss_tbp']:.4f} |")
    shown = list(newest.values())
    r = shown[-1]
    out += ["", f"Full fine-tuning steps (forward, backward, AdamW) of GPT-2 124M's shape, the same random weights in "
                f"both; the median of each run's steps after a warm-up step ({', '.join(sorted({str(len(x['tbp_step_s'])) for x in shown}))} "
                f"steps). llm.c {r['llmc_commit']} `train_gpt2.c` ({r['llmc_flags']}; {r['gcc']}); the validation "
                f"losses show that the weights crossed over intact. "
                f"{records.provenance(shown)} `benchmarks/peers/llmc_race.py`."]
    return "\n".join(out)
