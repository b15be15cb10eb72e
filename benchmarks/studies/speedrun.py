"""The Shakespeare speedrun: a recipe trained for a wall-clock budget, scored on held-out text.

One record per (arm, budget, seed) in benchmarks/results/speedrun.jsonl. An arm is a recipe
file (recipes/*.json) with optional overrides (``--set mlp=standard``: an ablation), trained by
``tbp train`` in a subprocess on data/tinyshakespeare.txt for ``--budget`` seconds
(``--max-time``), evaluating as it goes (every arm's estimate over about 64 windows of each
split, so an evaluation costs each arm about the same); the record keeps its configuration, the commit, the
CPU, the threads, the tokens and steps it took, its evaluations' curve, and:

- ``half_a`` / ``half_b``: the loss of the final weights over the validation split's first and
  second halves, every position of every non-overlapping window of the context counted
  (nanoGPT's definition, over the whole half). Half A is what tuning looks at; half B is looked
  at only for the reported figures, so the choices made on A cannot have fitted it.
- ``time_to_target_s``: the command's wall-clock time from its start to the first evaluation
  whose estimate is at or below ``--target`` (``--target-loss``; start-up and evaluations
  included: the run's own clock there plus the start-up, measured as the command's wall time less
  the run's clock at its end), or None.

``--fit`` fits a recipe keyed to steps (nanoGPT's cosine) to the budget: the step time is measured
on a short probe run (not scored), and the cosine's steps, warmup (the recipe's share of them)
and decay become what the budget holds, so the rate has decayed when the clock stops the run.

A seed already recorded for an arm with the same configuration is skipped (whatever the
commit: a study spans sessions; ``--again`` reruns it), so a study resumes where it stopped:

    python benchmarks/studies/speedrun.py recipes/shakespeare-speedrun.json --budget 900 --seeds 1 2 3
    python benchmarks/studies/speedrun.py recipes/nanogpt-shakespeare-char.json --fit --budget 900 --seeds 1 2 3
    python benchmarks/studies/speedrun.py recipes/shakespeare-speedrun.json --set optimizer=adamw --arm "no Muon"

``--exact SECONDS`` runs a recipe keyed to steps (nanoGPT's, exactly as written) until an
evaluation reaches the target (or to its last step), SECONDS of training per call, each call resuming the last (bit for bit): a run of hours spread
over sittings, which records the step at which the recipe reaches the target (the engine ratio's
step count):

    python benchmarks/studies/speedrun.py recipes/nanogpt-shakespeare-char.json --exact 2400 --seeds 1 \
        --work ~/tbp-speedrun

``--plan benchmarks/studies/speedrun_plan.json`` runs the whole study in its order (the recipes at
15 minutes, the ablations, then 30 and 60), each seed once: the command to leave running in the
background, and to start again after an interruption.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "tinyshakespeare.txt"
TARGET = 1.48                     # nanoGPT's recipe's validation loss just before it overfits (issue #211)
EVAL_WINDOWS = 64                 # every arm's in-run estimate: about this many windows of each split


def eval_batches(train: dict) -> int:
    """Batches of the arm's own size that make about EVAL_WINDOWS windows: an evaluation costs
    every arm about the same."""
    return max(1, -(-EVAL_WINDOWS // train.get("batch_size", 12)))


def recipe(path: Path, sets: list[str]) -> dict:
    """The recipe's {"model": ..., "train": ...}, with each KEY=VALUE of ``sets`` put in the
    training section where TrainConfig declares KEY, else in the model's (the value read as
    JSON, else as text). tbp train reads both sections as its options and refuses a key that
    is none, so a design's own options (qk_norm_eps, ...) need no list here."""
    from tbp.train.config import TrainConfig
    out = json.loads(path.read_text())
    out.setdefault("model", {}), out.setdefault("train", {})
    for item in sets:
        key, _, text = item.partition("=")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        out["train" if key in TrainConfig.__dataclass_fields__ else "model"][key] = value
    return out


def train(config: dict, out: Path, seed: int, budget: float, threads: int, target: float,
          resume: bool = False) -> float:
    """``tbp train`` of ``config`` into ``out`` for ``budget`` seconds (``resume``: the run in ``out``
    continued, bit for bit, for ``budget`` seconds more); its wall time (a failed run ends the
    study, with its error)."""
    cfg_file = out.parent / (out.name + ".recipe.json")        # not with_suffix: arm names hold dots
    if resume:
        cmd = [sys.executable, "-m", "tbp", "train", "--out", str(out), "--resume", "--threads", str(threads),
               "--quiet"]
    else:
        cfg_file.write_text(json.dumps(config))
        cmd = [sys.executable, "-m", "tbp", "train", "--config", str(cfg_file), "--data", str(DATA), "--out",
               str(out), "--force", "--seed", str(seed), "--threads", str(threads), "--quiet"]
    if budget:
        cmd += ["--max-time", str(budget)]
    if target and not resume:                 # a resumed run keeps its own
        cmd += ["--target-loss", str(target)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall


def fitted(config: dict, work: Path, budget: float, threads: int, probe_steps: int = 8) -> tuple[dict, float]:
    """``config`` with its step-keyed schedule fitted to ``budget``: the step time measured over a probe
    of ``probe_steps`` steps (the first two left out: warm-up of the caches), the steps the budget
    holds less its evaluations, and warmup at the recipe's share of its steps."""
    from tbp.runs.disk import read_metrics
    t = config["train"]
    probe = {**config, "train": {**t, "max_iters": probe_steps, "eval_interval": 10 ** 6, "log_interval": 1,
                                 "eval_batches": 1}}
    train(probe, work / "probe", 0, 0, threads, 0)
    rows = [m for m in read_metrics(work / "probe") if "elapsed_s" in m and "val_loss" not in m]
    per_step = (rows[-1]["elapsed_s"] - rows[1]["elapsed_s"]) / (rows[-1]["step"] - rows[1]["step"])
    # the whole budget in steps: its 8 evaluations may run it a few steps over, and the clock
    # then stops it where the cosine is within a few per cent of its floor (a fit that held back
    # the evaluations' share left 12 % of the budget unused: the probe's steps ran slower)
    steps = max(8, int(budget / per_step))
    share = t.get("warmup", 100) / t.get("max_iters", 5000)
    fit = {**t, "max_iters": steps, "lr_decay_iters": steps, "warmup": max(1, round(share * steps)),
           "eval_interval": max(1, min(t["eval_interval"], steps // 8))}
    return {**config, "train": fit}, per_step


def halves(run: Path) -> dict:
    """The final weights' loss over each half of the validation split, every window of the context."""
    from tbp.data.datasets import Dataset
    from tbp.runs.disk import load_model, read_config
    model, _, _ = load_model(run)
    ds = Dataset.load(read_config(run)["data"])
    val = np.asarray(ds.val, dtype=np.int64)
    T, mid = model.config.n_ctx, val.size // 2
    out = {}
    for name, part in (("half_a", val[:mid]), ("half_b", val[mid:])):
        starts = np.arange(0, part.size - T - 1 + 1, T)
        windows = part[starts[:, None] + np.arange(T + 1)]
        total = sum(model.loss(w[:, :-1], w[:, 1:], keep=False) * len(w) * T
                    for w in np.array_split(windows, max(1, len(windows) // 16)))
        out[name] = float(total / (len(windows) * T))
        out[name + "_tokens"] = int(len(windows) * T)
    return out


def _same_recipe(recorded: dict, recipe: dict, fit: bool) -> bool:
    """A record's training options are the recipe's, less what the harness set itself (the
    evaluation's batches; a fitted schedule's steps)."""
    own = ("eval_batches",) + (("max_iters", "lr_decay_iters", "warmup", "eval_interval") if fit else ())
    return all(recorded.get(k) == v for k, v in recipe.items() if k not in own)


def run_arm(recipe_path: Path, arm: str, sets: list[str], fit: bool, budgets: list[float], seeds: list[int],
            threads: int, target: float, work: Path, again: bool = False) -> None:
    """Every (budget, seed) of one arm not recorded yet: trained, scored, one record each."""
    base = recipe(recipe_path, sets)
    commit = records.commit()
    work.mkdir(parents=True, exist_ok=True)
    # a seed recorded before with this arm's very configuration is not run again, whatever the
    # commit (a study spans sessions); --again runs it anyway
    done = set() if again else {(r["arm"], r["budget_s"], r["seed"]) for r in records.read("speedrun")
                                if r["model"] == base["model"] and r["sets"] == sets
                                and _same_recipe(r["train"], base["train"], r["fit"])}
    for budget in budgets:
        todo = [s for s in seeds if (arm, budget, s) not in done]
        if len(todo) < len(seeds):
            print(f"{arm} {budget:g} s: seeds {sorted(set(seeds) - set(todo))} recorded already", flush=True)
        if not todo:
            continue
        # one probe of the step time serves every seed of a budget
        config, per_step = fitted(base, work, budget, threads) if fit else (base, None)
        config = {**config, "train": {**config["train"], "eval_batches": eval_batches(config["train"])}}
        for seed in todo:
            out = work / f"{arm}-{budget:g}-{seed}".replace(" ", "_")
            wall = train(config, out, seed, budget, threads, target)
            from tbp.runs.disk import read_metrics, read_state
            state, metrics = read_state(out), read_metrics(out)
            evals = [m for m in metrics if "val_loss" in m]
            startup = wall - evals[-1]["elapsed_s"]
            reached = next((m for m in evals if "target_s" in m), None)
            shown = recipe_path.relative_to(ROOT) if recipe_path.is_relative_to(ROOT) else recipe_path
            rec = {"study": "speedrun", "arm": arm, "recipe": str(shown), "sets": sets, "fit": fit,
                   "fit_step_s": per_step, "budget_s": budget, "seed": seed, "commit": commit, "threads": threads,
                   "model": config["model"], "train": config["train"], "target": target,
                   "wall_s": wall, "startup_s": startup, "steps": state["step"], "tokens": state["tokens_seen"],
                   "run_clock_s": state["elapsed_s"], "stopped": state.get("stopped"),
                   "time_to_target_s": reached and reached["target_s"] + startup,
                   "step_at_target": reached and reached["step"],
                   "val_split": evals[-1].get("val_split_loss"),
                   "curve": [[m["step"], round(m["elapsed_s"], 2), round(m["val_loss"], 5)] for m in evals
                             if "val_split_loss" not in m],
                   **halves(out)}
            records.append("speedrun", rec)
            print(f"{arm} {budget:g} s seed {seed}: half A {rec['half_a']:.4f} · half B {rec['half_b']:.4f} · "
                  f"{rec['tokens']:,} tokens in {rec['steps']:,} steps · target "
                  f"{'at %.0f s' % rec['time_to_target_s'] if reached else 'not reached'}", flush=True)


def exact(recipe_path: Path, seeds: list[int], segment: float, threads: int, target: float, work: Path) -> None:
    """A recipe keyed to steps (nanoGPT's) run until it reaches the target (or its last step),
    each seed a segment of ``segment`` seconds per call (--max-time, then --resume: the run goes
    on bit for bit, its clock summing the segments), so that it spans sittings; once a seed's
    run has ended, one record in
    results/speedrun_exact.jsonl: the step and the run's clock at the first evaluation at or below
    the target, the segments, and the curve. Its step count to the target, times each engine's
    step time (benchmarks/peers/nanogpt_step.py), is the recipe's time in that engine."""
    from tbp.runs.disk import read_metrics, read_state
    config = recipe(recipe_path, [])
    config = {**config, "train": {**config["train"], "eval_batches": eval_batches(config["train"])}}
    done = {r["seed"] for r in records.read("speedrun_exact") if r["recipe_file"] == recipe_path.name
            and r["train"] == config["train"] and r["model"] == config["model"]}
    work.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        if seed in done:
            print(f"{recipe_path.name} seed {seed}: recorded already", flush=True)
            continue
        out = work / f"{recipe_path.stem}-exact-{seed}"
        log = work / f"{out.name}.segments.jsonl"          # beside the run: its folder is tbp's
        started = (out / "state.json").is_file()
        state = read_state(out) if started else {}
        # a run goes on until an evaluation reaches the target or its last step: its schedule is
        # keyed to the recipe's steps, so stopping at the target changes nothing before it
        if state.get("target_step") is None and state.get("step", 0) < config["train"]["max_iters"]:
            commit = records.commit()
            train(config, out, seed, segment, threads, target, resume=started)
            with open(log, "a") as f:
                f.write(json.dumps({"commit": commit, "segment_s": segment}) + "\n")
            state = read_state(out)
            print(f"{recipe_path.name} seed {seed}: step {state['step']:,} of {config['train']['max_iters']:,}, "
                  f"{state['elapsed_s'] / 3600:.2f} h of training", flush=True)
            if state.get("target_step") is None and state["step"] < config["train"]["max_iters"]:
                return                          # one segment a call: the caller decides when the next runs
        evals = [m for m in read_metrics(out) if "val_loss" in m and "val_split_loss" not in m]
        reached = next((m for m in evals if "target_s" in m), None)
        segments = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        records.append("speedrun_exact", {
            "study": "speedrun", "recipe_file": recipe_path.name, "seed": seed, "threads": threads,
            "model": config["model"], "train": config["train"], "target": target,
            "commits": sorted({g["commit"] for g in segments}), "commit": segments[-1]["commit"],
            "segments": len(segments), "steps": state["step"], "tokens": state["tokens_seen"],
            "run_clock_s": state["elapsed_s"], "step_at_target": reached and reached["step"],
            "run_clock_at_target_s": reached and reached["target_s"],
            "best_val_estimate": min(m["val_loss"] for m in evals),
            "curve": [[m["step"], round(m["elapsed_s"], 2), round(m["val_loss"], 5)] for m in evals]})
        print(f"{recipe_path.name} seed {seed}: ended; target "
              f"{'at step %d' % reached['step'] if reached else 'not reached'}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", type=Path, nargs="?", help="a recipe file (or --plan)")
    p.add_argument("--plan", type=Path, help="a JSON list of arms ({recipe, arm, sets, fit, budgets, seeds}), run "
                                             "in order, each seed not recorded yet")
    p.add_argument("--budget", type=float, nargs="+", default=[900.0], help="seconds of training (--max-time)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--arm", help="the record's name for this arm (default: the recipe's file name)")
    p.add_argument("--fit", action="store_true", help="fit a step-keyed cosine to the budget (nanoGPT's recipe)")
    p.add_argument("--threads", type=int, default=0, help="tbp train --threads (0: one per core)")
    p.add_argument("--target", type=float, default=TARGET)
    p.add_argument("--work", type=Path, default=Path("/tmp/tbp-speedrun"))
    p.add_argument("--again", action="store_true", help="run seeds already recorded for this arm too")
    p.add_argument("--exact", type=float, metavar="SECONDS", help="run the recipe as written to its last step, "
                   "SECONDS of it per call (resumed by the next call), and record where it reached the target")
    args = p.parse_args()
    if (args.recipe is None) == (args.plan is None):
        p.error("give a recipe or --plan")
    records.pin_gemm()
    threads = args.threads or os.cpu_count()
    if args.exact:
        path = args.recipe if args.recipe.is_absolute() else ROOT / args.recipe
        return exact(path, args.seeds, args.exact, threads, args.target, args.work)
    arms = json.loads(args.plan.read_text()) if args.plan else [
        {"recipe": str(args.recipe), "arm": args.arm, "sets": args.sets, "fit": args.fit, "budgets": args.budget,
         "seeds": args.seeds}]
    for a in arms:
        path = Path(a["recipe"])
        run_arm(path if path.is_absolute() else ROOT / path, a.get("arm") or path.stem, a.get("sets", []),
                a.get("fit", False), [float(b) for b in a.get("budgets", args.budget)], a.get("seeds", args.seeds),
                threads, args.target, args.work, args.again)


if __name__ == "__main__":
    main()
