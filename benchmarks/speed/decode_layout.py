"""How decoding reads a contracting matrix: the MLP's c_proj (4C x C) stored as trained, or
transposed so that one row's product is a dot product per output (tbp.nn.linear.contraction).

At batch 1 each product of a decoding step streams its matrix once, and NumPy's BLAS reads a
matrix at different rates in its two forms: as a sum of scaled rows into the output (x @ W, W
stored (in, out)) or as one dot product per output along a row (W^T x, W^T stored (out, in)).
Two measurements, interleaved round by round in one process, medians of ``--rounds``:

- each product of GPT-2 124M's decoding step in both forms, twelve copies of each matrix so
  that the sweep streams from memory, as the step does (GB/s of the matrix);
- the whole step of a 12 x 768 model (vocabulary ``--vocab``), prompt of 64 then one token at
  a time: tbp's Inference as built (c_proj transposed), and the same Inference with each MLP
  reading c_proj as stored (a Fortran-ordered view of the trained array: the sum-of-rows form).

    python benchmarks/speed/decode_layout.py --rounds 7
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

from tbp.machine.cores import available_cores, blas_threads
from tbp.nn.build import build_model
from tbp.nn.config import ModelConfig
from tbp.nn.decode import Inference
from tbp.nn.linear import weight_of
from tbp.nn.mlp import MLP

C = 768
PRODUCTS = {"c_attn (769 x 2304)": (C + 1, 3 * C), "attention c_proj (768 x 768)": (C, C),
            "c_fc (769 x 3072)": (C + 1, 4 * C), "MLP c_proj (3072 x 768)": (4 * C, C)}


def products(rounds: int, rng) -> list[dict]:
    """Each product in both forms: GB/s of its matrix, median over rounds of 12 products."""
    rows = []
    for name, (k, n) in PRODUCTS.items():
        stored = [rng.standard_normal((k, n), dtype=np.float32) for _ in range(12)]
        transposed = [np.ascontiguousarray(w.T) for w in stored]
        x, out = rng.standard_normal(k, dtype=np.float32), np.empty(n, np.float32)
        arms = {"x @ W": lambda: [np.dot(x, w, out=out) for w in stored],
                "W^T x": lambda: [np.dot(w, x, out=out) for w in transposed]}
        seconds = {arm: [] for arm in arms}
        for _ in range(rounds):
            for arm, sweep in arms.items():
                t = time.perf_counter()
                sweep()
                seconds[arm].append((time.perf_counter() - t) / 12)
        rows.append({"product": name, "in": k, "out": n,
                     **{f"{arm} GB/s": k * n * 4 / statistics.median(s) / 1e9 for arm, s in seconds.items()}})
        print(rows[-1], flush=True)
    return rows


def as_stored(inf: Inference, model) -> Inference:
    """``inf`` with each MLP reading c_proj as trained: (the transposed weight's) Fortran-ordered
    view of the model's own (4C, C) array, which NumPy's BLAS reads in the sum-of-rows form."""
    for block, layer in zip(model.blocks, inf.layers):
        for *_, sublayer, state in layer:
            if isinstance(sublayer, MLP):
                fc, _, bias = state.folded
                state.folded = (fc, weight_of(sublayer.c_proj).T, bias)
    return inf


def step(rounds: int, vocab: int, new: int) -> dict:
    model = build_model(ModelConfig(vocab_size=vocab, n_ctx=1024, n_layer=12, n_head=12, d_model=C), seed=0)
    ids = np.random.default_rng(0).integers(0, vocab, (1, 64 + new))
    arms = {"c_proj transposed (tbp)": Inference(model, 1), "c_proj as stored": as_stored(Inference(model, 1), model)}
    seconds = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm, inf in arms.items():
            inf.reset()
            inf.forward(ids[:, :64])
            t = time.perf_counter()
            for i in range(64, 64 + new):
                inf.forward(ids[:, i:i + 1], check=False)
            seconds[arm].append((time.perf_counter() - t) / new)
    out = {arm: {"ms_per_token": 1e3 * statistics.median(s), "tokens_per_s": 1 / statistics.median(s)}
           for arm, s in seconds.items()}
    print(out, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=8192, help="the step's vocabulary (the head's width)")
    ap.add_argument("--new", type=int, default=120, help="tokens decoded one at a time, each round")
    ap.add_argument("--threads", type=int, default=available_cores(), help="NumPy's BLAS threads")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    with blas_threads(args.threads):
        rows = products(args.rounds, np.random.default_rng(0))
        whole = step(args.rounds, args.vocab, args.new)
    if not args.no_record:
        records.append("decode_layout", {"threads": args.threads, "rounds": args.rounds, "vocab": args.vocab,
                                         "products": rows, "step": whole, "commit": records.commit()})


if __name__ == "__main__":
    main()
