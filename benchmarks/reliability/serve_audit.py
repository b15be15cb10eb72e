"""A hostile audit of ``tbp serve``: requests a careless or malicious client sends, each with the
answer a sound server gives, asked of a running server and recorded case by case.

    python benchmarks/reliability/serve_audit.py --record

The server is started as a user starts it (``tbp serve --port 0``, its own process), on a small
conversation model trained for the audit (``--checkpoint RUN`` serves another). Each case
is sent on a fresh connection, as raw bytes where the HTTP itself is the attack; a case passes
when the status is the one expected (a refusal: any of the 4xx listed) within ``--seconds``
(the pipelined case waits for the idle connection's close), the server still answers a plain
request afterwards, and its resident memory stays within ``--rss-mib`` of its start.
The cases are the surfaces of guard.py and requests.py taken from sides their tests do not
take: browsers' odd origins, duplicated and ambiguous headers, pipelining, numbers JSON allows
and Python reads loosely, prompts that are long in ways other than characters.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

from serve_soak import rss_mib, start


def http(port: int, raw: bytes, timeout: float = 20.0, read_all: bool = False) -> tuple[int | None, bytes]:
    """Send ``raw`` on a fresh connection; (the first response's status, the bytes read)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        got = b""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            try:
                chunk = s.recv(65536)
            except (socket.timeout, ConnectionResetError):
                break
            if not chunk:
                break
            got += chunk
            if not read_all and b"\r\n\r\n" in got:
                head, _, rest = got.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), None)
                if length is not None and len(rest) >= length:
                    break
    status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else None
    return status, got


def post(path: str, body: bytes | str, host: str = "127.0.0.1", extra: str = "", ctype: str = "application/json") -> bytes:
    body = body.encode() if isinstance(body, str) else body
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n").encode() + body


def completion(**fields) -> str:
    return json.dumps({"model": "m", "prompt": "The ", "max_tokens": 4, **fields})


CASES = [
    # --- who may drive it: what browsers actually send -------------------------------------------
    ("Origin: null (a sandboxed iframe, a file:// page)", lambda p: post("/v1/completions", completion(), extra="Origin: null\r\n"), {403}),
    ("Origin of another port on loopback", lambda p: post("/v1/completions", completion(), extra=f"Origin: http://127.0.0.1:{p + 1}\r\n"), {403}),
    ("Origin https:// of the server's own name", lambda p: post("/v1/completions", completion(), extra=f"Origin: https://localhost:{p}\r\n"), {403}),
    ("Origin with the server's name as a subdomain", lambda p: post("/v1/completions", completion(), extra=f"Origin: http://localhost.evil.example:{p}\r\n"), {403}),
    ("Host: a rebinding name ending in a loopback name", lambda p: post("/v1/completions", completion(), host="127.0.0.1.nip.io"), {403}),
    ("Host: localhost with a trailing dot", lambda p: post("/v1/completions", completion(), host="localhost."), {403}),
    ("Host: upper case LOCALHOST (the same name)", lambda p: post("/v1/completions", completion(), host=f"LOCALHOST:{p}"), {200}),
    ("two Host headers, the second a stranger", lambda p: post("/v1/completions", completion(), extra="Host: evil.example\r\n"), {400, 403}),
    ("two Host headers, the first a stranger", lambda p: post("/v1/completions", completion(), host="evil.example", extra="Host: 127.0.0.1\r\n"), {400, 403}),
    ("no Host header (HTTP/1.1 requires one)", lambda p: b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n", {400, 403}),
    ("two Origin headers, the second a stranger", lambda p: post("/v1/completions", completion(), extra=f"Origin: http://127.0.0.1:{p}\r\nOrigin: http://evil.example\r\n"), {400, 403}),
    ("a CORS preflight from a stranger", lambda p: f"OPTIONS /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\nAccess-Control-Request-Method: POST\r\nConnection: close\r\n\r\n".encode(), {403}),
    ("text/plain POST with no Origin (curl-like)", lambda p: post("/v1/completions", completion(), ctype="text/plain"), {200}),
    # --- the HTTP itself ----------------------------------------------------------------------------
    ("Content-Length and Transfer-Encoding together (smuggling)", lambda p: ("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n0\r\n\r\n").encode(), {400}),
    ("two different Content-Lengths", lambda p: post("/v1/completions", completion(), extra="Content-Length: 3\r\n"), {400}),
    ("a negative Content-Length", lambda p: b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\nConnection: close\r\n\r\n", {400}),
    ("a Content-Length of 10^30", lambda p: b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000000000000000000000000000\r\nConnection: close\r\n\r\n", {400, 413}),
    ("Expect: 100-continue with 1 GB declared", lambda p: b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000000\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n", {413}),
    ("a request line of 100 KB in one write", lambda p: b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", {400, 414, 431, None}),
    # h11 reads the preface as a request without a Host (HTTP/2.0 needs none), which the gate refuses
    ("HTTP/2's preface on the plain port", lambda p: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", {400, 403, 505, None}),
    ("a TLS ClientHello on the plain port", lambda p: bytes.fromhex("16030100a5010000a10303") + os.urandom(32) + b"\x00" * 120, {400, None}),
    ("a WebSocket upgrade (no route speaks it)", lambda p: b"GET /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n", {400, 403, 404, 405, None}),
    ("GET on a POST route", lambda p: b"GET /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", {405}),
    ("a path with ../ climbing out", lambda p: b"GET /v1/../../../etc/passwd HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", {404}),
    ("200 pipelined requests without reading a byte", lambda p: (post("/v1/models", "").replace(b"Connection: close\r\n", b"").replace(b"POST", b"GET")) * 200, {200}),
    # --- the JSON ----------------------------------------------------------------------------------
    ("temperature NaN (Python's JSON reads it)", lambda p: post("/v1/completions", completion().replace('"max_tokens": 4', '"max_tokens": 4, "temperature": NaN')), {400}),
    ("max_tokens Infinity", lambda p: post("/v1/completions", completion().replace('"max_tokens": 4', '"max_tokens": Infinity')), {400}),
    ("max_tokens true (not 1)", lambda p: post("/v1/completions", completion(max_tokens=True)), {400}),
    ("max_tokens 4.0 (a float that is an integer)", lambda p: post("/v1/completions", completion(max_tokens=4.0)), {200, 400}),
    ("seed of 5,000 digits", lambda p: post("/v1/completions", completion().replace('"max_tokens": 4', '"max_tokens": 4, "seed": ' + "9" * 5000)), {400}),
    ("seed -1", lambda p: post("/v1/completions", completion(seed=-1)), {200, 400}),
    ("seed 2^64", lambda p: post("/v1/completions", completion(seed=2 ** 64)), {200, 400}),
    ("duplicate keys: prompt twice", lambda p: post("/v1/completions", '{"model": "m", "prompt": "a", "prompt": "b", "max_tokens": 2}'), {200, 400}),
    ("a body that is a JSON string, not an object", lambda p: post("/v1/completions", '"hello"'), {400}),
    ("UTF-16 body with a BOM", lambda p: post("/v1/completions", completion().encode("utf-16")), {400}),
    ("UTF-8 body with a BOM", lambda p: post("/v1/completions", b"\xef\xbb\xbf" + completion().encode()), {200, 400}),
    ("a prompt of 1 M zero-width joiners", lambda p: post("/v1/completions", completion(prompt="\u200d" * 1_000_000)), {400}),
    ("a prompt of 2 M combining accents on one letter", lambda p: post("/v1/completions", completion(prompt="a" + "\u0301" * 2_000_000)), {400}),
    ("a prompt as 100,000 token ids", lambda p: post("/v1/completions", completion(prompt=list(range(100_000)))), {400}),
    ("stop: an empty string", lambda p: post("/v1/completions", completion(stop=[""])), {200}),
    ("stop: 4 strings of 1 MB", lambda p: post("/v1/completions", completion(stop=["x" * 1_000_000] * 4)), {200, 400}),
    ("top_logprobs 10^9", lambda p: post("/v1/chat/completions", json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 10 ** 9})), {400}),
    ("n: 1000", lambda p: post("/v1/completions", completion(n=1000)), {400}),
    ("logit_bias on a reserved token", lambda p: post("/v1/completions", completion(logit_bias={"0": 100})), {400}),
    ("300,001 empty chat messages in turn", lambda p: post("/v1/chat/completions", json.dumps({"model": "m", "messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}] * 150_000 + [{"role": "user", "content": ""}]})), {400}),
    ("a message with a role of 1 MB", lambda p: post("/v1/chat/completions", json.dumps({"model": "m", "messages": [{"role": "u" * 1_000_000, "content": "hi"}]})), {400}),
    ("model: a list", lambda p: post("/v1/completions", completion(model=["m"])), {400}),
    ("model: 1 MB of text", lambda p: post("/v1/completions", completion(model="m" * 1_000_000)), {400, 404}),
]


def chat_run(work: Path) -> Path:
    """A small model trained on conversations (so that the chat route is served), in seconds."""
    things = {"sky": "blue", "coal": "black", "snow": "white", "grass": "green"}
    with open(work / "d.jsonl", "w") as f:
        for i in range(80):
            t, u = list(things)[i % 4], list(things)[(i + 1) % 4]
            f.write(json.dumps({"messages": [{"role": "user", "content": f"the {t}?"},
                                             {"role": "assistant", "content": f"The {t} is {things[t]}."},
                                             {"role": "user", "content": f"the {u}?"},
                                             {"role": "assistant", "content": f"The {u} is {things[u]}."}]}) + "\n")
    tbp = [sys.executable, "-m", "tbp"]
    subprocess.run([*tbp, "prepare", "--format", "chat", "--data", str(work / "d.jsonl"), "--tokenizer", "bpe",
                    "--vocab-size", "300", "--out", str(work / "data")], check=True, capture_output=True)
    subprocess.run([*tbp, "train", "--data", str(work / "data"), "--out", str(work / "run"), "--max-iters", "40",
                    "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--n-ctx", "96", "--batch-size", "8",
                    "--eval-interval", "20", "--quiet"], check=True, capture_output=True)
    return work / "run"


def audit(checkpoint: str, rss_slack: float, seconds: float) -> dict:
    proc, port, log = start(checkpoint)
    plain = post("/v1/completions", completion())
    assert http(port, plain)[0] == 200, "a plain request must be answered before the audit starts"
    rss0 = rss_mib(proc.pid)
    rows = []
    for name, make, expected in CASES:
        t = time.perf_counter()
        try:
            status, got = http(port, make(port), read_all="pipelined" in name)
        except OSError as e:
            status, got = None, str(e).encode()
        took = time.perf_counter() - t
        if "pipelined" in name:           # every one of them answered, in order
            answered = got.count(b"HTTP/1.1 200")
            status = 200 if answered == 200 else status
        alive = http(port, plain)[0] == 200
        rss = rss_mib(proc.pid)
        in_time = took <= seconds or "pipelined" in name
        ok = status in expected and in_time and alive and rss - rss0 <= rss_slack
        rows.append({"case": name, "status": status, "expected": sorted(map(str, expected)), "seconds": round(took, 3),
                     "alive_after": alive, "rss_mib": round(rss, 1), "passed": ok})
        print(f"{'ok  ' if ok else 'FAIL'} {status!s:>4} {took:6.2f} s  {rss:7.1f} MiB  {name}", flush=True)
    proc.terminate()
    code = proc.wait(30)
    tracebacks = sum("Traceback" in line for line in log)
    return {"cases": rows, "passed": sum(r["passed"] for r in rows), "failed": sum(not r["passed"] for r in rows),
            "rss_start_mib": rss0, "tracebacks_in_log": tracebacks, "exit_code_on_sigterm": code}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="a run to serve (default: a small conversation model trained first)")
    ap.add_argument("--rss-mib", type=float, default=200, help="the growth of the server's memory a case may cause")
    ap.add_argument("--seconds", type=float, default=5, help="the longest a case's answer may take")
    ap.add_argument("--record", action="store_true", help="append the result to benchmarks/results/serve_audit.jsonl")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        checkpoint = a.checkpoint or str(chat_run(Path(work)))
        res = audit(checkpoint, a.rss_mib, a.seconds)
    print(json.dumps({k: v for k, v in res.items() if k != "cases"}))
    if a.record:
        records.append("serve_audit", {"commit": records.commit(),
                                       "checkpoint": Path(a.checkpoint).name if a.checkpoint else "chat (trained)", **res})
    sys.exit(1 if res["failed"] or res["tracebacks_in_log"] else 0)


if __name__ == "__main__":
    main()
