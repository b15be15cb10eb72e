"""kill -9 a training run at random instants, many times, and prove it always resumes.

A tiny model saves at every step (so a good share of the kills land inside a save); each
round starts `tbp train` (fresh, or --resume once a checkpoint exists), sleeps a random time
and sends SIGKILL. After every kill the run must hold one complete checkpoint (its step never
goes back), and a last --resume must finish. The test suite runs a short version of this
(tests/test_reliability.py); run the long one with, for example:

    python benchmarks/reliability/kill_loop.py --kills 100 --seed 1

Each loop is one record in results/kill_loop.jsonl, a failed one too (its round and why).
"""
import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

TEXT = "".join(f"{i % 7} the cat sat on the mat; the dog ate the log. line {i}\n" for i in range(600))
TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--n-ctx", "16", "--batch-size", "4",
        "--eval-batches", "1", "--eval-interval", "1", "--log-interval", "1", "-q"]


def step(run: Path):
    state = run / "state.json"
    return json.loads(state.read_text())["step"] if state.is_file() else None


def failed(a, round_: int, why: str) -> None:
    records.append("kill_loop", {"commit": records.commit(), "kills": a.kills, "seed": a.seed,
                                 "failed_at_round": round_, "why": why.splitlines()[0]})
    sys.exit(why)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-s", type=float, default=0.8, help="shortest time before a kill (start-up is ~0.7 s)")
    p.add_argument("--max-s", type=float, default=3.0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "corpus.txt").write_text(TEXT)
        run, steps, t0 = tmp / "r", [], time.perf_counter()
        for i in range(a.kills):
            resume = step(run) is not None
            args = ["--out", "r", "--resume", "-q"] if resume else \
                ["--data", "corpus.txt", "--out", "r", "--max-iters", "1000000", *TINY]
            proc = subprocess.Popen([sys.executable, "-m", "tbp", "train", *args], cwd=tmp,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(rng.uniform(a.min_s, a.max_s))
            proc.kill()
            _, err = proc.communicate()
            if proc.returncode not in (-9, 0):
                failed(a, i, f"round {i}: tbp exited {proc.returncode} before the kill:\n{err.decode()}")
            s = step(run)
            if steps and (s is None or s < steps[-1]):
                failed(a, i, f"round {i}: the checkpoint went from step {steps[-1]} to {s}")
            if s is not None:
                steps.append(s)
        final = (steps[-1] if steps else 0) + 5
        r = subprocess.run([sys.executable, "-m", "tbp", "train", "--out", "r", "--resume", "--max-iters",
                            str(final), "-q"], cwd=tmp, capture_output=True, text=True)
        ok = r.returncode == 0 and step(run) == final
        rec = {"kills": a.kills, "seed": a.seed, "checkpoints_seen": len(steps),
               "last_step_before_final": steps[-1] if steps else None, "final_resume_ok": ok,
               "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps(rec))
        records.append("kill_loop", {"commit": records.commit(), **rec})
        if not ok:
            sys.exit(f"the final --resume failed:\n{r.stderr}")


if __name__ == "__main__":
    main()
