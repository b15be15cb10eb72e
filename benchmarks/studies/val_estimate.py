"""How far a run's fixed eval batches are from its whole validation split: the split read in
order (what the final val loss and tbp eval report), then the same split tiled from other
offsets, and the training estimate redrawn: --draws sets of --eval-batches x batch random
windows. One record in benchmarks/results/val_estimate.jsonl.

    tbp train                                   # the default run
    python benchmarks/studies/val_estimate.py checkpoints/pydoc --draws 8
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from tbp.runs import disk
from tbp.data.batches import batches_for
from tbp.data.datasets import Dataset
from tbp.train.evaluate import split_loss


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run", type=Path)
    p.add_argument("--draws", type=int, default=8)
    args = p.parse_args()
    model, tok, cfg = disk.load_model(args.run)
    ds = Dataset.load(cfg["data"])
    train = cfg["train"]
    whole, tokens = split_loss(model, ds)
    batches = batches_for(ds, model.config, model.collation)
    val = np.asarray(ds.val, dtype=np.int64)
    T = model.config.n_ctx
    tilings = {}
    for offset in (T // 4, T // 2, 3 * T // 4):
        starts = np.arange(offset, val.size - T - 1, T)
        windows = val[starts[:, None] + np.arange(T + 1)]
        losses = [model.loss(w[:, :-1], w[:, 1:]) * len(w) for w in np.array_split(windows, max(1, len(windows) // 32))]
        tilings[offset] = float(sum(losses) / len(windows))
    metrics = [json.loads(x) for x in (args.run / "metrics.jsonl").read_text().splitlines()]
    estimate = [m for m in metrics if "val_loss" in m][-1]["val_loss"]
    draws = []
    for d in range(args.draws):
        rng = np.random.default_rng(10_000 + d)
        draws.append(float(np.mean([model.batch_loss(batches.sample("val", train["batch_size"], rng))
                                    for _ in range(train["eval_batches"])])))
    rec = {"run": str(args.run), "commit": records.commit(), "seed": train["seed"], "n_layer": model.config.n_layer,
           "config": model.config.flat(), "eval_batches": train["eval_batches"], "batch_size": train["batch_size"],
           "whole_split": whole, "tokens": tokens, "tilings": tilings, "training_estimate": estimate,
           "redrawn_estimates": draws}
    records.append("val_estimate", rec)
    print(json.dumps({k: rec[k] for k in ("whole_split", "tokens", "tilings", "training_estimate", "redrawn_estimates")}))


if __name__ == "__main__":
    main()
