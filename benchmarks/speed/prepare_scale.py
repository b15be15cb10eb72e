"""`tbp prepare` on corpora of 0.3, 1 and 3 GB: throughput and peak memory, char and BPE.

    python benchmarks/speed/prepare_scale.py --sizes 300M 1G 3G --kinds char bpe
    python benchmarks/speed/prepare_scale.py --sizes 300M --tree /path/to/old/checkout --label before

Each corpus is made once (lines of Shakespeare and of CPython's documentation, shuffled with a
fixed seed, written in blocks) under --work, then prepared in a fresh process per measurement;
the peak memory is that process's maximum resident set (wait4), the time its wall clock. One
record per run goes to benchmarks/results/prepare_scale.jsonl (resumable: a configuration
already recorded for this commit is skipped). --tree runs another checkout of tbp (PYTHONPATH),
for the figures before a change.
"""
import argparse
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

ROOT = Path(__file__).resolve().parents[2]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size_of(text: str) -> int:
    return int(float(text[:-1]) * UNITS[text[-1].upper()]) if text[-1].upper() in UNITS else int(text)


def make_corpus(path: Path, size: int) -> None:
    if path.is_file() and path.stat().st_size >= size:
        return
    from pydoc_data.topics import topics
    lines = "\n".join(topics[k] for k in sorted(topics)).split("\n")
    if SHAKESPEARE.is_file():
        lines += SHAKESPEARE.read_text(encoding="utf-8").split("\n")
    rng = random.Random(0)
    written = 0
    with open(path.with_suffix(".part"), "w", encoding="utf-8") as f:
        while written < size:
            block = "\n".join(rng.choice(lines) for _ in range(20000)) + "\n"
            f.write(block)
            written += len(block.encode("utf-8"))
    path.with_suffix(".part").rename(path)


def run(tree: Path, corpus: Path, out: Path, kind: str) -> dict:
    args = [sys.executable, "-m", "tbp", "prepare", "--data", str(corpus), "--out", str(out), "--force",
            "--tokenizer", kind]
    if kind == "bpe":
        args += ["--vocab-size", "4096"]
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.perf_counter()
    p = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    seconds = time.perf_counter() - t0
    err = p.stderr.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    return {"exit": code, "seconds": round(seconds, 2), "peak_rss_bytes": usage.ru_maxrss * 1024,
            "error": err.strip().splitlines()[-1] if code else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["300M", "1G", "3G"])
    ap.add_argument("--kinds", nargs="+", default=["char", "bpe"])
    ap.add_argument("--tree", type=Path, default=ROOT, help="the tbp checkout to run")
    ap.add_argument("--label", default="after")
    ap.add_argument("--work", type=Path, default=Path("/tmp/tbp-prepare-scale"))
    ap.add_argument("--compare", type=Path, default=None,
                    help="another checkout: run it and --tree in turn, --rounds times (order reversed each "
                         "round), one record per run in prepare_paired.jsonl")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.compare is not None:
        paired(args)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    commit = records.commit(args.tree)
    done = {(r["size"], r["kind"], r["commit"]) for r in records.read("prepare_scale")}
    for size_text in args.sizes:
        size = size_of(size_text)
        corpus = args.work / f"corpus-{size_text}.txt"
        make_corpus(corpus, size)
        for kind in args.kinds:
            if (size_text, kind, commit) in done:
                print(f"{size_text} {kind}: recorded already for {commit}")
                continue
            out = args.work / f"ds-{size_text}-{kind}"
            m = run(args.tree, corpus, out, kind)
            nbytes = corpus.stat().st_size
            m["mb_per_s"] = round(nbytes / 1e6 / m["seconds"], 2) if m["exit"] == 0 else None
            rec = {"size": size_text, "corpus_bytes": nbytes, "kind": kind, "label": args.label, "commit": commit,
                   "config": {"vocab_size": 4096 if kind == "bpe" else None}, "metrics": m}
            records.append("prepare_scale", rec)
            print(f"{size_text} {kind} ({args.label}): {m}", flush=True)
            shutil.rmtree(out, ignore_errors=True)


def paired(args) -> None:
    """Before and after taking turns on the same corpus: the machine's drift falls on both."""
    args.work.mkdir(parents=True, exist_ok=True)
    trees = {"before": (args.compare, records.commit(args.compare)), "after": (args.tree, records.commit(args.tree))}
    for size_text in args.sizes:
        corpus = args.work / f"corpus-{size_text}.txt"
        make_corpus(corpus, size_of(size_text))
        for r in range(args.rounds):
            for kind in args.kinds:
                order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                for label in order:
                    tree, commit = trees[label]
                    out = args.work / f"ds-{size_text}-{kind}-{label}"
                    m = run(tree, corpus, out, kind)
                    m["mb_per_s"] = round(corpus.stat().st_size / 1e6 / m["seconds"], 2) if m["exit"] == 0 else None
                    records.append("prepare_paired", {"size": size_text, "corpus_bytes": corpus.stat().st_size,
                                                      "kind": kind, "label": label, "commit": commit, "round": r,
                                                      "metrics": m})
                    print(f"round {r} {size_text} {kind} {label}: {m}", flush=True)
                    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
