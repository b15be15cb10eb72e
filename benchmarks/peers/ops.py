"""A training step's operations one at a time: tbp (NumPy's BLAS, and MKL) beside PyTorch.

Each operation of the small (4 x 128, T 64, batch 12) and wide (6 x 384, T 256, batch 8)
models runs forward and backward on one data-parallel worker's rows (half the batch, as the
default two-thread run gives each thread), at one thread, in one process: the engines
alternate operation by operation, and each figure is the median of --rounds. "per step" is
the operation's count in one step times its time: their sum is the worker's compute in a
step, without the optimizer's share. Each operation is one record in results/ops.jsonl. Run
it with an interpreter that has torch, and tbp on the path; --mkl names libmkl_rt (the mkl
wheel's, from tbp's own environment):

    PYTHONPATH=. .torchenv/bin/python benchmarks/peers/ops.py --mkl .venv/lib/libmkl_rt.so.3 --rounds 7
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from tbp.machine.libraries import MKL
from tbp.machine.cores import machine
from tbp.nn.layernorm import LayerNorm
from tbp.nn.linear import Linear
from tbp.nn import gemm
from tbp.nn.kernels import (SPLIT_ROWS, attend, attend_backward, attend_causal_blocks,
                            attend_causal_blocks_backward, causal_mask)
from tbp.nn.loss import CrossEntropy
from tbp.nn.mlp import gelu_backward, gelu_forward
from tbp.machine.cores import blas_threads

MODELS = {"small": dict(L=4, H=4, C=128, T=64, B=12), "wide": dict(L=6, H=6, C=384, T=256, B=8)}
V = 65


def timed(fn, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def linear_case(rng, d_in, d_out, N):
    layer = Linear(d_in, d_out, rng)
    layer.grads["weight"] = np.zeros_like(layer.params["weight"])
    layer.grads["bias"] = np.zeros_like(layer.params["bias"])
    x = rng.standard_normal((N, d_in), dtype=np.float32)
    dy = rng.standard_normal((N, d_out), dtype=np.float32)

    def ours():
        layer.forward(x)
        layer.backward(dy)
    xt = torch.from_numpy(x).requires_grad_()
    wt = torch.from_numpy(layer.params["weight"].T.copy()).requires_grad_()
    bt = torch.from_numpy(layer.params["bias"].copy()).requires_grad_()
    dyt = torch.from_numpy(dy)

    def theirs():
        F.linear(xt, wt, bt).backward(dyt)
    return ours, theirs


def layernorm_case(rng, C, N):
    ln = LayerNorm(C)
    x = rng.standard_normal((N, C), dtype=np.float32)
    dy = rng.standard_normal((N, C), dtype=np.float32)

    def ours():
        ln.forward(x)
        ln.backward(dy)
    xt = torch.from_numpy(x).requires_grad_()
    w, b = torch.ones(C, requires_grad=True), torch.zeros(C, requires_grad=True)
    dyt = torch.from_numpy(dy)

    def theirs():
        F.layer_norm(xt, (C,), w, b).backward(dyt)
    return ours, theirs


def gelu_case(rng, W, N):
    u0 = rng.standard_normal((N, W), dtype=np.float32)
    u = u0.copy()
    dy = rng.standard_normal((N, W), dtype=np.float32)

    def ours():
        np.copyto(u, u0)                          # the backward overwrites u: a fresh one each time
        _, s = gelu_forward(u)
        gelu_backward(u, s, dy.copy())
    ut = torch.from_numpy(u0).requires_grad_()
    dyt = torch.from_numpy(dy)

    def theirs():
        u0.copy(), dy.copy()                      # the same two copies, so that only GELU differs
        F.gelu(ut, approximate="tanh").backward(dyt)
    return ours, theirs


def attention_case(rng, B, H, T, D):
    qs, k, v, dy = (rng.standard_normal((B, H, T, D), dtype=np.float32) * 0.3 for _ in range(4))
    outs = tuple(np.empty_like(qs) for _ in range(3))
    y = np.empty_like(qs)

    def ours():
        if T >= 2 * SPLIT_ROWS:            # what CausalSelfAttention runs: query blocks from T = 128
            blocks = attend_causal_blocks(qs, k, v, y)
            attend_causal_blocks_backward(dy, qs, k, v, blocks, y, outs)
            return
        att = qs @ k.transpose(0, 1, 3, 2)
        att += causal_mask(T, 0, att.dtype)
        attend(att, v, out=y)
        attend_backward(dy, qs, k, v, att, y, outs)
    qt, kt, vt = (torch.from_numpy(a.copy()).requires_grad_() for a in (qs, k, v))
    dyt = torch.from_numpy(dy)

    def theirs():
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=1.0).backward(dyt)
    return ours, theirs


def loss_case(rng, N):
    logits = rng.standard_normal((N, V), dtype=np.float32)
    targets = rng.integers(0, V, N)
    ce = CrossEntropy()

    def ours():
        ce.forward(logits, targets)
        ce.backward()
    lt = torch.from_numpy(logits).requires_grad_()
    tt = torch.from_numpy(targets)

    def theirs():
        F.cross_entropy(lt, tt).backward()
    return ours, theirs


def cases(m, rng):
    L, H, C, T = m["L"], m["H"], m["C"], m["T"]
    B = m["B"] // 2
    N = B * T
    yield "linear c_attn", L, True, linear_case(rng, C, 3 * C, N)
    yield "linear attn.c_proj", L, True, linear_case(rng, C, C, N)
    yield "linear c_fc", L, True, linear_case(rng, C, 4 * C, N)
    yield "linear mlp.c_proj", L, True, linear_case(rng, 4 * C, C, N)
    yield "head (x wte^T)", 1, True, linear_case(rng, C, V, N)
    yield "attention core (causal)", L, False, attention_case(rng, B, H, T, C // H)
    yield "layer norm", 2 * L + 1, False, layernorm_case(rng, C, N)
    yield "GELU", L, False, gelu_case(rng, 4 * C, N)
    yield "cross-entropy", 1, False, loss_case(rng, N)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mkl", help="path of libmkl_rt, for the tbp + MKL column")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--models", default="small,wide")
    a = p.parse_args()
    lib = MKL(a.mkl) if a.mkl else None
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    versions = {"commit": records.commit(), "machine": machine(), "torch": torch.__version__,
                "mkl": lib and lib.version, "rounds": a.rounds}
    with blas_threads(1):
        for name in a.models.split(","):
            m = MODELS[name]
            print(f"\n{name}: {m['L']} x {m['C']}, T {m['T']}, one worker's {m['B'] // 2} sequences, one thread")
            print(f"{'operation (forward + backward)':30s} {'count':>5s} {'numpy ms':>9s} {'mkl ms':>8s} "
                  f"{'torch ms':>9s} {'tbp/torch':>9s} {'per step: tbp':>13s} {'torch':>7s}")
            total = {"tbp": 0.0, "torch": 0.0}
            for op, count, is_product, (ours, theirs) in cases(m, rng):
                ours(), theirs()
                reps = max(1, int(0.02 / max(timed(ours, 1), 1e-6)))
                t = {"numpy": [], "mkl": [], "torch": []}
                for _ in range(a.rounds):
                    t["numpy"].append(timed(ours, reps))
                    if lib is not None and is_product:
                        with gemm.using(lib):
                            t["mkl"].append(timed(ours, reps))
                    t["torch"].append(timed(theirs, reps))
                med = {k: statistics.median(v) * 1e3 for k, v in t.items() if v}
                best = min(med.get("mkl", np.inf), med["numpy"])
                total["tbp"] += count * best
                total["torch"] += count * med["torch"]
                print(f"{op:30s} {count:5d} {med['numpy']:9.3f} {med.get('mkl', float('nan')):8.3f} "
                      f"{med['torch']:9.3f} {best / med['torch']:9.2f} {count * best:13.2f} {count * med['torch']:7.2f}",
                      flush=True)
                records.append("ops", {**versions, "model": name, "shape": m, "op": op, "count": count,
                                       **{f"{k}_ms": v for k, v in med.items()}})
            print(f"{'sum':30s} {'':5s} {'':9s} {'':8s} {'':9s} {total['tbp'] / total['torch']:9.2f} "
                  f"{total['tbp']:13.2f} {total['torch']:7.2f}")


if __name__ == "__main__":
    main()
