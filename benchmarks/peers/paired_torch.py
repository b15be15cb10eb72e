"""tbp and PyTorch in one process, step by step: training and generation, paired.

compare_torch.py runs each engine in its own process, and on a machine whose speed drifts by
tens of percent over tens of seconds its ratios swing with the drift. Here both engines live
in one process and take turns: a sample of tbp with NumPy's products, one of tbp with MKL's
(with --mkl) and one of PyTorch, in an order that reverses every round (ABC CBA ...), so that
drift falls on all of them alike. Each ratio is the median of the per-round ratios, with its
quartiles; tokens/s are medians over the rounds.

The models are the ones compare_torch.py runs: the same GPT-2 shape in both engines
(pre-LN blocks, tanh-GELU, learned positions, tied head, biases; PyTorch with
scaled_dot_product_attention), one training step being forward, backward, clipping at 1.0
and AdamW, on random tokens. Training runs at --threads (PyTorch's intra-op threads; tbp's
data-parallel workers, each with one BLAS thread; one thread is tbp's serial step with BLAS
held to one thread). Generation is batch-1 sampling with the KV cache from one token to the
context, at the machine's default threads for both; its products are NumPy's whatever the
library (one row at a time), so it runs tbp once.

Run it with an interpreter that has torch, and tbp on the path; --mkl names libmkl_rt (the
mkl wheel's, from tbp's own environment):

    PYTHONPATH=. .torchenv/bin/python benchmarks/peers/paired_torch.py --mkl .venv/lib/libmkl_rt.so.3

--bf16 adds the mixed-precision arms to the training cases: tbp with --precision bf16's
products (oneDNN's with --onednn PATH of libdnnl, else MKL's bf16 GEMM with --mkl, else the
NumPy twin) and PyTorch under
torch.autocast("cpu", dtype=torch.bfloat16). The case gpt2 is GPT-2 124M's shape (12 x 768,
12 heads, vocabulary 50,257) at B 4, T 64; gpt2-1024 the same at T 1,024. PyTorch's model is initialised as GPT-2 is
(normal 0.02, zero biases) and subnormals are flushed to zero: with PyTorch's default
initialisation its fp32 steps on random tokens slow down several-fold on subnormal arithmetic.
The flush is the process's (torch.set_flush_denormal), so tbp's arms run with it too, which
`tbp train` does not do; with GPT-2's initialisation tbp's steps meet few subnormals.

--record appends each row to results/precision_speed.jsonl with --bf16, else to
results/paired_torch.jsonl, with the CPU and the commit.

    PYTHONPATH=. .torchenv/bin/python benchmarks/peers/paired_torch.py --bf16 --mkl .venv/lib/libmkl_rt.so.3 \
        --cases wide,gpt2 --threads 1,2 --record
"""
import argparse
import contextlib
import json
import os
import statistics
import time

os.environ.setdefault("TBP_GEMM", "numpy")      # the products' library is switched here, per sample

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tbp.check.bench import train_step
from tbp.machine.cores import machine
from tbp.machine.libraries import MKL, MKLBF16
from tbp.machine.onednn import OneDNN, OneDNNBF16
from tbp.generate.sampling import Sampling, generate_ids
from tbp.nn.gpt import GPT
from tbp.nn.config import ModelConfig
from tbp.nn import gemm
from tbp.train.optim import AdamW
from tbp.train.parallel import data_parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records                                            # noqa: E402

V = 65
TRAIN = {"small": ((4, 4, 128, 64), 12, 5, V), "wide": ((6, 6, 384, 256), 8, 1, V),   # model, batch, steps a
         "gpt2": ((12, 12, 768, 64), 4, 1, 50257),                                      # sample, vocabulary
         "gpt2-1024": ((12, 12, 768, 1024), 4, 1, 50257)}                               # GPT-2's whole context
GENERATE = (4, 4, 128, 1024)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, cache=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2)
                   for t in self.c_attn(self.ln_1(x)).split(C, dim=2))
        if cache is not None:                       # decoding: keys and values so far
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class TorchGPT(nn.Module):
    def __init__(self, L, H, C, T, vocab=V):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, C), nn.Embedding(T, C)
        self.h = nn.ModuleList([Block(C, H) for _ in range(L)])
        self.ln_f = nn.LayerNorm(C)
        for m in self.modules():                    # GPT-2's initialisation, as tbp's
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, pos0=0, caches=None):
        x = self.wte(idx) + self.wpe(torch.arange(pos0, pos0 + idx.shape[1]))
        for i, block in enumerate(self.h):
            x = block(x, None if caches is None else caches[i])
        return self.ln_f(x) @ self.wte.weight.T


def torch_trainer(model_shape, batch, rng, vocab=V, bf16=False):
    m = TorchGPT(*model_shape, vocab)
    decay = [p for p in m.parameters() if p.dim() >= 2]
    other = [p for p in m.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.99))
    T = model_shape[3]

    def step() -> float:
        x = torch.from_numpy(rng.integers(0, vocab, (batch, T)))
        y = torch.from_numpy(rng.integers(0, vocab, (batch, T)))
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(m(x).view(-1, vocab).float(), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        return time.perf_counter() - t
    return step


def tbp_trainer(model_shape, batch, rng, threads, stack, vocab=V):
    L, H, C, T = model_shape
    model = GPT(ModelConfig(n_layer=L, n_head=H, d_model=C, n_ctx=T, vocab_size=vocab), seed=0)
    opt = AdamW(model.layout)
    workers = opt.workers = data_parallel(model, threads, batch)
    stack.enter_context(workers)

    def step() -> float:
        x, y = rng.integers(0, vocab, (batch, T)), rng.integers(0, vocab, (batch, T))
        t = time.perf_counter()
        train_step(model, opt, workers, x, y)
        return time.perf_counter() - t
    return step


def torch_generator(model_shape):
    m = TorchGPT(*model_shape).eval()
    n = model_shape[3] - 1

    @torch.no_grad()
    def run() -> float:
        g = torch.Generator().manual_seed(0)
        caches, idx = [dict() for _ in m.h], torch.tensor([[0]])
        t = time.perf_counter()
        for i in range(n):
            logits = m(idx[:, -1:], pos0=i, caches=caches)[:, -1]
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, -1), 1, generator=g)], 1)
        return (time.perf_counter() - t) / n
    return run


def tbp_generator(model_shape):
    L, H, C, T = model_shape
    model = GPT(ModelConfig(n_layer=L, n_head=H, d_model=C, n_ctx=T, vocab_size=V), seed=0)
    n = T - 1

    def run() -> float:
        t = time.perf_counter()
        for _ in generate_ids(model, [0], n, Sampling(1.0), np.random.default_rng(0)):
            pass
        return (time.perf_counter() - t) / n
    return run


def with_products(fn, lib):
    """fn, run with ``lib`` (None: NumPy) doing the engine's products."""
    def run():
        with gemm.using(lib):
            return fn()
    return run


def paired(engines: dict, rounds: int, per_sample: int) -> dict:
    """{name: [seconds per step or token, one per round]}: the engines take turns, their order
    reversed every round; a sample is the median of ``per_sample`` calls."""
    names = list(engines)
    for fn in engines.values():                 # warm-up: allocations, caches, thread pools
        for _ in range(2):
            fn()
    out = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            out[name].append(statistics.median(engines[name]() for _ in range(per_sample)))
            # idle worker threads spin for a while before they sleep (PyTorch's OpenMP pool, and
            # OpenBLAS's for about 0.1 s): let them stop before the next engine's turn
            time.sleep(0.25)
    return out


def summary(times: dict, tokens: int) -> dict:
    res = {name: {"tokens_per_s": tokens / statistics.median(t)} for name, t in times.items()}
    for name, t in times.items():
        if name != "torch":
            r = [b / a for a, b in zip(t, times["torch"])]       # > 1: tbp faster
            q1, med, q3 = np.percentile(r, [25, 50, 75])
            res[name].update(ratio=float(med), quartiles=[float(q1), float(q3)])
        if "torch-bf16" in times and name not in ("torch", "torch-bf16"):
            res[name]["ratio_torch_bf16"] = float(np.median([b / a for a, b in zip(t, times["torch-bf16"])]))
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mkl", help="path of libmkl_rt: adds tbp with MKL's products to each round")
    p.add_argument("--threads", default="2", help="comma-separated training thread counts")
    p.add_argument("--cases", default="small,wide,generate")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", action="store_true", help="also print one JSON line of everything")
    p.add_argument("--bf16", action="store_true", help="add tbp bf16 and PyTorch bf16-autocast arms to training")
    p.add_argument("--onednn", help="path of libdnnl: tbp's bf16 arm uses oneDNN's products")
    p.add_argument("--record", action="store_true",
                   help="append each row to results/precision_speed.jsonl (--bf16) or results/paired_torch.jsonl")
    a = p.parse_args()
    torch.set_flush_denormal(True)
    lib = MKL(a.mkl) if a.mkl else None
    info = machine()
    print(f"{info['cpu']} · {info['cores']} cores · SIMD {info['simd']} · NumPy BLAS {info['blas']}"
          f"{' · MKL ' + lib.version if lib else ''} · torch {torch.__version__}")
    report = {"machine": info, "torch": torch.__version__, "mkl": lib and lib.version, "rows": []}
    libs = {"tbp": None, **({"tbp+mkl": lib} if lib else {})}
    if a.bf16:
        libs["tbp-bf16"] = OneDNNBF16(OneDNN(a.onednn)) if a.onednn else MKLBF16(lib) if lib else gemm.BF16()
    bf16_library = ("onednn" if a.onednn else "mkl" if lib else "numpy twin") if a.bf16 else None
    for case in a.cases.split(","):
        for threads in ([None] if case == "generate" else [int(t) for t in a.threads.split(",")]):
            rng = np.random.default_rng(0)
            with contextlib.ExitStack() as stack:
                if case == "generate":
                    torch.set_num_threads(os.cpu_count() or 1)
                    ours, theirs, tokens, per = tbp_generator(GENERATE), torch_generator(GENERATE), 1, 1
                    label = f"generate {GENERATE[0]}L-{GENERATE[2]} T{GENERATE[3]} B1"
                    size = {"n_layer": GENERATE[0], "n_head": GENERATE[1], "d_model": GENERATE[2],
                            "n_ctx": GENERATE[3], "vocab_size": V, "batch": 1}
                else:
                    shape, batch, per, vocab = TRAIN[case]
                    torch.set_num_threads(threads)
                    ours = tbp_trainer(shape, batch, rng, threads, stack, vocab)
                    theirs, tokens = torch_trainer(shape, batch, rng, vocab), batch * shape[3]
                    label = f"train {shape[0]}L-{shape[2]} V{vocab} T{shape[3]} B{batch}, {threads} thread(s)"
                    size = {"n_layer": shape[0], "n_head": shape[1], "d_model": shape[2], "n_ctx": shape[3],
                            "vocab_size": vocab, "batch": batch}
                # the decoder's products are a row or a few: NumPy's, whichever library is installed
                chosen_libs = {"tbp": None} if case == "generate" else libs
                engines = {name: with_products(ours, chosen) for name, chosen in chosen_libs.items()}
                engines["torch"] = theirs
                if a.bf16 and case != "generate":
                    engines["torch-bf16"] = torch_trainer(shape, batch, rng, vocab, bf16=True)
                res = summary(paired(engines, a.rounds, per), tokens)
            line = " · ".join(f"{name} {r['tokens_per_s']:,.0f}" for name, r in res.items())
            ratios = " · ".join(f"{name}/torch {r['ratio']:.2f}x ({r['quartiles'][0]:.2f}-{r['quartiles'][1]:.2f})"
                                + (f", /torch-bf16 {r['ratio_torch_bf16']:.2f}x" if "ratio_torch_bf16" in r else "")
                                for name, r in res.items() if "ratio" in r)
            print(f"{label}: tokens/s {line} · {ratios}", flush=True)
            report["rows"].append({"case": label, **res})
            if a.record:
                records.append("precision_speed" if a.bf16 else "paired_torch",
                               {"case": case, "label": label, "shape": size, "threads": threads, "rounds": a.rounds,
                                "torch": torch.__version__, "mkl": lib and lib.version,
                                "bf16_units": info["bf16_units"], "bf16_library": bf16_library,
                                "commit": records.commit(), "arms": res})
    if a.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
