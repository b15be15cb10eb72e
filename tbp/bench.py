"""Throughput measurements behind `tbp bench`: numbers only, no printing.

Speed is measured, never asserted: these functions time the real training step
(forward + handwritten backward + clip + AdamW) and real cached decoding, after a warm-up,
and report medians. Compare against the PyTorch reference in one run on one machine.
"""
from __future__ import annotations

import time

import numpy as np

from .generate import Sampling, generate_ids
from .nn import GPT, ModelConfig
from .optim import AdamW, clip_grads
from .parallel import data_parallel


def matmul_peak_gflops(dtype=np.float32, n: int = 1024, repeats: int = 5) -> float:
    """Best-of-``repeats`` GFLOP/s of one n x n x n matmul: the machine's scale for the rest."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def train_flops_per_token(cfg: ModelConfig) -> float:
    """Forward + backward FLOPs per token: 3 x (2 x matmul weights + attention's scores and sums).

    The matmul weights are every matrix but the embeddings (from GPT.shapes, so a new layer
    counts itself), plus the head's C x V; multiply-adds count 2; attention scores are
    computed over the full T x T square: 2 T H (Dk + Dv) per token and layer.
    """
    C, L, T, V = cfg.d_model, cfg.n_layer, cfg.n_ctx, cfg.vocab_size
    matrices = sum(int(np.prod(s)) for k, s in GPT.shapes(cfg).items()
                   if len(s) == 2 and k not in ("wte", "wpe", "lm_head.weight"))
    forward = 2 * (matrices + C * V) + L * 2 * T * cfg.n_head * (cfg.d_qk + cfg.d_v)
    return 3.0 * forward


def bench_train(cfg: ModelConfig, batch_size: int, iters: int = 20, warmup: int = 3,
                seed: int = 0, dtype=np.float32, threads: int = 0) -> dict:
    """Median time of a full training step on random tokens, as `tbp train` runs it
    (``threads`` as its --threads: 0 is one thread per core, sharing the batch)."""
    model = GPT(cfg, seed=seed, dtype=dtype)
    opt = AdamW(model.layout)
    rng = np.random.default_rng(seed)
    workers = opt.workers = data_parallel(model, threads, batch_size)
    times = []
    with workers:
        for i in range(warmup + iters):
            x = rng.integers(0, cfg.vocab_size, (batch_size, cfg.n_ctx))
            y = rng.integers(0, cfg.vocab_size, (batch_size, cfg.n_ctx))
            t = time.perf_counter()
            model.zero_grad()
            workers.accumulate({"idx": x, "targets": y})
            clip_grads(model.layout.grads, 1.0)
            opt.step(1e-4)
            if i >= warmup:
                times.append(time.perf_counter() - t)
    med = float(np.median(times))
    tokens = batch_size * cfg.n_ctx
    return {"train_ms_per_iter": med * 1e3, "train_tokens_per_s": tokens / med,
            "gflops": train_flops_per_token(cfg) * tokens / med / 1e9, "train_iters": iters,
            "train_threads": workers.workers}


def bench_generate(cfg: ModelConfig, new_tokens: int | None = None, use_cache: bool = True,
                   seed: int = 0, dtype=np.float32) -> dict:
    """Batch-1 sampling from a one-token prompt, up to the context: tokens/s over all of it."""
    model = GPT(cfg, seed=seed, dtype=dtype)
    n = min(new_tokens or cfg.n_ctx - 1, cfg.n_ctx - 1)
    list(generate_ids(model, [0], 4, Sampling(1.0), np.random.default_rng(seed), 1, use_cache))  # warm-up
    t = time.perf_counter()
    count = sum(1 for _ in generate_ids(model, [0], n, Sampling(1.0), np.random.default_rng(seed), 1, use_cache))
    dt = time.perf_counter() - t
    return {"generate_tokens_per_s": count / dt, "generate_tokens": count, "generate_s": dt}
