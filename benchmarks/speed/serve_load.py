"""tbp serve under load on loopback: N streaming clients for M seconds, against one at a time.

    python benchmarks/speed/serve_load.py --checkpoint checkpoints/pydoc --clients 8 --seconds 60 --record

A server is started as a user starts it (``tbp serve``, its own process). Requests are drawn
from 16 fixed (prompt, seed) pairs, and each pair's answer is first asked alone: during the load
every answer must equal its pair's, byte for byte (no cross-talk between streams), and no request
may fail. Then, for each setting (one client; N clients with --parallel 1, the default, so that
they queue; N clients with --parallel N), the clients stream completions back to back for M seconds; recorded: requests, tokens, aggregate
tokens per second, latency and time to first token (p50, p99), errors.
"""
import argparse
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(checkpoint: str, parallel: int, queue: int):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tbp", "serve", "--checkpoint", checkpoint, "--port", str(port),
                             "--parallel", str(parallel), "--queue", str(queue), "--name", "m"],
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(600):
        try:
            httpx.get(url + "/models", timeout=1)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start")


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
            "latency_p99_s": pct(lat, 0.99), "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "latency_median_s": statistics.median(lat) if lat else None,
            "errors": len(errors), "error_examples": errors[:3], "mismatched_answers": len(wrong)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/pydoc")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    out = {}
    expected = None
    for clients, parallel in ((1, 1), (args.clients, 1), (args.clients, args.clients)):
        proc, url = start(args.checkpoint, parallel=parallel, queue=args.clients)
        try:
            if expected is None:           # each pair asked alone: the answers every later one must equal
                with httpx.Client(timeout=600) as h:
                    expected = {(p, s): ask(h, url, p, s, args.max_tokens)[0] for p, s in PAIRS}
            key = f"{clients} clients, parallel {parallel}"
            out[key] = {"clients": clients, "parallel": parallel,
                        **load(url, clients, args.seconds, args.max_tokens, expected)}
            print(key, {k: v for k, v in out[key].items() if k != "error_examples"})
        finally:
            proc.terminate()
            proc.wait(30)
    if args.record:
        records.append("serve_load", {"checkpoint": Path(args.checkpoint).name, "seconds": args.seconds,
                                      "max_tokens": args.max_tokens, "pairs": len(PAIRS), "settings": out,
                                      "threads_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS",
                                                                                     "OPENBLAS_NUM_THREADS")},
                                      "commit": records.commit()})


if __name__ == "__main__":
    main()
