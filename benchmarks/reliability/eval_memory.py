"""Peak memory of evaluation and of a training step, against tbp's own estimates, at GPT-2 124M's
shape and a SmolLM2-135M-like shape (30 x 576, vocabulary 49,152), context 1,024 and 2,048.

    python benchmarks/reliability/eval_memory.py --record

Each measurement runs in a fresh process (its peak resident memory, ru_maxrss, is its own):

- ``eval``: the whole-split evaluation the trainer and ``tbp eval`` run (train/evaluate.py's
  split_loss) over a validation split of ``--val-tokens`` random tokens, at batch ``--batch``:
  a forward that keeps nothing for a backward;
- ``eval-kept``: the same split through the training forward, which keeps every block's
  activations (what evaluation did before it was bounded), at the same batch;
- ``train``: ``--steps`` training steps (forward, backward, AdamW) at the same batch.

Random weights: the figures are the shapes'. The estimates are ``memory.eval_bytes`` and
``memory.train_bytes`` (one thread).
"""
import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

CHILD = "--child"
SHAPES = {"gpt2-124m": dict(vocab_size=50257, n_layer=12, n_head=12, d_model=768),
          "smollm2-135m-like": dict(vocab_size=49152, n_layer=30, n_head=9, d_model=576)}


def child(shape: str, T: int, B: int, what: str, val_tokens: int, steps: int) -> None:
    import numpy as np

    from tbp.machine import memory
    from tbp.nn.batch import Batch
    from tbp.nn.config import ModelConfig
    from tbp.nn.gpt import GPT
    from tbp.train.config import TrainConfig
    from tbp.train.optim import AdamW
    cfg = ModelConfig(n_ctx=T, **SHAPES[shape])
    model = GPT(cfg, seed=0)
    rng = np.random.default_rng(0)
    val = rng.integers(0, cfg.vocab_size, val_tokens + 1)
    t0 = time.perf_counter()
    if what == "train":
        opt = AdamW(model.layout)
        for _ in range(steps):
            idx, tgt = rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))
            model.loss_and_backward(idx, tgt)
            opt.step(1e-4)
        estimate = memory.train_bytes(cfg, TrainConfig(batch_size=B, threads=1))
    else:
        windows = (len(val) - 1) // T
        total = 0.0
        for start in range(0, windows, B):       # every window of the split, B at a time, as split_loss reads it
            rows = range(start, min(windows, start + B))
            idx = np.stack([val[r * T:(r + 1) * T] for r in rows])
            tgt = np.stack([val[r * T + 1:(r + 1) * T + 1] for r in rows])
            total += model.batch_loss(Batch(idx, tgt)) if what == "eval" else model.loss(idx, tgt)
        estimate = memory.eval_bytes(cfg, B)
    print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "estimate_bytes": estimate, "weights_bytes": memory.model_bytes(cfg),
                      "seconds": time.perf_counter() - t0}))


def main() -> None:
    if CHILD in sys.argv:
        shape, T, B, what, val_tokens, steps = sys.argv[2:8]
        child(shape, int(T), int(B), what, int(val_tokens), int(steps))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--val-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--what", nargs="+", default=["eval", "eval-kept", "train"])
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    for shape in a.shapes:
        for T in a.contexts:
            for what in a.what:
                out = subprocess.run([sys.executable, __file__, CHILD, shape, str(T), str(a.batch), what,
                                      str(a.val_tokens), str(a.steps)], capture_output=True, text=True)
                if out.returncode != 0:
                    print(f"{shape} T {T} {what}: failed\n{out.stderr[-2000:]}", flush=True)
                    continue
                res = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{shape:18s} T {T:5d} B {a.batch} {what:9s}: peak {res['peak_rss_bytes'] / 2**30:6.2f} GiB, "
                      f"estimate {res['estimate_bytes'] / 2**30:6.2f} GiB, {res['seconds']:6.1f} s", flush=True)
                if a.record:
                    records.append("eval_memory", {"commit": records.commit(), "shape": shape, "n_ctx": T,
                                                   "batch": a.batch, "what": what, "val_tokens": a.val_tokens,
                                                   "steps": a.steps, **res})


if __name__ == "__main__":
    main()
