"""BPE encoding on all cores: the tokenizers library's own threads against worker processes.

    python benchmarks/speed/bpe_encode.py --mb 32 --rounds 5

The same text (lines of CPython's documentation and Shakespeare, shuffled), the same pieces
(tbp.data.pieces' safe cuts, PIECE_CHARS each), the same BPE tokenizer (4,096 tokens). Three ways,
interleaved round by round, each timed as a median: the library with one thread, with all
(its default, what tbp prepare does: BATCH_PIECES pieces a call), and a pool of one-thread
worker processes, one per core, each encoding a share of the pieces and sending its ids back.
Records go to benchmarks/results/bpe_encode.jsonl.
"""
import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

ROOT = Path(__file__).resolve().parents[2]
WORKER = """
import os, sys, time, numpy as np
os.environ["RAYON_NUM_THREADS"] = sys.argv[1]
from tbp.data.tokenizer import Tokenizer
from tbp.data.pieces import BATCH_PIECES
tok = Tokenizer.load(sys.argv[2])
pieces = open(sys.argv[3], encoding="utf-8").read().split("\\x00")
share = [p for i, p in enumerate(pieces) if i % int(sys.argv[5]) == int(sys.argv[4])]
t = time.perf_counter()
n = 0
for i in range(0, len(share), BATCH_PIECES):
    for e in tok.hf.encode_batch_fast(share[i:i + BATCH_PIECES]):
        n += np.asarray(e.ids).size
print(time.perf_counter() - t, n)
"""


def corpus(mb: int) -> str:
    from pydoc_data.topics import topics
    lines = "\n".join(topics[k] for k in sorted(topics)).split("\n")
    shakespeare = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
    if shakespeare.is_file():
        lines += shakespeare.read_text(encoding="utf-8").split("\n")
    rng = random.Random(0)
    out, size = [], 0
    while size < mb << 20:
        out.append(rng.choice(lines) + "\n")
        size += len(out[-1])
    return "".join(out)


def timed(args: list[str]) -> tuple[float, int]:
    """Wall time of a set of worker processes started together, and the tokens they made."""
    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, *a], stdout=subprocess.PIPE, text=True) for a in args]
    outs = [p.communicate()[0].split() for p in procs]
    return time.perf_counter() - t, sum(int(o[1]) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/tbp-bpe-encode"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tbp.data.pieces import PIECE_CHARS, safe_cut
    from tbp.data.tokenizer import train_bpe
    args.work.mkdir(parents=True, exist_ok=True)
    text = corpus(args.mb)
    tok = train_bpe([text[i:i + (1 << 20)] for i in range(0, 8 << 20, 1 << 20)], 4096)
    tok.save(args.work / "tokenizer.json")
    pieces, start = [], 0
    while start < len(text):
        cut = safe_cut(text, start, min(start + PIECE_CHARS, len(text) - 1))
        cut = len(text) if cut < 0 or len(text) - start <= PIECE_CHARS else cut
        pieces.append(text[start:cut])
        start = cut
    (args.work / "pieces.txt").write_text("\x00".join(pieces), encoding="utf-8")
    cores = os.cpu_count() or 1
    common = [str(args.work / "tokenizer.json"), str(args.work / "pieces.txt")]
    ways = {"library, 1 thread": [["1", *common, "0", "1"]],
            f"library, {cores} threads": [[str(cores), *common, "0", "1"]],
            f"{cores} processes x 1 thread": [["1", *common, str(r), str(cores)] for r in range(cores)]}
    times = {w: [] for w in ways}
    tokens = {}
    for _ in range(args.rounds):
        for w, a in ways.items():               # interleaved: the machine's drift falls on all three
            s, n = timed(a)
            times[w].append(s)
            tokens[w] = n
    assert len(set(tokens.values())) == 1, tokens
    mb = len(text.encode("utf-8")) / 1e6
    for w in ways:
        med = statistics.median(times[w])
        rec = {"commit": records.commit(), "way": w, "cores": cores, "corpus_mb": round(mb, 1), "vocab_size": 4096,
               "rounds": args.rounds, "metrics": {"median_s": round(med, 3), "mb_per_s": round(mb / med, 2),
                                                  "times_s": [round(t, 3) for t in times[w]]}}
        records.append("bpe_encode", rec)
        print(f"{w}: {mb / med:.2f} MB/s (median of {args.rounds}, process start included)")


if __name__ == "__main__":
    main()
