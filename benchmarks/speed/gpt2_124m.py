"""What GPT-2 124M costs here: memory, cached generation and a LoRA step, random weights.

The real weights change none of these figures (same shapes, same arithmetic), so a model of
GPT-2's shape with random weights measures them without downloading anything. The figures
are one record in results/gpt2_124m.jsonl.

    python benchmarks/speed/gpt2_124m.py [--gen-tokens 100 --train-ctx 256]
"""
import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from tbp.generate.sampling import Sampling, generate_ids
from tbp.nn.gpt import GPT
from tbp.nn.config import ModelConfig
from tbp.nn.lora import add_lora
from tbp.train.optim import AdamW, clip_grads


def rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gen-tokens", type=int, default=100)
    p.add_argument("--train-ctx", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--n-layer", type=int, default=12, help="GPT-2 124M's unless changed (a quick check)")
    p.add_argument("--d-model", type=int, default=768)
    a = p.parse_args()
    cfg = ModelConfig(vocab_size=50257, n_ctx=1024, n_layer=a.n_layer, n_head=12, d_model=a.d_model)
    t = time.perf_counter()
    model = GPT(cfg, seed=0)
    built_rss, base_params = rss_mib(), model.num_params()
    print(f"parameters {model.num_params():,} ({model.num_params() * 4 / 2**20:.0f} MiB float32), "
          f"built in {time.perf_counter() - t:.1f}s, peak RSS {rss_mib():.0f} MiB")
    t = time.perf_counter()
    n = sum(1 for _ in generate_ids(model, [50256], a.gen_tokens, Sampling(1.0, top_k=40),
                                    np.random.default_rng(0)))
    dt = time.perf_counter() - t
    cache = cfg.n_layer * 2 * cfg.n_ctx * cfg.d_model * 4
    gen_rss = rss_mib()
    print(f"generate: {n} tokens in {dt:.1f}s = {n / dt:.1f} tokens/s (batch 1, KV cache "
          f"{cache / 2**20:.0f} MiB), peak RSS {gen_rss:.0f} MiB")
    add_lora(model, 8, 16.0, ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    opt = AdamW(model.layout)
    trainable = sum(model.params[k].size for k in model.grads)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(a.steps):
        x = rng.integers(0, 50257, (1, a.train_ctx))
        t = time.perf_counter()
        model.loss_and_backward(x, x)
        clip_grads(model.layout.grads, 1.0)
        opt.step(1e-4)
        times.append(time.perf_counter() - t)
    med = float(np.median(times))
    print(f"LoRA rank 8 step (batch 1 x {a.train_ctx} tokens, {trainable:,} trainable): {med:.2f}s = "
          f"{a.train_ctx / med:.0f} tokens/s, peak RSS {rss_mib():.0f} MiB")
    records.append("gpt2_124m", {"commit": records.commit(), "config": cfg.flat(), "base_params": base_params,
                                 "built_rss_mib": built_rss, "generate_tokens": n, "generate_s": dt,
                                 "kv_cache_bytes": cache, "generate_rss_mib": gen_rss, "lora_rank": 8,
                                 "trainable": trainable, "train_ctx": a.train_ctx, "lora_step_s": med,
                                 "lora_step_all": times, "lora_rss_mib": rss_mib()})


if __name__ == "__main__":
    main()
