"""tbp serve under load on loopback: --parallel 1 against --parallel N, alternated over rounds.

    python benchmarks/speed/serve_load.py --checkpoint checkpoints/pydoc --clients 8 --rounds 10 --record
    python benchmarks/speed/serve_load.py --busy ...       # with another process keeping one core busy

Two servers are started as a user starts them (``tbp serve``, each its own process): one with
``--parallel 1`` (the clients queue), one with ``--parallel N``. Requests are drawn from 16 fixed
(prompt, seed) pairs, and each pair's answer is first asked alone: during the load every answer
must equal its pair's, byte for byte (no cross-talk between streams), and no request may fail.
Then the rounds: in each, N clients stream completions back to back for S seconds against one
server, then against the other (the order alternates round by round), so that whatever else the
machine does falls on both settings alike. Recorded per round and setting: requests, tokens,
aggregate tokens per second, latency p50 / p99 / max, time to first token, errors; and the ratio
of the two settings in every round, its worst and its median. ``--busy`` runs a process that
spins on one core for the whole benchmark (the load a user's other work puts beside a server).
"""
import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

PROMPTS = ["The list ", "A function ", "In Python, ", "The module "]
PAIRS = [(p, s) for p in PROMPTS for s in range(4)]
SPIN = "import time\nwhile True:\n    pass\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(checkpoint: str, parallel: int, queue: int, threads: int, env: dict):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tbp", "serve", "--checkpoint", checkpoint, "--port", str(port),
                             "--parallel", str(parallel), "--queue", str(queue), "--name", "m", "--quiet",
                             "--threads", str(threads)],
                            stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(1200):
        try:
            httpx.get(url + "/models", timeout=1)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start")


@contextlib.contextmanager
def servers_of(checkpoint: str, settings: dict, queue: int, threads: int, env: dict):
    """{key: (process, url)}: one server for each ``--parallel`` of ``settings`` ({key: parallel}),
    all stopped when the block ends, however it ends."""
    servers = {}
    try:
        for key, parallel in settings.items():
            servers[key] = start(checkpoint, parallel, queue, threads, env)
        yield servers
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)


def ask(client: httpx.Client, url: str, prompt: str, seed: int, max_tokens: int):
    """(text, tokens, seconds, seconds to the first piece) of one streamed completion."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, text, tokens = None, [], 0
    with client.stream("POST", url + "/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                if c["text"]:
                    first = first if first is not None else time.perf_counter() - t0
                    text.append(c["text"])
    return "".join(text), tokens, time.perf_counter() - t0, first if first is not None else float("nan")


def load(url: str, clients: int, seconds: float, max_tokens: int, expected: dict) -> dict:
    results, errors, wrong = [], [], []
    stop = time.perf_counter() + seconds
    lock = threading.Lock()

    def client(k: int):
        with httpx.Client(timeout=600) as h:
            i = k
            while time.perf_counter() < stop:
                prompt, seed = PAIRS[i % len(PAIRS)]
                i += clients
                try:
                    text, tokens, dt, ttft = ask(h, url, prompt, seed, max_tokens)
                except Exception as e:           # recorded, never hidden
                    with lock:
                        errors.append(repr(e)[:200])
                    continue
                with lock:
                    results.append((tokens, dt, ttft))
                    if text != expected[(prompt, seed)]:
                        wrong.append((prompt, seed))
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(r[1] for r in results)
    ttft = sorted(r[2] for r in results)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None
    return {"requests": len(results), "tokens": sum(r[0] for r in results), "wall_s": wall,
            "tokens_per_s": sum(r[0] for r in results) / wall, "latency_p50_s": pct(lat, 0.5),
            "latency_p99_s": pct(lat, 0.99), "latency_max_s": lat[-1] if lat else None,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "errors": len(errors), "error_examples": errors[:3], "mismatched_answers": len(wrong)}


def matrix(args, env) -> None:
    """--matrix: 1, 4, 8 and 16 clients against --parallel 1, 4 and 8 (three servers), over
    --rounds rounds, every pair once a round, the servers' order alternating."""
    settings, counts = (1, 4, 8), (1, 4, 8, 16)
    cells = {(c, p): [] for c in counts for p in settings}
    with servers_of(args.checkpoint, {p: p for p in settings}, 16, args.threads, env) as servers:
        with httpx.Client(timeout=600) as h:
            expected = {(q, s): ask(h, servers[1][1], q, s, args.max_tokens)[0] for q, s in PAIRS}
        for r in range(args.rounds):
            for c in counts:
                for p in (settings if r % 2 == 0 else settings[::-1]):
                    cells[(c, p)].append(load(servers[p][1], c, args.seconds, args.max_tokens, expected))
            print(f"round {r + 1}: " + " · ".join(f"{c}×p{p} {v[-1]['tokens_per_s']:.0f}" for (c, p), v in cells.items()),
                  flush=True)
    if args.record:
        records.append("serve_matrix", {
            "checkpoint": Path(args.checkpoint).name,
            "model": records.shape(args.checkpoint),
            "rounds": args.rounds, "seconds": args.seconds, "max_tokens": args.max_tokens, "threads": args.threads,
            "cells": [{"clients": c, "parallel": p,
                       "tokens_per_s": statistics.median(x["tokens_per_s"] for x in v),
                       "tokens_per_s_min": min(x["tokens_per_s"] for x in v),
                       "latency_p50_s": statistics.median(x["latency_p50_s"] for x in v),
                       "latency_max_s": max(x["latency_max_s"] for x in v),
                       "errors": sum(x["errors"] for x in v), "mismatched_answers": sum(x["mismatched_answers"] for x in v)}
                      for (c, p), v in cells.items()], "commit": records.commit()})


@contextlib.contextmanager
def spinning(busy: bool):
    """With ``busy``: another process keeps one core busy while the block runs."""
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        yield
    finally:
        if spinner is not None:
            spinner.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/pydoc")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=None, help="the batched server's --parallel (default --clients)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=20, help="each setting's share of a round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--busy", action="store_true", help="one process spinning on a core throughout")
    ap.add_argument("--threads", type=int, default=1, help="the servers' --threads (BLAS threads)")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for both servers (e.g. OPENBLAS_NUM_THREADS=1)")
    ap.add_argument("--matrix", action="store_true", help="1, 4, 8, 16 clients against --parallel 1, 4, 8")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    parallel = args.parallel or args.clients
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.env))
    if args.matrix:
        matrix(args, env)
        return
    settings = {"parallel 1": 1, f"parallel {parallel}": parallel}
    rounds = []
    with servers_of(args.checkpoint, settings, args.clients, args.threads, env) as servers, spinning(args.busy):
        with httpx.Client(timeout=600) as h:        # each pair asked alone, of the batched server
            url = servers[f"parallel {parallel}"][1]
            expected = {(p, s): ask(h, url, p, s, args.max_tokens)[0] for p, s in PAIRS}
        for r in range(args.rounds):
            order = list(settings) if r % 2 == 0 else list(settings)[::-1]
            row = {}
            for key in order:
                row[key] = load(servers[key][1], args.clients, args.seconds, args.max_tokens, expected)
            row["ratio"] = row[f"parallel {parallel}"]["tokens_per_s"] / row["parallel 1"]["tokens_per_s"]
            rounds.append(row)
            print(f"round {r + 1}: " + " · ".join(
                f"{k} {v['tokens_per_s']:.0f} tok/s (max {v['latency_max_s']:.2f} s, p50 {v['latency_p50_s']:.2f} s, "
                f"errors {v['errors']}, wrong {v['mismatched_answers']})" for k, v in row.items() if k != "ratio")
                  + f" · ratio {row['ratio']:.2f}", flush=True)
    ratios = [r["ratio"] for r in rounds]
    worst_tail = max(r[k]["latency_max_s"] / r[k]["latency_p50_s"] for r in rounds for k in settings)
    summary = {"ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios),
               "worst_max_over_median_latency": worst_tail,
               "errors": sum(r[k]["errors"] for r in rounds for k in settings),
               "mismatched_answers": sum(r[k]["mismatched_answers"] for r in rounds for k in settings)}
    print(summary)
    if args.record:
        records.append("serve_load", {
            "checkpoint": Path(args.checkpoint).name,
            "model": records.shape(args.checkpoint),
            "clients": args.clients, "parallel": parallel, "rounds": args.rounds, "seconds": args.seconds,
            "max_tokens": args.max_tokens, "busy_core": args.busy, "threads": args.threads, "pairs": len(PAIRS), "env": dict(
                kv.split("=", 1) for kv in args.env), "summary": summary, "per_round": rounds,
            "commit": records.commit()})


if __name__ == "__main__":
    main()
