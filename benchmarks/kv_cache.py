"""What the KV cache buys: seconds to generate n tokens, cached vs uncached, 1024-token context.

With the cache each token costs one row of attention, so 4x the tokens should cost about 4x
the time; without it every token recomputes its whole window, so about 16x.

    python benchmarks/kv_cache.py [--n-layer 4 --d-model 128]
"""
import argparse
import time

import numpy as np

from tbp.generate import Sampling, generate_ids
from tbp.nn import GPT, ModelConfig


def seconds(model, n, use_cache):
    t = time.perf_counter()
    for _ in generate_ids(model, [0], n, Sampling(1.0), np.random.default_rng(0), 1, use_cache):
        pass
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-ctx", type=int, default=1024)
    a = p.parse_args()
    model = GPT(ModelConfig(vocab_size=65, n_ctx=a.n_ctx, n_layer=a.n_layer, n_head=a.n_head,
                            d_model=a.d_model), seed=0)
    seconds(model, 8, True)
    print(f"{'tokens':>7} {'cached s':>9} {'tok/s':>7} {'uncached s':>11} {'tok/s':>7}")
    rows = {}
    for n in (64, 256, 1000):
        rows[n] = seconds(model, n, True), seconds(model, n, False)
        print(f"{n:7d} {rows[n][0]:9.3f} {n / rows[n][0]:7.0f} {rows[n][1]:11.3f} {n / rows[n][1]:7.0f}")
    (c1, u1), (c2, u2) = rows[256], rows[1000]
    print(f"256 -> 1000 tokens (3.9x): cached costs {c2 / c1:.1f}x, uncached {u2 / u1:.1f}x")


if __name__ == "__main__":
    main()
