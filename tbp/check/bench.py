"""Throughput measurements behind `tbp bench`: numbers only, no printing.

Speed is measured, never asserted: these functions time the real training step
(forward + handwritten backward + clip + AdamW) and real cached decoding, after a warm-up,
and report medians. Compare against the PyTorch reference in one run on one machine.
"""
from __future__ import annotations

import time

import numpy as np

from ..generate.sampling import Sampling, generate_ids
from ..generate.speculative import Tally, speculative_ids
from ..nn.gpt import GPT
from ..nn.config import ModelConfig
from ..nn.batch import Batch
from ..train.optim import AdamW, clip_grads
from ..train.parallel import data_parallel
from ..nn.decode import Inference


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


def memory_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """GB/s of reading memory on one thread: the median time to sum a ``mib`` MiB float32 array
    (far past the caches). Batch-1 decoding reads every weight once a token, so this over the
    weights' bytes is the decode's roofline."""
    a = np.ones(mib << 18, np.float32)
    a.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t)
    return a.nbytes / float(np.median(times)) / 1e9


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


def train_step(model: GPT, opt: AdamW, workers, x: np.ndarray, y: np.ndarray, lr: float = 1e-4) -> None:
    """One training step as `tbp train` takes it on a batch x, y (B, T): gradients from zero
    over ``workers`` (parallel.data_parallel's, entered), clipped to norm 1.0, an AdamW update."""
    model.zero_grad()
    batch = Batch(x, y)
    if model.config.dropout:                  # as tbp train draws them: a seed a row
        batch = batch.with_noise(np.arange(len(x)))
    workers.accumulate(batch)
    clip_grads(model.layout.grads, 1.0)
    opt.step(lr)


def bench_train(cfg: ModelConfig, batch_size: int, iters: int = 20, warmup: int = 3,
                seed: int = 0, dtype=np.float32, threads: int = 0, precision: str = "fp32") -> dict:
    """Median time of a full training step on random tokens, as `tbp train` runs it
    (``threads`` as its --threads: 0 is one thread per core, sharing the batch; ``precision``
    as its --precision)."""
    model = GPT(cfg, seed=seed, dtype=dtype)
    opt = AdamW(model.layout)
    rng = np.random.default_rng(seed)
    workers = opt.workers = data_parallel(model, threads, batch_size, precision=precision)
    times = []
    with workers:
        for i in range(warmup + iters):
            x = rng.integers(0, cfg.vocab_size, (batch_size, cfg.n_ctx))
            y = rng.integers(0, cfg.vocab_size, (batch_size, cfg.n_ctx))
            t = time.perf_counter()
            train_step(model, opt, workers, x, y)
            if i >= warmup:
                times.append(time.perf_counter() - t)
    med = float(np.median(times))
    tokens = batch_size * cfg.n_ctx
    return {"train_ms_per_iter": med * 1e3, "train_tokens_per_s": tokens / med,
            "gflops": train_flops_per_token(cfg) * tokens / med / 1e9, "train_iters": iters,
            "train_threads": workers.workers, "train_gemm": workers.gemm.name, "train_gemm_reason": workers.gemm.reason,
            "train_precision": precision}


def bench_precisions(cfg: ModelConfig, batch_size: int, rounds: int = 5, steps: int = 4, seed: int = 0,
                     threads: int = 0) -> dict:
    """fp32 and bf16 training steps paired in one process: ``rounds`` rounds, each timing
    ``steps`` steps of one precision and then of the other (the order reversing every round,
    AB BA ...), after one untimed step on entering each, so that the machine's drift falls on
    both. Per precision: the median step's time; bf16's speed-up: the median of the rounds'
    ratios fp32 time / bf16 time (> 1: bf16 faster)."""
    arms = {}
    for precision in ("fp32", "bf16"):
        model = GPT(cfg, seed=seed)
        opt = AdamW(model.layout)
        opt.workers = data_parallel(model, threads, batch_size, precision=precision)
        arms[precision] = model, opt
    rng = np.random.default_rng(seed)
    batches = [(rng.integers(0, cfg.vocab_size, (batch_size, cfg.n_ctx)),
                rng.integers(0, cfg.vocab_size, (batch_size, cfg.n_ctx))) for _ in range(steps + 1)]
    times: dict = {p: [] for p in arms}
    per_round: dict = {p: [] for p in arms}
    choice = {}
    for r in range(rounds):
        for precision in (("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32")):
            model, opt = arms[precision]
            with opt.workers as workers:
                train_step(model, opt, workers, *batches[-1])          # warm: threads, the library
                choice[precision] = workers.gemm
                spent = []
                for x, y in batches[:steps]:
                    t = time.perf_counter()
                    train_step(model, opt, workers, x, y)
                    spent.append(time.perf_counter() - t)
            times[precision] += spent
            per_round[precision].append(float(np.median(spent)))
    tokens = batch_size * cfg.n_ctx
    out = {"precision_rounds": rounds, "precision_steps": steps, "threads": arms["fp32"][1].workers.workers,
           "bf16_speedup": float(np.median([a / b for a, b in zip(per_round["fp32"], per_round["bf16"])]))}
    for precision, spent in times.items():
        med = float(np.median(spent))
        out[precision] = {"ms_per_iter": med * 1e3, "tokens_per_s": tokens / med, "gemm": choice[precision].name,
                          "gemm_reason": choice[precision].reason}
    return out


def bench_decode_strategy(cfg: ModelConfig, strategy, name: str, steps: int = 32, repeats: int = 5,
                          seed: int = 0, dtype=np.float32) -> dict:
    """Dense decoding and a decoding strategy (a sparse rule; registered as ``name``, which
    names its figures) paired in one process: one model, two Inferences prefilled with the same
    random tokens to a cache of n_ctx - steps - 1, then ``steps`` one-token steps each, in turn,
    ``repeats`` times; tokens/s are the medians. Speed needs the architecture only, not
    trained weights."""
    model = GPT(cfg, seed=seed, dtype=dtype)
    n = cfg.n_ctx - steps - 1
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, cfg.n_ctx))
    dense = Inference(model, 1)
    engines = {"dense": dense, name: Inference(model, 1, strategy, share=dense)}
    for engine in engines.values():
        engine.forward(tokens[:, :n])
    rates: dict = {key: [] for key in engines}
    for r in range(repeats):
        for key in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            engine = engines[key]
            engine.length = n                           # the same cache, the same positions, every round
            t = time.perf_counter()
            for i in range(n, n + steps):
                engine.forward(tokens[:, i:i + 1], check=False)
            rates[key].append(steps / (time.perf_counter() - t))
    dense, other = (float(np.median(rates[k])) for k in ("dense", name))
    # each round's two runs are adjacent in time: the median of their ratios is what a drift in
    # this machine's speed, between rounds, cannot move
    speedup = float(np.median([s / d for s, d in zip(rates[name], rates["dense"])]))
    return {"decode_dense_tokens_per_s": dense, f"decode_{name}_tokens_per_s": other,
            f"decode_{name}_speedup": speedup, "decode_rounds": repeats, "decode_cache": n,
            "decode_steps": steps, name: strategy.record()}


def bench_generate(cfg: ModelConfig, new_tokens: int | None = None, use_cache: bool = True,
                   seed: int = 0, dtype=np.float32) -> dict:
    """Batch-1 sampling from a one-token prompt, up to the context: tokens/s over all of it. The
    decoder's folded weights are made in the warm-up, as a model's load (Inference's ``share``)."""
    model = GPT(cfg, seed=seed, dtype=dtype)
    n = min(new_tokens or cfg.n_ctx - 1, cfg.n_ctx - 1)
    folds = Inference(model, 1) if use_cache else None
    list(generate_ids(model, [0], 4, Sampling(1.0), np.random.default_rng(seed), 1, use_cache, share=folds))  # warm-up
    t = time.perf_counter()
    count = sum(1 for _ in generate_ids(model, [0], n, Sampling(1.0), np.random.default_rng(seed), 1, use_cache,
                                        share=folds))
    dt = time.perf_counter() - t
    # what one token reads at least: every weight (the tied head's rows too, once); the KV cache besides
    weight_bytes = sum(p.nbytes for p in model.params.values())
    return {"generate_tokens_per_s": count / dt, "generate_tokens": count, "generate_s": dt,
            "generate_weight_bytes": weight_bytes}


def timed_decode(model, prompt: list[int], new_tokens: int, sampling: Sampling, seed: int, drafter=None,
                 folds: Inference | None = None) -> tuple[list[int], float, Tally]:
    """(the tokens, seconds, speculation's counts): ``new_tokens`` decoded at batch 1 from
    ``prompt``, plainly or, with ``drafter`` (speculative.Lookup or Draft), speculatively; both
    read the weights folded in ``folds`` (made once, as a server makes them), so the seconds are
    decoding's alone."""
    tally = Tally()
    rng = np.random.default_rng(seed)
    t = time.perf_counter()
    if drafter is None:
        out = [int(x[0]) for x in generate_ids(model, prompt, new_tokens, sampling, rng, share=folds)]
    else:
        out = [int(x[0]) for x in speculative_ids(model, prompt, new_tokens, sampling, rng, drafter, tally, share=folds)]
    return out, time.perf_counter() - t, tally


def bench_decoding(model, prompt: list[int], new_tokens: int, sampling: Sampling, rounds: int = 5,
                   seed: int = 0) -> dict:
    """A trained model's plain decoding from ``prompt``: after an untimed call that folds the
    weights, the median of ``rounds`` decodings of ``new_tokens``."""
    folds = Inference(model, 1)
    timed_decode(model, prompt, 2, sampling, seed, None, folds)
    times = [timed_decode(model, prompt, new_tokens, sampling, seed, None, folds)[1] for _ in range(rounds)]
    return {"decoding_rounds": rounds, "decoding_tokens": new_tokens,
            "plain_tokens_per_s": new_tokens / float(np.median(times))}


def bench_speculation(model, prompt: list[int], new_tokens: int, drafter, sampling: Sampling, rounds: int = 5,
                      seed: int = 0) -> dict:
    """A trained model's decoding from ``prompt``, plain and speculative (``drafter``) paired in
    one process: after an untimed round that folds the weights, ``rounds`` rounds each decode
    ``new_tokens`` both ways, the order reversing every round, with the same seed (so the same
    text: speculation is exact). Tokens/s are medians; the speed-up is the median of the rounds'
    ratios (a drift of the machine's speed between rounds cannot move it); the counts are the
    last speculative round's."""
    folds = Inference(model, 1)
    timed_decode(model, prompt, 2, sampling, seed, None, folds)
    timed_decode(model, prompt, 2, sampling, seed, drafter.fresh(), folds)
    times: dict = {"plain": [], "speculative": []}
    texts: dict = {}
    for r in range(rounds):
        for arm in (("plain", "speculative") if r % 2 == 0 else ("speculative", "plain")):
            out, dt, tally = timed_decode(model, prompt, new_tokens, sampling, seed,
                                          drafter.fresh() if arm == "speculative" else None, folds)
            times[arm].append(dt)
            texts[arm] = out
            if arm == "speculative":
                counts = tally
    plain, spec = (float(np.median(times[a])) for a in ("plain", "speculative"))
    return {"speculation": drafter.describe(), "speculation_rounds": rounds, "speculation_tokens": new_tokens,
            "plain_tokens_per_s": new_tokens / plain, "speculative_tokens_per_s": new_tokens / spec,
            "speculative_speedup": float(np.median([p / q for p, q in zip(times["plain"], times["speculative"])])),
            "same_text": texts["plain"] == texts["speculative"], **counts.record()}
