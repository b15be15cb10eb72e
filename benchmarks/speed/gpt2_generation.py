"""Generation at GPT-2 124M's shape: the first token's latency after a long prompt, and cached
decoding speed as the context fills, batch 1, random weights (the figures are the shapes').

    python benchmarks/speed/gpt2_generation.py --record

The prompt is one batched forward (the prefill), not a step per token: its latency is the time
to the first sampled token. Decoding is then timed over consecutive spans of new tokens, so the
tokens/s at the start of the context and near its end (where each token attends to ~1,000
cached positions) are both seen. Median of --rounds runs; the threads are the environment's.
"""
import argparse
import os
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[1, 1000])
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=50257, n_ctx=1024, n_layer=12, n_head=12, d_model=768)
    model = GPT(cfg, seed=0)
    rng = np.random.default_rng(0)
    for n in args.prompts:
        prompt = rng.integers(0, cfg.vocab_size, n).tolist()
        new = min(args.new, cfg.n_ctx - n)
        first, per_token = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            gen = generate_ids(model, prompt, new, Sampling(0), np.random.default_rng(0))
            next(gen)
            t1 = time.perf_counter()
            k = sum(1 for _ in gen)
            t2 = time.perf_counter()
            first.append(t1 - t0)
            per_token.append((t2 - t1) / max(k, 1))
        rec = {"model": "gpt2-124m shape", "prompt_tokens": n, "new_tokens": new, "rounds": args.rounds,
               "first_token_s": statistics.median(first), "decode_tokens_per_s": 1 / statistics.median(per_token),
               "first_token_s_all": first, "decode_s_per_token_all": per_token,
               "threads_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
               "numpy": np.__version__, "commit": records.commit()}
        print(f"prompt {n}: first token {rec['first_token_s'] * 1000:.0f} ms, then "
              f"{rec['decode_tokens_per_s']:.1f} tokens/s")
        if args.record:
            records.append("gpt2_generation", rec)


if __name__ == "__main__":
    main()
