"""The speculative-decoding table: each arm's speed against plain decoding, by model, prompt and temperature."""
import statistics

import records


def speculative(rows: list[dict]) -> str:
    """The newest record per (model, prompt, temperature): tokens/s of each arm, its speed-up over
    plain decoding in the same rounds, what was kept, and whether the text was plain decoding's."""
    rows = records.newest(rows, lambda r: (r["checkpoint"], r["prompt"], r["temperature"]))
    arms = [a for a in ("lookup", "draft") if any(a in r["arms"] for r in rows)]
    out = ["| model (validation loss) | prompt | temperature | plain tokens/s | "
           + " | ".join(f"{a}: × plain (min–max of rounds), kept, tokens a forward" for a in arms)
           + " | distinct-2 | text = plain's |",
           "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in arms) + " | ---: | --- |"]
    for r in rows:
        m = r["model"]
        cells = []
        for a in arms:
            v = r["arms"].get(a)
            if v is None:
                cells.append("–")
                continue
            per = v["speedup_per_round"]
            cells.append(f"×{v['speedup']:.2f} ({min(per):.2f}–{max(per):.2f}), "
                         f"{v['acceptance'] or 0:.0%}, {v['tokens_per_forward']:.2f}")
        same = all(v.get("same_as_plain", True) for v in r["arms"].values())
        loss = r["target_val_loss"]
        loss = f"{loss:.3f}" if loss is not None else f"estimate {r.get('target_val_estimate') or float('nan'):.3f}"
        out.append(f"| {m['n_layer']} × {m['d_model']} ({loss}) | {r['prompt']} | "
                   f"{r['temperature']:g} | {r['arms']['plain']['tokens_per_s']:,.0f} | " + " | ".join(cells)
                   + f" | {r['arms']['plain']['distinct2']:.2f} | {'yes' if same else 'no'} |")
    r = rows[-1]
    drafts = sorted({f"{x['draft']} ({x['draft_model']['n_layer']} × {x['draft_model']['d_model']})"
                     for x in rows if x.get("draft")})
    out += ["", f"Batch 1, {r['new_tokens']} new tokens from each prompt of `benchmarks/prompts/speculative.jsonl`, "
                f"the arms interleaved over {r['rounds']} rounds in one process, medians; the speed-up is plain "
                f"decoding's time over the arm's in each round. Lookup: n-gram 3, up to 8 tokens; draft: "
                f"{', '.join(drafts) or 'none'}, up to 4 tokens; the draft length then follows the measured "
                f"costs. \"Text = plain's\": every arm's text equal to plain decoding's with the same seed. "
                f"{records.provenance(rows)} `benchmarks/speed/speculative.py`."]
    return "\n".join(out)


def costs(rows: list[dict]) -> str:
    """The newest record per model: a forward over m tokens against one token's."""
    rows = records.newest(rows, lambda r: r["checkpoint"])
    ms = sorted({int(m) for r in rows for m in r["forward_s"]})
    out = ["| model | one token | " + " | ".join(f"{m} tokens" for m in ms[1:]) + " |",
           "| --- | ---: | " + " | ".join("---:" for _ in ms[1:]) + " |"]
    for r in sorted(rows, key=lambda r: r["forward_s"]["1"]):
        m, f = r["model"], r["forward_s"]
        one = f["1"]
        out.append(f"| {m['n_layer']} × {m['d_model']}, vocabulary {m['vocab_size']:,} | {one * 1e3:.2f} ms | "
                   + " | ".join(f"×{f[str(k)] / one:.2f}" for k in ms[1:]) + " |")
    out += ["", "The time of one forward over m tokens at batch 1 after a 64-token prefill (what checking m − 1 "
                "drafts costs), as a multiple of one token's; medians of 21 rounds, the sizes interleaved. "
                f"{records.provenance(rows)} `benchmarks/speed/speculative.py --costs`."]
    return "\n".join(out)
