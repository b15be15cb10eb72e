"""Speculative decoding against plain decoding, batch 1: prompt lookup and a draft model, on the
fixed prompts of benchmarks/prompts/speculative.jsonl (prose, and text whose continuation copies).

    python benchmarks/speed/speculative.py --checkpoint checkpoints/pydoc --draft checkpoints/pydoc-draft --record

For each prompt and temperature the arms (plain, lookup, draft) run interleaved, --rounds times,
in one process; each decodes --new tokens from the prompt with the same seed. Recorded per arm:
the median tokens/s (the whole call: prefill, drafting, checking), its ratio to plain in the same
rounds, the acceptance rate and tokens per forward of the model, and the distinct-2 share of the
output (a looping model would otherwise pass for a fast one); and whether the text
equals plain decoding's with the same seed (it should, at every temperature). The target's
validation loss over the whole split is read from its run.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from tbp.check.bench import timed_decode
from tbp.generate.sampling import Sampling
from tbp.generate.speculative import Draft, Lookup
from tbp.runs import disk

PROMPTS = Path(__file__).resolve().parents[1] / "prompts" / "speculative.jsonl"


def distinct2(ids: list[int]) -> float:
    pairs = list(zip(ids, ids[1:]))
    return len(set(pairs)) / max(1, len(pairs))


def costs(model, rounds: int = 21, most: int = 9) -> dict:
    """Seconds of one forward over m = 1 .. most tokens at batch 1, after a 64-token prefill
    (what checking m - 1 drafts costs), medians of ``rounds``, the sizes interleaved."""
    from tbp.nn.decode import Inference
    dec = Inference(model, 1)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.vocab_size, (1, 64))
    times = {m: [] for m in range(1, most + 1)}
    for _ in range(rounds):
        for m in times:
            dec.reset()
            dec.forward(prompt)
            t0 = time.perf_counter()
            dec.forward(rng.integers(0, model.config.vocab_size, (1, m)))
            times[m].append(time.perf_counter() - t0)
    return {m: statistics.median(v) for m, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/pydoc")
    ap.add_argument("--draft", default=None, help="a smaller run of the same tokenizer (the draft arm)")
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--costs", action="store_true", help="only the cost of checking m tokens, m = 1 .. 9")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    model, tok, _ = disk.load_model(args.checkpoint)
    if args.costs:
        c = costs(model)
        print(" · ".join(f"{m}: {v * 1e3:.2f} ms (×{v / c[1]:.2f})" for m, v in c.items()))
        if args.record:
            records.append("speculative_costs", {
                "checkpoint": Path(args.checkpoint).name,
                "model": records.shape(args.checkpoint, ("n_layer", "d_model", "n_ctx", "vocab_size")),
                "forward_s": {str(m): v for m, v in c.items()}, "commit": records.commit()})
        return
    from tbp.nn.decode import Inference
    folds = Inference(model, 1)
    arms = {"plain": lambda: None, "lookup": lambda: Lookup(3, 8)}
    if args.draft:
        draft_model, _, _ = disk.load_model(args.draft)
        draft_folds = Inference(draft_model, 1)
        arms["draft"] = lambda: Draft(draft_model, 4, share=draft_folds)
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    last = [json.loads(line) for line in (Path(args.checkpoint) / "metrics.jsonl").read_text().splitlines()][-1]
    for p in prompts:
        ids = tok.encode(p["prompt"], "prompt")[-model.config.n_ctx:]
        for temperature in args.temperatures:
            sampling = Sampling(temperature)
            times = {a: [] for a in arms}
            out = {}
            for r in range(args.rounds):
                order = list(arms) if r % 2 == 0 else list(arms)[::-1]
                for a in order:
                    toks, dt, tally = timed_decode(model, ids, args.new, sampling, 1, arms[a](), folds)
                    times[a].append(dt)
                    out[a] = (toks, tally)
            plain = statistics.median(times["plain"])
            row = {}
            for a in arms:
                toks, tally = out[a]
                row[a] = {"tokens_per_s": args.new / statistics.median(times[a]),
                          "speedup": plain / statistics.median(times[a]),
                          "speedup_per_round": [tp / ta for tp, ta in zip(times["plain"], times[a])],
                          "distinct2": distinct2(toks), "text": tok.decode(toks)[:400],
                          "same_as_plain": toks == out["plain"][0],
                          **(tally.record() if a != "plain" else {})}
            print(p["name"], f"T={temperature}", " · ".join(
                f"{a} {v['tokens_per_s']:.0f} tok/s ×{v['speedup']:.2f}"
                + (f" (kept {v['acceptance']:.0%}, {v['tokens_per_forward']:.2f}/fwd)" if v.get("acceptance") is not None else "")
                for a, v in row.items()), flush=True)
            if args.record:
                records.append("speculative", {
                    "checkpoint": Path(args.checkpoint).name, "draft": Path(args.draft).name if args.draft else None,
                    "model": records.shape(args.checkpoint, ("n_layer", "d_model", "n_ctx", "vocab_size")),
                    "draft_model": records.shape(args.draft, ("n_layer", "d_model")) if args.draft else None,
                    "target_val_loss": last.get("val_split_loss"),
                    "target_val_estimate": last.get("val_loss"), "prompt": p["name"], "kind": p["kind"],
                    "temperature": temperature, "new_tokens": args.new, "rounds": args.rounds, "arms": row,
                    "fold": "before timing",         # older records: each decode folded the weights afresh
                    "commit": records.commit()})


if __name__ == "__main__":
    main()
