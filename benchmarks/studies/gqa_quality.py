"""What grouped-query attention costs in quality: the default run with 4, 2 and 1 key/value heads.

The default model (4 x 128, 4 query heads, context 128, 1,500 steps on the built-in corpus) is
trained with standard attention (4 key/value heads: every query head its own keys and values)
and with ``--attention gqa --n-kv-head`` 2 (pairs of query heads share one) and 1 (multi-query
attention), and each run's final
validation loss over the whole validation split is recorded. Declared before any run: the
arms count as **equivalent if the paired difference's 95 % interval lies within ±0.02 nats**
(MARGIN), and as worse or better only if the interval excludes zero.

Fair tuning, in three phases (each skips the runs its records already hold):

- ``sweep``: the full-head arm at learning rates 5e-4, 1e-3 (the default) and 2e-3 on seeds 1
  and 2, extended by factors of 2 past an edge that holds the best (at most twice); its best
  rate (lowest mean loss) becomes every arm's rate;
- ``neighbours``: the shared-head arms at half and twice that rate on seed 1, so that a rate
  tuned for full heads cannot be what handicaps them (the reading says if a neighbour beats it);
- ``seeds``: every arm at the chosen rate on seeds 1-5, paired by seed (the same initialisation
  of what the arms share and the same batches).

``min_lr`` is a tenth of the peak in every run, the default's ratio. Beside the losses, each
arm's parameters and KV-cache bytes per token, and ``speed``: decoding tokens/s of the three
architectures paired in one process (random weights; speed needs the shape only) at the
default context and at a 4,096-token context with rotary positions. Records:
results/gqa_quality.jsonl, results/gqa_speed.jsonl; tables ``gqa_quality`` and ``gqa_speed``.

``uptrain``: Ainslie et al.'s other road to shared heads -- convert a trained full-head model by
mean-pooling its key/value heads, then train on for a few per cent of its steps: ``tbp train
--init-from FULL --attention gqa --n-kv-head K`` (``tbp.nn.pool_kv_heads``). On seeds 1..``--seeds``: the full-head run at the chosen rate (kept, in
bench-gqa/uptrain), its pooled copies with 2 and 1 key/value heads scored as converted (0
steps), then trained on for UPTRAIN steps (5 % -- the paper's proportion -- and 20 % of 1,500)
with a warmup of a tenth of them, on batches of another seed (100 + seed), at a peak rate of
UPTRAIN_RATES times the pre-training peak (swept on seed 1 for each arm and length; the other
seeds run the best) with the minimum a tenth of it; and beside them the same seeds' 2- and
1-head models trained from scratch on this machine, so every comparison is paired. Records:
results/gqa_uptrain.jsonl; table ``gqa_uptrain``.

    python benchmarks/studies/gqa_quality.py sweep neighbours seeds --jobs 2
    python benchmarks/studies/gqa_quality.py speed
    python benchmarks/studies/gqa_quality.py uptrain --seeds 3

``TBP_GEMM`` is pinned to ``numpy`` unless set; ``TBP_RESULTS=DIR`` reruns it from scratch.
"""
import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records                                            # noqa: E402
import runner                                             # noqa: E402
from tbp.nn.decode import Inference

NAME, SPEED, UP = "gqa_quality", "gqa_speed", "gqa_uptrain"
WORK = Path("bench-gqa")            # the prepared corpus the runs share (the runs themselves are temporary)
MARGIN = 0.02
ARMS = (4, 2, 1)
SWEEP = (5e-4, 1e-3, 2e-3)
EXTEND = 2                          # extensions of the grid past an edge best
UPTRAIN = (75, 300)                 # steps on the pooled model: 5 % and 20 % of the 1,500 pre-training steps
UPTRAIN_RATES = (1.0, 0.25, 0.1)    # its peak rate, times the pre-training peak


def train_once(kv: int, lr: float, seed: int, threads: int, data: str, keep: Path | None = None,
               extra: tuple = ()) -> dict:
    """One training run, scored by its final whole-split validation loss; ``keep``: the run's
    folder, kept (else a temporary one); ``extra``: more `tbp train` options."""
    commit = records.commit()
    with tempfile.TemporaryDirectory() as tmp:
        out = keep or Path(tmp) / "run"
        arch = [] if kv == 4 else ["--attention", "gqa", "--n-kv-head", str(kv)]      # 4: standard attention
        cmd = [sys.executable, "-m", "tbp", "train", "--data", data, "--out", str(out), *arch, "--lr", repr(lr),
               "--min-lr", repr(lr / 10), "--seed", str(seed), "--threads", str(threads), "--quiet", "--force",
               *extra]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        final = [m for m in metrics if "val_split_loss" in m][-1]
        state = json.loads((out / "state.json").read_text())
        config = json.loads((out / "config.json").read_text())
    from tbp import GPT, ModelConfig
    model = GPT(ModelConfig(**config["model"]), seed=0)
    return {"n_kv_head": kv, "lr": lr, "seed": seed, "threads": threads, "steps": final["step"],
            "val_split_loss": final["val_split_loss"], "val_split_tokens": final["val_split_tokens"],
            "params": int(sum(p.size for p in model.params.values())),
            "cache_bytes_per_token": Inference(model, 1).cache_bytes // config["model"]["n_ctx"],
            "elapsed_s": state["elapsed_s"], "model": config["model"], "margin": MARGIN, "commit": commit}


def run_all(todo: list[tuple], jobs: int) -> None:
    done = {(r["n_kv_head"], r["lr"], r["seed"]) for r in records.read(NAME)}
    todo = [t for t in todo if t not in done]
    threads = 1 if jobs > 1 else 0
    data = runner.builtin_data(WORK)

    def record(r: dict) -> None:
        records.append(NAME, r)
        print(f"kv {r['n_kv_head']} lr {r['lr']:g} seed {r['seed']}: {r['val_split_loss']:.4f} "
              f"({r['elapsed_s']:.0f} s)", flush=True)
    runner.side_by_side(jobs, [(kv, lr, seed, threads, data) for kv, lr, seed in todo], train_once, record)


def swept() -> dict[float, float]:
    """The full-head arm's mean loss over seeds 1 and 2 at every rate both seeds have run."""
    rows = [r for r in records.read(NAME) if r["n_kv_head"] == 4 and r["seed"] in (1, 2)]
    rates = sorted({r["lr"] for r in rows})
    return {lr: float(np.mean([r["val_split_loss"] for r in rows if r["lr"] == lr])) for lr in rates
            if sum(r["lr"] == lr for r in rows) == 2}


def sweep(jobs: int) -> None:
    """SWEEP on seeds 1 and 2, then a factor of 2 past whichever edge holds the best mean,
    until the best is inside the grid (at most EXTEND times): the full-head arm's rate must not
    be the grid's choice."""
    grid = list(SWEEP)
    run_all([(4, lr, s) for s in (1, 2) for lr in grid], jobs)
    for _ in range(EXTEND):
        means = swept()
        best = min(means, key=means.get)
        if min(means) < best < max(means):
            return
        nxt = best * 2 if best == max(means) else best / 2
        print(f"the best rate {best:g} is at the grid's edge: adding {nxt:g}", flush=True)
        run_all([(4, nxt, s) for s in (1, 2)], jobs)


def best_lr() -> float:
    means = swept()
    if not set(SWEEP) <= set(means):
        sys.exit("run the sweep first: python benchmarks/studies/gqa_quality.py sweep")
    return min(means, key=means.get)


def pooled_loss(source: Path, kv: int, data: str) -> tuple[float, int]:
    """(loss, tokens) over the whole validation split -- `tbp eval`'s figure -- of ``source``'s
    full-head model with its key/value heads mean-pooled to ``kv``, as converted: what
    `tbp train --init-from` starts from."""
    from tbp.runs import disk
    from tbp.data.datasets import Dataset
    from tbp.train.evaluate import split_loss
    from tbp.nn.designs.gqa.gqa import pool_kv_heads
    return split_loss(pool_kv_heads(disk.load_model(source)[0], kv), Dataset.load(data))


def uptrain(seeds: int, jobs: int) -> None:
    """Full-head runs kept, pooled to 2 and 1 key/value heads, scored as converted and after
    UPTRAIN steps at the swept rates (seed 1) or the best (other seeds); and the shared-head
    arms from scratch, on the same seeds and machine. Each step skips what its records hold."""
    lr, data, threads = best_lr(), runner.builtin_data(WORK), 1 if jobs > 1 else 0
    work = WORK / "uptrain"
    work.mkdir(parents=True, exist_ok=True)
    have = {(r["arm"], r["n_kv_head"], r["seed"], r.get("uptrain_steps"), r.get("uptrain_lr"))
            for r in records.read(UP)}

    def record(arm: str, r: dict, **more) -> None:
        r = {"arm": arm, **r, **more, "source_lr": lr, "margin": MARGIN}
        records.append(UP, r)
        have.add((arm, r["n_kv_head"], r["seed"], r.get("uptrain_steps"), r.get("uptrain_lr")))
        print(f"{arm} kv {r['n_kv_head']} seed {r['seed']} {r.get('uptrain_steps') or ''} "
              f"{r.get('uptrain_lr') or ''}: {r['val_split_loss']:.4f}", flush=True)

    def uptrain_task(kv: int, seed: int, steps: int, rate: float) -> dict:
        out = work / f"up-{kv}-{seed}-{steps}-{rate:g}"
        r = train_once(kv, rate, 100 + seed, threads, data, keep=out,            # batches of another seed
                       extra=("--init-from", str(work / f"full-{seed}"), "--max-iters", str(steps),
                              "--warmup", str(steps // 10)))
        shutil.rmtree(out)
        return {**r, "seed": seed, "data_seed": 100 + seed, "uptrain_steps": steps, "uptrain_lr": rate,
                "arm": "uptrained"}

    def pending(seed: int, rates) -> list[tuple]:
        return [(kv, seed, n, f * lr) for kv in ARMS[1:] for n in UPTRAIN for f in rates(kv, n)
                if ("uptrained", kv, seed, n, f * lr) not in have]

    def sources(todo_seeds: list[int]) -> None:
        """Each seed's full-head run, kept, and its pooled copies scored as converted."""
        need = [s for s in todo_seeds if ("source", 4, s, None, None) not in have    # a run killed midway is redone
                or not (work / f"full-{s}" / "state.json").is_file()]
        runner.side_by_side(jobs, [(4, lr, s, threads, data, work / f"full-{s}") for s in need],
                            train_once, lambda r: None if ("source", 4, r["seed"], None, None) in have
                            else record("source", r))
        for s in todo_seeds:
            for kv in ARMS[1:]:
                if ("pooled", kv, s, 0, None) not in have:
                    loss, tokens = pooled_loss(work / f"full-{s}", kv, data)
                    record("pooled", {"n_kv_head": kv, "seed": s, "val_split_loss": loss, "val_split_tokens": tokens,
                                      "commit": records.commit()}, uptrain_steps=0, uptrain_lr=None)

    def run(tasks: list[tuple]) -> None:
        runner.side_by_side(jobs, tasks, uptrain_task, lambda r: record("uptrained", r))

    all_rates = lambda kv, n: UPTRAIN_RATES
    if pending(1, all_rates):
        sources([1])
        run(pending(1, all_rates))
    best = {}
    for kv in ARMS[1:]:
        for n in UPTRAIN:
            tried = {r["uptrain_lr"]: r["val_split_loss"] for r in records.read(UP)
                     if r["arm"] == "uptrained" and r["n_kv_head"] == kv and r["seed"] == 1 and r["uptrain_steps"] == n}
            best[kv, n] = min(tried, key=tried.get) / lr
    chosen = lambda kv, n: (best[kv, n],)
    rest = [s for s in range(2, seeds + 1) if pending(s, chosen)]
    if rest:
        sources(rest)
        run([t for s in rest for t in pending(s, chosen)])
    scratch = [(kv, lr, s, threads, data) for s in range(1, seeds + 1) for kv in ARMS[1:]
               if ("scratch", kv, s, None, None) not in have]
    runner.side_by_side(jobs, scratch, train_once, lambda r: record("scratch", r))


def speed(rounds: int, tokens: int) -> None:
    """Decoding tokens/s of the three arms, paired: each round times every arm once, in turn."""
    from tbp import GPT, ModelConfig
    cases = {"default, context 128": dict(), "rotary, context 4,096": dict(positions="rope", n_ctx=4096)}
    for case, extra in cases.items():
        engines = {}
        for kv in ARMS:
            arch = {} if kv == 4 else {"attention": "gqa", "n_kv_head": kv}
            model = GPT(ModelConfig(vocab_size=103, **arch, **{"n_ctx": 128, **extra}), seed=0)
            engines[kv] = (model, Inference(model, 1))
        n = engines[4][0].config.n_ctx
        prompt = np.random.default_rng(0).integers(0, 103, (1, n - tokens))
        times = {kv: [] for kv in ARMS}
        for r in range(rounds):
            for kv in (ARMS if r % 2 == 0 else ARMS[::-1]):
                _, engine = engines[kv]
                engine.reset()
                engine.forward(prompt)
                t = time.perf_counter()
                tok = prompt[:, -1:]
                for _ in range(tokens):
                    logits = engine.forward(tok)
                    tok = logits[:, -1:].argmax(-1)
                times[kv].append(time.perf_counter() - t)
        rec = {"case": case, "tokens": tokens, "rounds": rounds, "cache_tokens": n,
               "tokens_per_s": {str(kv): tokens / float(np.median(ts)) for kv, ts in times.items()},
               "cache_bytes": {str(kv): engines[kv][1].cache_bytes for kv in ARMS}, "commit": records.commit()}
        records.append(SPEED, rec)
        print(case, {kv: round(v, 1) for kv, v in rec["tokens_per_s"].items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phases", nargs="+", choices=("sweep", "neighbours", "seeds", "speed", "uptrain"))
    ap.add_argument("--jobs", type=int, default=2, help="trainings side by side, one thread each")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seeds", type=int, default=3, help="uptrain: seeds 1..N")
    a = ap.parse_args()
    records.pin_gemm()
    for phase in a.phases:
        if phase == "sweep":
            sweep(a.jobs)
        elif phase == "neighbours":
            lr = best_lr()
            run_all([(kv, f * lr, 1) for kv in ARMS[1:] for f in (0.5, 2.0)], a.jobs)
        elif phase == "seeds":
            lr = best_lr()
            run_all([(kv, lr, s) for s in range(1, 6) for kv in ARMS], a.jobs)
        elif phase == "uptrain":
            uptrain(a.seeds, a.jobs)
        else:
            speed(a.rounds, 64)


if __name__ == "__main__":
    main()
