"""nanoGPT's CPU recipe, char-level, on a text file: the val loss to compare with torch_ref.py.

4 layers, 4 heads, 128 wide, context 64, batch 12, 2000 iterations, lr 1e-3 -> 1e-4,
warmup 100, beta2 0.99, weight decay 0.1, clip 1.0, no dropout; val loss on 50 fixed batches.

    python benchmarks/peers/quality.py --data ../shared/data/tinyshakespeare.txt --out checkpoints/shakespeare

The run's last validation loss is one record in results/quality.jsonl; torch_val.py then scores
the run on the reference's own batches.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="checkpoints/shakespeare-recipe")
    p.add_argument("--iters", type=int, default=2000)
    a = p.parse_args()
    cmd = [sys.executable, "-m", "tbp", "train", "--data", a.data, "--out", a.out, "--force",
           "--n-layer", "4", "--n-head", "4", "--d-model", "128", "--n-ctx", "64", "--batch-size", "12",
           "--max-iters", str(a.iters), "--lr", "1e-3", "--min-lr", "1e-4", "--warmup", "100",
           "--beta2", "0.99", "--weight-decay", "0.1", "--grad-clip", "1.0", "--eval-interval", "250",
           "--eval-batches", "50", "--seed", "1337"]
    subprocess.run(cmd, check=True)
    subprocess.run([sys.executable, "-m", "tbp", "info", a.out], check=True)
    metrics = [json.loads(x) for x in (Path(a.out) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last = [m for m in metrics if "val_loss" in m][-1]
    records.append("quality", {"commit": records.commit(), "command": cmd[1:], "iters": a.iters,
                               "step": last.get("step"), "val_loss": last["val_loss"]})


if __name__ == "__main__":
    main()
