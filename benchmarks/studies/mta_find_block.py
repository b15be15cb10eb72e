"""Multi-Token Attention on its paper's toy task, scaled to a CPU: find the block.

Each example is B blocks of N distinct lowercase letters joined by ".", then "#" and a query of
L letters drawn from one block (the target) in random order; no other block holds all the query
letters (Golovneva et al. 2025, toy_task/generate_data.py). The answer is the target block.
Finding it means matching several letters at once, which one query-key product cannot express:
standard attention must combine them over layers, MTA's key-query convolution can see them
side by side.

Every arm is the same GPT (4 layers as the paper's baseline, width 64, 2 heads, learned
positions), trained on the same pairs with the loss on the answer, each at its own best
learning rate. The arms:

- ``standard``: plain attention;
- ``mta``: the paper's 2 x 9 key-query convolution in every layer (72 parameters a layer);
- ``mta-1x1``, ``mta-1x3``, ``mta-1x9`` (the kernel ablation): one query row, so no mixing
  over queries; 1 x 1 only rescales each head's scores, 1 x 3 and 1 x 9 mix neighbouring keys.

The study, each phase resumable (records already written are skipped):

1. ``timing`` (on a quiet machine): each arm's training step, `tbp bench` rounds interleaved
   (results/mta_timing.jsonl). Compute is matched by wall time: every arm trains ``--steps`` x
   (the 2 x 9 arm's step time / its own) steps, so the baseline gets MTA's wall time.
2. ``sweep``: ``standard`` and ``mta`` at each of ``--lrs`` on the first seed.
3. ``seeds``: both at their best learning rate on every seed; the ablation arms at MTA's.
   With a ``--steps`` longer than any swept, the runs take the longest sweep's learning rates
   (each budget is its own set of records: a run's key is its arm, lr, seed, steps and pool).
4. ``matched``: the same question with the repeats matched and the baseline given more room.
   Each run draws from its own pool, sized to its draws (``--examples`` for MTA 2 x 9's
   ``--steps``, in proportion for the others), so every run repeats the same expected share
   of its examples; the pools are nested prefixes of one stream, and the 1,000 held-out
   examples, drawn first from another stream, are the same for every pool (and differ from the
   other phases'). Every run at the matched budget comes first: MTA 2 x 9 at its swept rate on
   ``--seeds``, standard attention at its swept rate on ``--low-seeds``, both arms at
   ``--low-lrs`` (below the old grid) on ``--low-seeds``; then standard attention at
   ``--factors`` times its budget, at its swept rate and the low ones. ``--arms``
   limits it to those arms, so two processes can share the work (each arm's pools are its own).

Training batches are drawn with replacement from ``--examples`` examples, so an arm sees some
of them more than once (the tables give each run's expected share of repeated draws); the
1,000 held-out examples are never in training. Every training is one record in
results/mta_find_block.jsonl: its config, seed, commit, CPU, steps, wall time, and `tbp eval`'s
exact match (error = 1 - exact match) with the number of held-out examples.

The documentation's tables came from exactly these (``TBP_RESULTS=DIR`` reruns them from scratch):

    python benchmarks/studies/mta_find_block.py timing
    python benchmarks/studies/mta_find_block.py sweep                  # --steps 2000, seed 1
    python benchmarks/studies/mta_find_block.py seeds --steps 6000     # every arm, seeds 1-3
    python benchmarks/studies/mta_find_block.py matched --steps 6000 --seeds 1 2 3 4 5
"""
import argparse
import json
import random
import statistics
import string
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from runner import tbp

LETTERS = string.ascii_lowercase
SHAPE = ["--n-layer", 4, "--n-head", 2, "--d-model", 64]
ARMS = {"standard": [], "mta": ["--attention", "mta", "--mta-cq", 2, "--mta-ck", 9],
        "mta-1x1": ["--attention", "mta", "--mta-cq", 1, "--mta-ck", 1],
        "mta-1x3": ["--attention", "mta", "--mta-cq", 1, "--mta-ck", 3],
        "mta-1x9": ["--attention", "mta", "--mta-cq", 1, "--mta-ck", 9]}
SWEPT = ("standard", "mta")             # the ablation arms take MTA's learning rate
MATCHED_TO = "mta"


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


HELD_OUT = 1000


def data(args, pool: int | None = None) -> Path:
    """The pairs dataset: --examples training examples and 1,000 held out, all distinct; with
    ``pool``, that many training examples before the held-out ones of :func:`pooled`."""
    if pool is not None:
        return pooled(args, pool)
    work = Path(args.work)
    out = work / "data"
    if (out / "meta.json").exists():
        return out
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    seen, rows = set(), []
    while len(rows) < args.examples + 1000:
        src, tgt = example(rng, args.blocks, args.block_size, args.query)
        if src not in seen:
            seen.add(src)
            rows.append(f"{src}\t{tgt}\n")
    (work / "find-block.tsv").write_text("".join(rows))
    tbp("prepare", "--format", "pairs", "--data", work / "find-block.tsv", "--out", out, "--force",
        "--val-fraction", 1000 / len(rows))
    return out


def pooled(args, pool: int) -> Path:
    """A dataset whose training part is the first ``pool`` examples of one stream (seed 0) and
    whose last 1,000 are held out, drawn first from another stream (seed 1) and never trained
    on: every pool holds the same held-out examples, and a smaller pool is a prefix of a larger."""
    work = Path(args.work)
    out = work / f"data-pool{pool}"
    if (out / "meta.json").exists():
        return out
    work.mkdir(parents=True, exist_ok=True)
    shape = (args.blocks, args.block_size, args.query)
    held, heldout = random.Random(1), {}
    while len(heldout) < HELD_OUT:
        src, tgt = example(held, *shape)
        heldout.setdefault(src, tgt)
    rng, seen, rows = random.Random(0), set(heldout), []
    while len(rows) < pool:
        src, tgt = example(rng, *shape)
        if src not in seen:
            seen.add(src)
            rows.append(f"{src}\t{tgt}\n")
    rows += [f"{src}\t{tgt}\n" for src, tgt in heldout.items()]
    tsv = work / f"find-block-pool{pool}.tsv"
    tsv.write_text("".join(rows))
    n = len(rows)
    del rows, seen                                # ~1 GB at the largest pool, while prepare runs
    tbp("prepare", "--format", "pairs", "--data", tsv, "--out", out, "--force", "--val-fraction", HELD_OUT / n)
    tsv.unlink()
    return out


def n_ctx(args, pool: int | None = None) -> int:
    return json.loads((data(args, pool) / "meta.json").read_text())["max_example_tokens"] + 1


def timing(args) -> None:
    done = {r["arm"] for r in records.read("mta_timing") if r["n_layer"] == SHAPE[1]}
    if all(arm in done for arm in ARMS):
        return
    ms = {arm: [] for arm in ARMS}
    for _ in range(args.rounds):
        for arm, flags in ARMS.items():
            d = json.loads(tbp("bench", *SHAPE, *flags, "--n-ctx", n_ctx(args), "--batch-size", 32,
                               "--vocab-size", 31, "--iters", 10, "--gen-tokens", 8, "--threads", 1,
                               "--precision", "fp32", "--json"))
            ms[arm].append(d["train_ms_per_iter"])
    for arm in ARMS:
        records.append("mta_timing", {"n_layer": SHAPE[1], "arm": arm, "commit": records.commit(), "threads": 1,
                                      "rounds": args.rounds, "step_ms": statistics.median(ms[arm]),
                                      "step_ms_all": ms[arm]})
    print({a: round(statistics.median(v), 1) for a, v in ms.items()}, flush=True)


def matched_steps(args, arm: str) -> int:
    t = {r["arm"]: r["step_ms"] for r in records.read("mta_timing") if r["n_layer"] == SHAPE[1]}
    if arm not in t or MATCHED_TO not in t:
        sys.exit("no step times: run the timing phase first")
    return round(args.steps * t[MATCHED_TO] / t[arm])


def _key(r: dict) -> tuple:
    """A run's identity: arm, rate, seed, steps, and its pool (None: the fixed ``--examples``)."""
    return r["arm"], r["lr"], r["seed"], r["steps"], r.get("pool")


def pool_of(args, arm: str, factor: int) -> int:
    """The matched phase's pool for a run: draws per example kept at MTA 2 x 9's."""
    return round(args.examples * factor * matched_steps(args, arm) / args.steps)


def train_one(args, arm: str, lr: float, seed: int, phase: str, factor: int = 1, pooled: bool = False,
              swept: bool = True) -> None:
    """One training of ``arm`` for ``factor`` times its matched steps, then its held-out eval;
    ``pooled``: from its own pool (the matched phase); ``swept``: at the rate its sweep chose."""
    steps = factor * matched_steps(args, arm)
    pool = pool_of(args, arm, factor) if pooled else None
    if (arm, lr, seed, steps, pool) in {_key(r) for r in records.read("mta_find_block")}:
        return
    run = Path(args.work) / (f"{arm}-lr{lr:g}-n{steps}-s{seed}" + (f"-p{pool}" if pool is not None else ""))
    if (run / "state.json").exists():             # stopped part-way: continue it (tbp resumes exactly)
        tbp("train", "--out", run, "--resume", "--threads", 1, "-q")
    else:
        tbp("train", "--data", data(args, pool), "--out", run, "--force", "--seed", seed, "--threads", 1, *SHAPE,
            *ARMS[arm], "--n-ctx", n_ctx(args, pool), "--batch-size", 32, "--lr", lr, "--min-lr", lr / 10,
            "--max-iters", steps, "--eval-interval", 500, "-q")
    ev = json.loads(tbp("eval", "--checkpoint", run, "--json"))
    state = json.loads((run / "state.json").read_text())
    cfg = json.loads((run / "config.json").read_text())
    row = {"phase": phase, "n_layer": SHAPE[1], "arm": arm, "lr": lr, "seed": seed, "steps": steps,
           **({"pool": pool, "factor": factor, "swept_lr": swept} if pool is not None else {}),
           "commit": records.commit(), "config": cfg, "train_s": state["elapsed_s"], "threads": 1,
           "examples": ev["examples"], "exact_match": ev["exact_match"], "error": 1 - ev["exact_match"],
           "token_accuracy": ev["token_accuracy"], "val_loss": ev["val_loss"]}
    records.append("mta_find_block", row)
    print(json.dumps({k: row[k] for k in ("arm", "lr", "seed", "steps", "error", "val_loss")}), flush=True)


def best_lr(arm: str) -> float | None:
    """The swept learning rate with the lowest error (then validation loss) on the seed the sweep
    ran on, in the longest budget swept (a longer budget's runs take the shorter sweep's best)."""
    sweep = [r for r in records.read("mta_find_block") if r["arm"] == arm and r["phase"] == "sweep"]
    if not sweep:
        return None
    seed = min(r["seed"] for r in sweep)          # one seed is swept; any later one is not a sweep
    sweep = [r for r in sweep if r["seed"] == seed]
    longest = max(r["steps"] for r in sweep)
    return min((r for r in sweep if r["steps"] == longest), key=lambda r: (r["error"], r["val_loss"]))["lr"]


def sweep(args) -> None:
    for arm in SWEPT:
        for lr in args.lrs:
            train_one(args, arm, lr, args.seeds[0], "sweep")


def seeds(args) -> None:
    """The two swept arms on every seed first (seeds outermost: a partial run is balanced), then
    the ablation arms at MTA's learning rate (``--arms``: only these)."""
    for group in (SWEPT, [arm for arm in ARMS if arm not in SWEPT]):
        group = [arm for arm in group if arm in args.arms]
        for seed in args.seeds:
            for arm in group:
                lr = best_lr(arm if arm in SWEPT else MATCHED_TO)
                if lr is None:
                    sys.exit(f"no learning-rate sweep for {arm}: run the sweep phase first")
                train_one(args, arm, lr, seed, "seed" if arm in SWEPT else "ablation")


def matched(args) -> None:
    """The repeats matched. Every pool is built first (one process per arm may then share the
    work); then every run at the matched budget -- MTA 2 x 9 at its swept rate on every seed,
    both arms at the low rates on the low seeds -- and last standard attention's longer budgets."""
    arms = [arm for arm in SWEPT if arm in args.arms]
    swept = {arm: best_lr(arm) for arm in arms}
    if None in swept.values():
        sys.exit("no learning-rate sweep: run the sweep phase first")
    for arm in arms:
        for factor in ([1] if arm == "mta" else sorted({1, *args.factors})):
            data(args, pool_of(args, arm, factor))
    std = swept.get("standard")
    runs = [("mta", swept.get("mta"), s, 1, True) for s in args.seeds]            # MTA 2 x 9, every seed
    runs += [("standard", std, s, 1, True) for s in args.low_seeds]               # the baseline, matched budget
    runs += [(arm, lr, s, 1, False) for s in args.low_seeds for arm in arms       # both below the old grid
             for lr in args.low_lrs if lr != swept[arm]]
    if std is not None:                                                          # the longer budgets
        runs += [("standard", lr, s, f, lr == std) for f in sorted(set(args.factors) - {1})
                 for s in args.low_seeds for lr in sorted({std, *args.low_lrs})]
    for arm, lr, seed, factor, at_swept in runs:
        if arm in arms:
            train_one(args, arm, lr, seed, "matched", factor, pooled=True, swept=at_swept)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phases", nargs="+", choices=["timing", "sweep", "seeds", "matched"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3])
    ap.add_argument("--steps", type=int, default=2000, help="the 2 x 9 MTA arm's steps; the others match its time")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="seeds and matched phases: these arms")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--query", type=int, default=2)
    ap.add_argument("--examples", type=int, default=300_000, help="training examples (matched: MTA 2 x 9's pool)")
    ap.add_argument("--factors", type=int, nargs="+", default=[1, 3], help="matched: standard attention's budgets")
    ap.add_argument("--low-lrs", type=float, nargs="+", default=[5e-4], help="matched: rates beside the swept one")
    ap.add_argument("--low-seeds", type=int, nargs="+", default=[1, 2], help="matched: seeds of the other runs")
    ap.add_argument("--work", default="bench-mta")
    args = ap.parse_args()
    records.pin_gemm()
    for phase in args.phases:
        {"timing": timing, "sweep": sweep, "seeds": seeds, "matched": matched}[phase](args)


if __name__ == "__main__":
    main()
