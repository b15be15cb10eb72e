"""The encoder-decoder on a task a user can run in minutes, beside the decoder-only GPT.

For each seed: prepare the task (digit strings of length 1..12, 20,000 distinct sources, the
last 1,000 held out), train an encoder-decoder and a GPT with the completion-only (masked)
loss on the same data with the same recipe and about the same number of parameters, then
evaluate on the 1,000 held-out strings: greedy exact match, next-token accuracy, loss. The
encoder-decoder is evaluated again with its encoder's output zeroed (the decoder must then
guess: proof that it reads the source). Runs one after another, so the times compare.

    python benchmarks/seq2seq_tasks.py --task reverse --seeds 1 2 3
"""
import argparse
import json
import time
from pathlib import Path

from runner import tbp

ARCHS = {
    # 2 encoder + 2 decoder layers (237k parameters), and a 4-layer GPT (203k): the same width
    "encoder-decoder": ["--arch", "encoder-decoder", "--n-layer", "2", "--n-ctx", "16"],
    "gpt (masked loss)": ["--arch", "gpt", "--n-layer", "4", "--n-ctx", "26"],
}
RECIPE = ["--n-head", "4", "--d-model", "64", "--batch-size", "64", "--lr", "2e-3", "--min-lr", "2e-4",
          "--eval-interval", "500", "-q"]



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="reverse")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--work", default="bench-seq2seq")
    args = ap.parse_args()
    work = Path(args.work)
    data = work / f"data-{args.task}"
    tbp("prepare", "--task", args.task, "--out", data, "--force")
    rows = []
    for seed in args.seeds:
        for arch, flags in ARCHS.items():
            out = work / f"{args.task}-{arch.split()[0]}-{seed}"
            t0 = time.perf_counter()
            tbp("train", "--data", data, "--out", out, "--force", "--seed", seed, "--max-iters", args.iters,
                *flags, *RECIPE)
            seconds = time.perf_counter() - t0
            row = {"arch": arch, "seed": seed, "train_s": round(seconds, 1),
                   **json.loads(tbp("eval", "--checkpoint", out, "--json"))}
            if arch == "encoder-decoder":
                zeroed = json.loads(tbp("eval", "--checkpoint", out, "--json", "--zero-encoder"))
                row["zeroed_exact_match"] = zeroed["exact_match"]
                row["zeroed_token_accuracy"] = zeroed["token_accuracy"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{args.task}: {args.iters} steps, 1,000 held-out strings")
    print(f"{'model':<20}{'seed':>5}{'train s':>9}{'val loss':>10}{'token acc':>11}{'exact':>8}"
          f"{'zeroed: token':>15}{'exact':>7}")
    for r in rows:
        z = (f"{100 * r['zeroed_token_accuracy']:>14.1f}%{100 * r['zeroed_exact_match']:>6.1f}%"
             if "zeroed_exact_match" in r else "")
        print(f"{r['arch']:<20}{r['seed']:>5}{r['train_s']:>9.0f}{r['val_loss']:>10.4f}"
              f"{100 * r['token_accuracy']:>10.1f}%{100 * r['exact_match']:>7.1f}%{z}")


if __name__ == "__main__":
    main()
