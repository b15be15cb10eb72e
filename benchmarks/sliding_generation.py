"""Generation far past the context: tokens/s in blocks, rotary (sliding cache) vs learned (refill).

With learned positions the KV cache cannot slide: every n_ctx / 2 tokens it is refilled by a
prefill of the last n_ctx / 2 tokens, and tokens/s dips there. With rotary positions the cache
is a ring over the last n_ctx positions and every token costs the same. This script generates
--tokens tokens at batch 1 from a one-token prompt with random weights (speed does not depend
on them) and prints tokens/s per block of --block tokens, for both.

    python benchmarks/sliding_generation.py --tokens 5000 --n-ctx 1024
"""
import argparse
import json
import time

import numpy as np

from tbp import GPT, ModelConfig
from tbp.generate import Sampling, generate_ids


def blocks(positions: str, a) -> list[float]:
    cfg = ModelConfig(vocab_size=65, n_ctx=a.n_ctx, n_layer=4, n_head=4, d_model=128, positions=positions)
    model = GPT(cfg, seed=0)
    stamps = [time.perf_counter()]
    for _ in generate_ids(model, [0], a.tokens, Sampling(1.0), np.random.default_rng(0)):
        stamps.append(time.perf_counter())
    per_token = np.diff(stamps)
    return [a.block / per_token[i:i + a.block].sum() for i in range(0, a.tokens - a.block + 1, a.block)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=5000)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--block", type=int, default=250)
    a = p.parse_args()
    out = {}
    for positions in ("rope", "learned"):
        out[positions] = blocks(positions, a)
        rates = out[positions]
        print(f"{positions:8s} tokens/s per {a.block}-token block: min {min(rates):.0f}, median "
              f"{np.median(rates):.0f}, max {max(rates):.0f}", flush=True)
        print("         " + " ".join(f"{r:.0f}" for r in rates), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
