"""What the KV cache buys: seconds to generate n tokens, cached vs uncached, 1024-token context.

With the cache each token costs one row of attention, so 4x the tokens should cost about 4x
the time; without it every token recomputes its whole window, so about 16x. Cached and
uncached take turns, round by round; the medians of ``--rounds`` go to results/kv_cache.jsonl
(``python benchmarks/report.py`` makes the table).

    python benchmarks/speed/kv_cache.py [--n-layer 4 --d-model 128 --rounds 5]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from tbp.generate.sampling import Sampling, generate_ids
from tbp.nn.gpt import GPT
from tbp.nn.config import ModelConfig


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
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1000])
    p.add_argument("--rounds", type=int, default=5, help="cached and uncached take turns; medians")
    a = p.parse_args()
    cfg = ModelConfig(vocab_size=65, n_ctx=a.n_ctx, n_layer=a.n_layer, n_head=a.n_head, d_model=a.d_model)
    model = GPT(cfg, seed=0)
    seconds(model, 8, True)
    print(f"{'tokens':>7} {'cached s':>9} {'tok/s':>7} {'uncached s':>11} {'tok/s':>7}")
    for n in a.tokens:
        cached, uncached = [], []
        for _ in range(a.rounds):
            cached.append(seconds(model, n, True))
            uncached.append(seconds(model, n, False))
        c, u = statistics.median(cached), statistics.median(uncached)
        print(f"{n:7d} {c:9.3f} {n / c:7.0f} {u:11.3f} {n / u:7.0f}")
        records.append("kv_cache", {"commit": records.commit(), "config": cfg.flat(), "tokens": n,
                                    "rounds": a.rounds, "cached_s": c, "uncached_s": u,
                                    "cached_all": cached, "uncached_all": uncached})


if __name__ == "__main__":
    main()
