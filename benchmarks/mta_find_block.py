"""Multi-Token Attention on its paper's toy task, scaled to a CPU: find the block.

Each example is B blocks of N distinct lowercase letters joined by ".", then "#" and a query of
L letters drawn from one block (the target) in random order; no other block holds all the query
letters (Golovneva et al. 2025, toy_task/generate_data.py). The answer is the target block.
Finding it means matching several letters at once, which one query-key product cannot express:
standard attention must combine them over layers, MTA's key-query convolution can see them
side by side.

Both models are the same GPT (2 layers, width 64, 2 heads, learned positions), trained on the
same pairs with the loss on the answer, the same recipe and seeds; MTA adds a 2 x 9 key-query
convolution in each layer (72 parameters). Reported: the error rate (1 - greedy exact match)
on 1,000 held-out examples, and the training time of each run (one after another).

    python benchmarks/mta_find_block.py --seeds 1 2 3
"""
import argparse
import json
import random
import string
import time
from pathlib import Path

from runner import tbp

LETTERS = string.ascii_lowercase


def example(rng: random.Random, blocks: int, n: int, q: int) -> tuple[str, str]:
    target = rng.sample(LETTERS, n)
    query = rng.sample(target, q)
    others = []
    while len(others) < blocks - 1:
        block = rng.sample(LETTERS, n)
        if not set(query) <= set(block):          # a distractor never holds every query letter
            others.append(block)
    items = others + [target]
    rng.shuffle(items)
    return ".".join("".join(b) for b in items) + "#" + "".join(query), "".join(target)



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--query", type=int, default=2)
    ap.add_argument("--examples", type=int, default=30000)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--models", nargs="+", default=["standard", "mta"], choices=["standard", "mta"])
    ap.add_argument("--work", default="bench-mta")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    seen, rows = set(), []
    while len(rows) < args.examples + 1000:
        src, tgt = example(rng, args.blocks, args.block_size, args.query)
        if src not in seen:
            seen.add(src)
            rows.append(f"{src}\t{tgt}\n")
    (work / "find-block.tsv").write_text("".join(rows))
    data = work / "data"
    tbp("prepare", "--format", "pairs", "--data", work / "find-block.tsv", "--out", data, "--force",
        "--val-fraction", 1000 / len(rows))
    meta = json.loads((data / "meta.json").read_text())
    n_ctx = meta["max_example_tokens"] + 1
    common = ["--data", data, "--n-layer", 2, "--n-head", 2, "--d-model", 64, "--n-ctx", n_ctx,
              "--batch-size", 32, "--lr", "1e-3", "--min-lr", "1e-4", "--max-iters", args.iters,
              "--eval-interval", 500, "-q"]
    models = {"standard": [], "mta 2x9": ["--attention", "mta", "--mta-cq", 2, "--mta-ck", 9]}
    models = {name: flags for name, flags in models.items() if name.split()[0] in args.models}
    results = []
    for seed in args.seeds:
        for name, flags in models.items():
            run = work / f"run-{name.split()[0]}-{seed}"
            t0 = time.perf_counter()
            tbp("train", "--out", run, "--force", "--seed", seed, *common, *flags)
            seconds = time.perf_counter() - t0
            ev = json.loads(tbp("eval", "--checkpoint", run, "--json"))
            row = {"model": name, "seed": seed, "train_s": round(seconds, 1), "error": 1 - ev["exact_match"],
                   "token_accuracy": ev["token_accuracy"], "val_loss": ev["val_loss"], "examples": ev["examples"]}
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nfind the block: {args.blocks} blocks of {args.block_size} letters, a query of {args.query}, "
          f"{args.iters} steps; error on {results[0]['examples']} held-out examples")
    print(f"{'model':<10}{'seed':>5}{'train s':>9}{'error':>8}{'next token':>12}{'val loss':>10}")
    for r in results:
        print(f"{r['model']:<10}{r['seed']:>5}{r['train_s']:>9.0f}{100 * r['error']:>7.1f}%"
              f"{100 * r['token_accuracy']:>11.1f}%{r['val_loss']:>10.4f}")


if __name__ == "__main__":
    main()
