"""Generation far past the context: tokens/s in blocks, rotary (sliding cache) vs learned (refill).

With learned positions the KV cache cannot slide: every n_ctx / 2 tokens it is refilled by a
prefill of the last n_ctx / 2 tokens, and tokens/s dips there. With rotary positions the cache
is a ring over the last n_ctx positions and every token costs the same. This script generates
--tokens tokens at batch 1 from a one-token prompt with random weights (speed does not depend
on them) and prints tokens/s per block of --block tokens, for both.

    python benchmarks/speed/sliding_generation.py --tokens 5000 --n-ctx 1024

Each positions scheme is one record in results/sliding_generation.jsonl.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from tbp import GPT, ModelConfig
from tbp.generate.sampling import Sampling, generate_ids


def per_token_seconds(positions: str, a) -> np.ndarray:
    cfg = ModelConfig(vocab_size=65, n_ctx=a.n_ctx, n_layer=4, n_head=4, d_model=128, positions=positions)
    model = GPT(cfg, seed=0)
    stamps = [time.perf_counter()]
    for _ in generate_ids(model, [0], a.tokens, Sampling(1.0), np.random.default_rng(0)):
        stamps.append(time.perf_counter())
    return np.diff(stamps)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=5000)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--block", type=int, default=250)
    a = p.parse_args()
    for positions in ("rope", "learned"):
        t = per_token_seconds(positions, a)
        rates = [a.block / t[i:i + a.block].sum() for i in range(0, a.tokens - a.block + 1, a.block)]
        past = t[a.n_ctx:] * 1e3                      # ms per token once the context is full
        records.append("sliding_generation", {
            "commit": records.commit(), "positions": positions, "n_ctx": a.n_ctx, "tokens": a.tokens,
            "block": a.block, "block_tokens_per_s": rates, "past_context_ms": {
                "median": float(np.median(past)), "p99": float(np.percentile(past, 99)), "max": float(past.max())}})
        print(f"{positions:8s} past the context, ms per token: median {np.median(past):.2f}, "
              f"p99 {np.percentile(past, 99):.2f}, max {past.max():.1f}; tokens/s per {a.block}-token "
              f"block: {' '.join(f'{r:.0f}' for r in rates)}", flush=True)


if __name__ == "__main__":
    main()
