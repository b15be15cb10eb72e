"""The encoder-decoder on a task a user can run in minutes, beside the decoder-only GPT.

For each seed: prepare the task (digit strings of length 1..12, 20,000 distinct sources, the
last 1,000 held out), train an encoder-decoder and a GPT with the completion-only (masked)
loss on the same data with the same recipe and about the same number of parameters, then
evaluate on the 1,000 held-out strings: greedy exact match, next-token accuracy, loss. The
encoder-decoder is evaluated again with its encoder's output zeroed (the decoder must then
guess: proof that it reads the source). Runs one after another, so the times compare.

Every ``--every`` steps each run is evaluated on the held-out strings (the run resumes exactly
from its checkpoint; the cosine schedule is fixed to ``--iters`` from the start, so the
segments are one run): a curve of exact match by step, and the step at which each run first
gets 99 % of the strings right. A record per evaluation in results/seq2seq_curves.jsonl; a run
whose last record exists is skipped, and one stopped part-way continues.

    python benchmarks/studies/seq2seq_tasks.py --task reverse --seeds 1 2 3
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records                                            # noqa: E402
from runner import tbp                                    # noqa: E402

NAME = "seq2seq_curves"

ARCHS = {
    # 2 encoder + 2 decoder layers (237k parameters), and a 4-layer GPT (203k): the same width
    "encoder-decoder": ["--arch", "encoder-decoder", "--n-layer", "2", "--n-ctx", "16"],
    "gpt (masked loss)": ["--arch", "gpt", "--n-layer", "4", "--n-ctx", "26"],
}
RECIPE = ["--n-head", "4", "--d-model", "64", "--batch-size", "64", "--lr", "2e-3", "--min-lr", "2e-4",
          "--eval-interval", "500", "-q"]



def curve(args, data: Path, arch: str, seed: int) -> None:
    """Train ``arch`` on ``seed`` in segments of --every steps, a record after each."""
    done = {r["step"] for r in records.read(NAME) if (r["task"], r["arch"], r["seed"], r["iters"]) ==
            (args.task, arch, seed, args.iters)}
    out = Path(args.work) / f"{args.task}-{arch.split()[0]}-{seed}"
    commit = records.commit()
    for step in range(args.every, args.iters + 1, args.every):
        if step in done:
            continue
        t0 = time.perf_counter()
        if (out / "state.json").is_file() and json.loads((out / "state.json").read_text())["step"] >= args.every:
            tbp("train", "--out", out, "--resume", "--max-iters", step, "-q")
        else:
            tbp("train", "--data", data, "--out", out, "--force", "--seed", seed, "--max-iters", step,
                "--lr-decay-iters", args.iters, *ARCHS[arch], *RECIPE)
        row = {"task": args.task, "arch": arch, "seed": seed, "iters": args.iters, "step": step,
               "train_s": round(time.perf_counter() - t0, 1), "commit": commit,
               **json.loads(tbp("eval", "--checkpoint", out, "--json"))}
        if arch == "encoder-decoder" and step == args.iters:
            zeroed = json.loads(tbp("eval", "--checkpoint", out, "--json", "--zero-encoder"))
            row["zeroed_exact_match"] = zeroed["exact_match"]
            row["zeroed_token_accuracy"] = zeroed["token_accuracy"]
        records.append(NAME, row)
        print(json.dumps({k: row[k] for k in ("arch", "seed", "step", "exact_match", "token_accuracy")}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="reverse")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--every", type=int, default=250, help="steps between evaluations")
    ap.add_argument("--work", default="bench-seq2seq")
    args = ap.parse_args()
    records.pin_gemm()
    work = Path(args.work)
    data = work / f"data-{args.task}"
    if not (data / "meta.json").is_file():
        tbp("prepare", "--task", args.task, "--out", data, "--force")
    for seed in args.seeds:
        for arch in ARCHS:
            curve(args, data, arch, seed)


if __name__ == "__main__":
    main()
