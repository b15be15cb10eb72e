"""Long-range retrieval under sparse decoding: free-running exact match, dense against each rule.

The task (written by ``make``): a line holds ``facts`` key-value facts -- a key is one of 512
characters, drawn without replacement, its value three random digits -- then ``|``, then every
fact again as a query, in a fresh random order. A model that has learned to retrieve predicts
each query's digits from the fact with the same key, however far back it is; nothing else
predicts them (chance: 1 in 1,000). Training text and held-out lines come from different seeds.

The measurement (``eval``): for each held-out line of ``--facts`` facts, the prompt is
everything up to and including the last query's key; that key's fact lies 1,000 to 2,000 tokens
back, beyond any window the budgets allow. The prompt without its key is prefilled densely once;
then, for dense decoding and for each rule x budget, the key and two generated digits are
decoded one token at a time under the rule (greedy), and the three generated digits are
compared with the fact's value. One record per rule x budget in
benchmarks/results/retrieval.jsonl, with the number of held-out ``sequences``, the hits and
Wilson's 95 % interval.

    python benchmarks/retrieval.py make --out /tmp/retrieval        # the corpora
    tbp prepare --data /tmp/retrieval/train256.txt --out /tmp/retrieval/d256   # then train a rotary model on it
    python benchmarks/retrieval.py eval --run RUN --heldout /tmp/retrieval/heldout.txt
"""
import argparse
import time
from pathlib import Path

import numpy as np

import records
from stats import binomial_ci
from tbp import checkpoint
from tbp.nn.sparse import KINDS, Sparsity

KEYS = [chr(0x4E00 + i) for i in range(512)]
DIGITS = 3
HELDOUT_SEED = 1_000_003


def line(rng: np.random.Generator, facts: int) -> str:
    keys = rng.choice(len(KEYS), facts, replace=False)
    values = rng.integers(0, 10 ** DIGITS, facts)
    told = "".join(f"{KEYS[k]}{v:0{DIGITS}d}" for k, v in zip(keys, values))
    asked = "".join(f"{KEYS[keys[i]]}{values[i]:0{DIGITS}d}" for i in rng.permutation(facts))
    return told + "|" + asked


def make(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, facts, count, seed in (("train256", 32, args.short, 1), ("train2048", args.facts, args.long, 2),
                                     ("heldout", args.facts, args.heldout, HELDOUT_SEED)):
        rng = np.random.default_rng(seed)
        with open(out / f"{name}.txt", "w", encoding="utf-8") as f:
            for _ in range(count):
                f.write(line(rng, facts) + "\n")
        print(f"{out / name}.txt: {count:,} lines of {facts} facts")


def greedy(dec, first: np.ndarray, steps: int) -> np.ndarray:
    """Decode ``first`` (B,) then ``steps - 1`` greedy tokens; returns the ``steps`` argmaxes (B, steps)."""
    got = np.empty((len(first), steps), dtype=np.int64)
    tok = first
    for s in range(steps):
        tok = dec.forward(tok[:, None], check=False)[:, -1].argmax(-1)
        got[:, s] = tok
    return got


def answers(model, ids: np.ndarray, rules: list, batch: int, log=print) -> list[np.ndarray]:
    """Per rule (None: dense), the DIGITS tokens (S, DIGITS) generated greedily for each line of
    ids (S, L) from its last key on. Each batch of lines is prefilled densely once, up to the
    last key; each rule then decodes from there."""
    S, L = ids.shape
    prompt = L - DIGITS                                                   # up to and including the last key
    out = [np.empty((S, DIGITS), dtype=np.int64) for _ in rules]
    t = time.time()
    for b0 in range(0, S, batch):
        rows = ids[b0:b0 + batch]
        dec = model.inference(len(rows))
        dec.forward(rows[:, :prompt - 1])                                 # dense, once
        for i, rule in enumerate(rules):
            dec.rewind(prompt - 1)                                        # back to the prefill
            dec.sparse = rule
            out[i][b0:b0 + len(rows)] = greedy(dec, rows[:, prompt - 1], DIGITS)
        log(f"{b0 + len(rows)}/{S} lines, dense {int((out[0][:b0 + len(rows)] == ids[:b0 + len(rows), prompt:]).all(1).sum())}"
            f" right, {time.time() - t:.0f} s")
    return out


def evaluate(args) -> None:
    model, tok, _ = checkpoint.load_model(args.run)
    lines = Path(args.heldout).read_text(encoding="utf-8").splitlines()[:args.sequences]
    ids = np.array([tok.encode(s) for s in lines])                        # (S, L): every line has one length
    S, L = ids.shape
    n = L - 1                                                             # cache length at the last step
    budgets = args.budgets or [n // d for d in (64, 32, 16, 8, 4)]
    layer_sets = [tuple(int(x) for x in s.split(",")) for s in args.layers]
    rules = [None] + [Sparsity(kind, K, layers) for layers in layer_sets for K in budgets for kind in KINDS
                      if kind == "lessismore" or layers == layer_sets[0]]
    got = answers(model, ids, rules, args.batch, log=lambda m: print(m, flush=True))
    hits = [int((g == ids[:, L - DIGITS:]).all(1).sum()) for g in got]
    for rule, hit in zip(rules, hits):
        lo, hi = binomial_ci(hit, S)
        rec = {"commit": records.commit(), "seed": args.seed, "run": str(args.run), "n_layer": model.config.n_layer,
               "config": model.config.to_dict(), "n_cache": n, "kind": rule.kind if rule else "dense",
               "sequences": S, "hits": hit, "exact_match": hit / S, "ci95": [lo, hi]}
        if rule is not None:
            rec["budget"], rec["layers"] = rule.budget, list(rule.layers)
        records.append("retrieval", rec)
        print(f"{rec['kind']:10s} K {rec.get('budget', n):5d} layers {rec.get('layers', '-')}: "
              f"{hit}/{S} = {hit / S:.3f} [{lo:.3f}, {hi:.3f}]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--facts", type=int, default=255, help="facts per long line (255: 2,041 characters)")
    m.add_argument("--short", type=int, default=40_000, help="lines of 32 facts (the first stage)")
    m.add_argument("--long", type=int, default=3_000, help="lines of --facts facts (the second stage)")
    m.add_argument("--heldout", type=int, default=512)
    e = sub.add_parser("eval")
    e.add_argument("--run", required=True)
    e.add_argument("--heldout", required=True)
    e.add_argument("--sequences", type=int, default=512)
    e.add_argument("--batch", type=int, default=32)
    e.add_argument("--layers", nargs="+", default=["1"], help="selection-layer sets, each comma-separated")
    e.add_argument("--budgets", type=int, nargs="+", help="default: n/64, n/32, n/16, n/8, n/4")
    e.add_argument("--seed", type=int, default=0, help="the trained model's seed (for the record)")
    a = p.parse_args()
    make(a) if a.cmd == "make" else evaluate(a)


if __name__ == "__main__":
    main()
