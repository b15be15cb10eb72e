"""Defaults that learn faster: `tbp train`'s default run against candidate defaults, paired on seeds.

Each arm is the default run (`tbp train` with no model options: 4 x 128, context 128, 1,500
steps on the built-in corpus) with some training options changed. A seed pairs the arms: the
same initialisation and batch order, so the paired difference isolates the options. Recorded per
(arm, seed): the loss of the final weights over the whole validation split, the run's time on
its own clock and its steps. A candidate becomes a default only where it reaches a lower loss
than the default by more than the seeds' spread, in no more time; the baseline keeps its own
best learning rate in the comparison (an AdamW arm at a higher rate), so that a win is the
optimizer's or the schedule's, not a rate the default was never given.

    python benchmarks/studies/defaults.py --seeds 1 2 3 --jobs 2

``--jobs 2`` runs two trainings side by side, one thread each: the losses are those of
one-thread runs (a run repeats bit for bit at a given thread count) and the times compare the
arms with each other, each run having had a core. A seed already recorded for an arm with the
same options is skipped. Records: results/defaults.jsonl; the table is report.py's ``defaults``.
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records                                            # noqa: E402
from runner import builtin_data, side_by_side, tbp        # noqa: E402

NAME = "defaults"
ARMS = {
    "default": [],
    "AdamW, lr 2e-3": ["--lr", "2e-3"],
    "Muon, lr 3e-3": ["--optimizer", "muon", "--lr", "3e-3"],
    "Muon, lr 3e-3, wsd": ["--optimizer", "muon", "--lr", "3e-3", "--schedule", "wsd"],
    # the baseline's rate raised once more, and Muon held to the default's time (its steps cost
    # about 16 % more at this size: 1,300 of them take what 1,500 of AdamW's do)
    "AdamW, lr 4e-3": ["--lr", "4e-3"],
    "Muon, lr 3e-3, wsd, 1,300 steps": ["--optimizer", "muon", "--lr", "3e-3", "--schedule", "wsd",
                                        "--max-iters", "1300"],
}


def train_once(arm: str, seed: int, threads: int, data: str) -> dict:
    """One default run with ``arm``'s options at ``seed``: its final whole-split validation loss."""
    commit = records.commit()                      # the code the run starts with
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        tbp("train", "--data", data, "--out", out, "--seed", seed, "--threads", threads, "--quiet", *ARMS[arm])
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        final = [m for m in metrics if "val_split_loss" in m][-1]
        state = json.loads((out / "state.json").read_text())
        config = json.loads((out / "config.json").read_text())
    return {"arm": arm, "options": ARMS[arm], "seed": seed, "threads": threads, "steps": final["step"],
            "val_split_loss": final["val_split_loss"], "val_split_tokens": final["val_split_tokens"],
            "val_estimate": final["val_loss"], "elapsed_s": state["elapsed_s"], "tokens": state["tokens_seen"],
            "model": config["model"], "train": config["train"], "commit": commit}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--jobs", type=int, default=2, help="runs side by side, one thread each (1: one run, every core)")
    p.add_argument("--work", type=Path, default=Path("/tmp/tbp-defaults"))
    a = p.parse_args()
    done = {(r["arm"], r["seed"]) for r in records.read(NAME) if r["options"] == ARMS.get(r["arm"])}
    todo = [(arm, s) for s in a.seeds for arm in a.arms if (arm, s) not in done]
    data = builtin_data(a.work)
    threads = 1 if a.jobs > 1 else 0

    def record(rec: dict) -> None:
        records.append(NAME, rec)
        print(f"{rec['arm']} seed {rec['seed']}: val {rec['val_split_loss']:.4f} ({rec['elapsed_s']:.0f} s)",
              flush=True)
    side_by_side(a.jobs, [(arm, s, threads, data) for arm, s in todo], train_once, record)


if __name__ == "__main__":
    main()
