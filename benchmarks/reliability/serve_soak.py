"""tbp serve held against ordinary and hostile clients at once, for minutes, under ulimit -n 1024.

    python benchmarks/reliability/serve_soak.py --checkpoint checkpoints/pydoc --minutes 10 --record

A server is started as a user starts it (``tbp serve``, its own process, its file-descriptor
limit lowered to 1,024). Then, together, until the time is up:

- ``--clients`` clients ask completions back to back, drawn from 16 fixed (prompt, seed) pairs
  whose answers were first asked alone: every answer must equal its pair's;
- ``--idle`` sockets are held open without a byte sent, and reopened as the server closes them;
- ``--tricklers`` clients send their headers a byte a second, and as many send a body a byte a
  second after whole headers, reconnecting when cut off;
- a fresh client asks a short completion every two seconds and times the answer.

Recorded: the fresh client's worst and median time, how many of its requests failed, the
answers and the wrong ones, the server's resident memory after the first minute and at the end,
and how often the tricklers were cut off.
"""
import argparse
import json
import multiprocessing
import os
import resource
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


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start(checkpoint: str, parallel: int = 1, fd_limit: int | None = None):
    """``tbp serve --port 0`` on ``checkpoint`` in its own process (the model named "m"), with
    at most ``fd_limit`` open files; (the process, its port, its output's lines so far, which a
    thread keeps extending)."""
    def low_limit():
        if fd_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))
    proc = subprocess.Popen([sys.executable, "-m", "tbp", "serve", "--checkpoint", checkpoint, "--port", "0",
                             "--parallel", str(parallel), "--name", "m"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=low_limit)
    log: list[str] = []
    for line in proc.stdout:
        log.append(line)
        if "serving" in line:
            port = int(line.split("/v1")[0].rsplit(":", 1)[1])
            threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
            return proc, port, log
    raise SystemExit("the server did not start:\n" + "".join(log[-20:]))


def ask(client: httpx.Client, url: str, prompt: str, seed: int, max_tokens: int) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed}
    r = client.post(url + "/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
    return r.json()["choices"][0]["text"]


def hostile(port: int, stop: float, idle_n: int, tricklers: int, out) -> None:
    """Until ``stop`` (time.monotonic): ``idle_n`` sockets held open without a byte, reopened as
    the server closes them; ``tricklers`` clients sending headers a byte a second and as many
    sending a body a byte a second. Puts their counts on ``out``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    n = {"idle_reopened": 0, "trickle_cut": 0}
    lock = threading.Lock()

    def idle():
        held: list[socket.socket] = []
        while time.monotonic() < stop:
            alive = []
            for s in held:                         # the server closed some: reopen them
                try:
                    s.setblocking(False)
                    if s.recv(1) == b"":
                        s.close()
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    continue
                alive.append(s)
            held = alive
            while len(held) < idle_n and time.monotonic() < stop:
                try:
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                    with lock:
                        n["idle_reopened"] += 1
                except OSError:
                    time.sleep(0.1)
                    break
            time.sleep(1)
        for s in held:
            s.close()

    def trickle(body: bool):
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 40\r\n\r\n")
        while time.monotonic() < stop:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                if body:
                    s.sendall(head)
                for byte in (b'{"prompt": "the", "max_tokens": 2}     ' if body else head):
                    if time.monotonic() > stop:
                        break
                    s.send(bytes([byte]))
                    time.sleep(1)
                s.close()
            except OSError:
                with lock:
                    n["trickle_cut"] += 1

    threads = [threading.Thread(target=idle)]
    threads += [threading.Thread(target=trickle, args=(k % 2 == 1,)) for k in range(2 * tricklers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(n)


def soak(a) -> dict:
    proc, port, _ = start(a.checkpoint, a.parallel, fd_limit=1024)
    url = f"http://127.0.0.1:{port}/v1"
    with httpx.Client(timeout=60) as c:
        expected = {pair: ask(c, url, *pair, a.max_tokens) for pair in PAIRS}
    stop = time.monotonic() + 60 * a.minutes
    lock = threading.Lock()
    n = {"answers": 0, "wrong": 0, "client_errors": 0, "busy": 0, "probe_failed": 0}
    probes: list[float] = []
    connects: list[float] = []                 # a fresh connection accepted
    healths: list[float] = []                  # a fresh connection's GET /health answered
    rss: list[tuple[float, float]] = []

    def count(key, k=1):
        with lock:
            n[key] += k

    errors: dict[str, int] = {}

    def kind(what: str):
        with lock:
            errors[what] = errors.get(what, 0) + 1

    def client(k: int):
        i = k
        with httpx.Client(timeout=60) as h:
            while time.monotonic() < stop:
                pair = PAIRS[i % len(PAIRS)]
                i += a.clients
                try:
                    text = ask(h, url, *pair, a.max_tokens)
                except RuntimeError as e:
                    count("busy" if "HTTP 429" in str(e) else "client_errors")
                    kind(str(e)[:40])
                    time.sleep(0.05)
                    continue
                except httpx.HTTPError as e:
                    count("client_errors")
                    kind(type(e).__name__)
                    continue
                count("answers")
                if text != expected[pair]:
                    count("wrong")

    def probe():
        while time.monotonic() < stop:
            t = time.perf_counter()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=30):
                    connects.append(time.perf_counter() - t)
                t = time.perf_counter()
                with httpx.Client(timeout=30) as h:      # a fresh connection every time
                    if h.get(url.removesuffix("/v1") + "/health").status_code != 200:
                        raise RuntimeError("health")
                    healths.append(time.perf_counter() - t)
                t = time.perf_counter()
                with httpx.Client(timeout=30) as h:
                    ask(h, url, "The list ", 0, 4)
                probes.append(time.perf_counter() - t)
            except (RuntimeError, httpx.HTTPError) as e:
                count("probe_failed")
                kind("probe: " + (str(e)[:40] if isinstance(e, RuntimeError) else type(e).__name__))
            time.sleep(2)

    def memory():
        t0 = time.monotonic()
        while time.monotonic() < stop:
            rss.append((time.monotonic() - t0, rss_mib(proc.pid)))
            time.sleep(5)

    # the hostile clients in a process of their own, as an attacker is: their threads do not
    # slow the measuring clients down through this process's GIL
    counts = multiprocessing.Queue()
    attacker = multiprocessing.Process(target=hostile, args=(port, stop, a.idle, a.tricklers, counts))
    attacker.start()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(a.clients)]
    threads += [threading.Thread(target=probe), threading.Thread(target=memory)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n.update(counts.get(timeout=60))
    attacker.join(30)
    end_rss = rss_mib(proc.pid)
    proc.terminate()
    code = proc.wait(30)
    after_minute = next((m for t, m in rss if t >= 60), rss[0][1] if rss else float("nan"))
    return {"checkpoint": Path(a.checkpoint).name, "model": records.shape(a.checkpoint),
            "minutes": a.minutes, "clients": a.clients, "parallel": a.parallel, "idle_sockets": a.idle,
            "tricklers": 2 * a.tricklers, "max_tokens": a.max_tokens, **n,
            "probes": len(probes), "probe_max_s": max(probes, default=float("nan")),
            "probe_p50_s": statistics.median(probes) if probes else float("nan"),
            "connect_max_s": max(connects, default=float("nan")), "health_max_s": max(healths, default=float("nan")),
            "health_p50_s": statistics.median(healths) if healths else float("nan"),
            "rss_after_1min_mib": after_minute, "rss_end_mib": end_rss,
            "rss_max_mib": max((m for _, m in rss), default=float("nan")), "errors": errors, "exit_code": code}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--idle", type=int, default=2000)
    ap.add_argument("--tricklers", type=int, default=10, help="of each kind (headers, bodies)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--record", action="store_true", help="append the result to benchmarks/results/serve_soak.jsonl")
    a = ap.parse_args()
    res = soak(a)
    print(json.dumps(res, indent=1))
    if a.record:
        records.append("serve_soak", {"commit": records.commit(), "checkpoint": Path(a.checkpoint).name, **res})


if __name__ == "__main__":
    os.environ.setdefault("TBP_GEMM", "numpy")
    main()
