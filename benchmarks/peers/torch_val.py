"""Score a tbp run on exactly the PyTorch reference's validation batches.

torch_ref.py splits the text at 90% of its characters and draws 50 batches from
np.random.default_rng(0); this replays those batches through a tbp checkpoint, so the two
val losses are measured on the same tokens (char-level runs only).

    python benchmarks/peers/torch_val.py --data ../shared/data/tinyshakespeare.txt --checkpoint RUN

The loss is one record in results/torch_val.jsonl, with the run's config.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from tbp.runs.disk import load_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--eval-batches", type=int, default=50)
    a = p.parse_args()
    model, tok, cfg = load_model(a.checkpoint)
    text = open(a.data, encoding="utf-8").read()
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    val = ids[int(0.9 * len(ids)):]
    T, g = model.config.n_ctx, np.random.default_rng(0)
    losses = []
    for _ in range(a.eval_batches):
        ix = g.integers(0, len(val) - T - 1, a.batch_size)
        x = np.stack([val[i:i + T] for i in ix])
        y = np.stack([val[i + 1:i + T + 1] for i in ix])
        losses.append(model.loss(x, y))
    print(f"val loss on the reference's batches: {np.mean(losses):.4f}")
    records.append("torch_val", {"commit": records.commit(), "run": str(a.checkpoint), "config": cfg,
                                 "eval_batches": a.eval_batches, "batch_size": a.batch_size,
                                 "val_loss": float(np.mean(losses))})


if __name__ == "__main__":
    main()
