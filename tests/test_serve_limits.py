"""tbp serve against hostile clients and web pages: every resource a client can make it spend is
bounded before it is spent, no page of another site can drive it, and it stops as a service does.

Each test holds a principle (guard.py's), with cases of its own: deadlines cover the whole
request however it is trickled, the connection cap serves a fresh client whatever idle sockets
do, a body is counted as it arrives, a prompt is bounded before it is encoded, Host and Origin
name the server or are refused."""
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_serve import WHY, Server, chat_dir, text_run  # noqa: F401  (the module's run fixtures)

pytest.importorskip("starlette", reason=WHY)
httpx = pytest.importorskip("httpx", reason=WHY)

from tbp.generate.guard import Limits, RateLimitedLog  # noqa: E402

FAST = Limits(header_s=1.0, body_s=1.0, idle_s=1.0, connections=24, body_bytes=1 << 20)


@pytest.fixture(scope="module")
def guarded(text_run):  # noqa: F811
    s = Server(text_run, parallel=1, queue=2, limits=FAST)
    yield s
    s.stop()


def raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def closed_within(s: socket.socket, seconds: float) -> float:
    """Seconds until the server closes ``s`` (reads whatever it answers first), or fail."""
    t = time.monotonic()
    s.settimeout(seconds)
    try:
        while s.recv(65536):
            pass
    except TimeoutError:
        pytest.fail(f"still open after {seconds} s")
    except ConnectionResetError:
        pass
    return time.monotonic() - t


def status_of(s: socket.socket) -> int:
    s.settimeout(10)
    head = s.recv(65536).split(b"\r\n", 1)[0]
    return int(head.split()[1])


def post(port: int, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=30)


REQUEST = {"model": "m", "prompt": "the", "max_tokens": 2}


# --- deadlines: the whole request, not each read -------------------------------------------------
def test_headers_trickled_a_byte_at_a_time_are_cut_at_the_deadline(guarded):
    s = raw(guarded.port)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
    t = time.monotonic()
    try:
        for byte in head:                        # one byte every 0.1 s: each read is quick, the whole is not
            s.send(bytes([byte]))
            time.sleep(0.1)
            if time.monotonic() - t > 4:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert time.monotonic() - t < 3              # the server hung up near its 1 s deadline
    s.close()


def test_a_header_block_over_the_limit_is_refused_however_it_arrives(guarded):
    """16 KiB of request line and headers at most, whether they come in pieces (the parser's
    limit) or whole in one write (parsed before anything could count them: the gate's)."""
    for what, head in (("a long path", b"GET /" + b"a" * 40_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"),
                       ("long headers", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        + b"".join(b"X-%d: %s\r\n" % (i, b"b" * 1000) for i in range(30)) + b"\r\n")):
        for pieces in (1, 8):
            s = raw(guarded.port)
            step = -(-len(head) // pieces)
            try:
                for i in range(0, len(head), step):
                    s.sendall(head[i:i + step])
                    time.sleep(0.02 if pieces > 1 else 0)
                code = status_of(s)
            except (BrokenPipeError, ConnectionResetError):
                code = 431                       # cut off while sending: refused too
            s.close()
            assert code in (400, 431), (what, pieces, code)
    assert httpx.get(f"http://127.0.0.1:{guarded.port}/health", timeout=10).status_code == 200


def test_a_body_is_parsed_off_the_event_loop(guarded, monkeypatch):
    """Parsing a large body takes a second and ten times its size: a worker thread does it, so
    other clients are answered meanwhile. The parse here waits until /health has been answered;
    on the event loop it would wait forever (and /health with it)."""
    import threading

    from tbp.generate import server
    answered, started = threading.Event(), threading.Event()
    real = server.jsonio.parse

    def slow(text, where):
        started.set()
        assert answered.wait(10), "the event loop could not answer /health while a body was parsed"
        return real(text, where)
    monkeypatch.setattr(server.jsonio, "parse", slow)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("r", post(guarded.port, REQUEST)))
    t.start()
    assert started.wait(10)
    assert httpx.get(f"http://127.0.0.1:{guarded.port}/health", timeout=5).status_code == 200
    answered.set()
    t.join(30)
    assert got["r"].status_code == 200


def test_a_connection_that_never_speaks_is_closed(guarded):
    s = raw(guarded.port)
    assert closed_within(s, 5) < 3


def test_a_kept_alive_connection_gets_a_deadline_for_each_request(guarded):
    s = raw(guarded.port)
    body = json.dumps(REQUEST).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert status_of(s) == 200
    s.sendall(b"POST /v1/completions HTTP/1.1\r\n")          # the next request's first line, then nothing
    assert closed_within(s, 5) < 3


def test_a_body_trickled_past_its_deadline_is_408(guarded):
    s = raw(guarded.port)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 200\r\n\r\n")
    t = time.monotonic()
    try:
        for _ in range(40):
            s.send(b" ")
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert status_of(s) == 408 and time.monotonic() - t < 4.5
    s.close()


# --- bytes: counted as they arrive -----------------------------------------------------------------
def test_a_chunked_body_is_refused_once_it_passes_the_limit_not_after(guarded):
    s = raw(guarded.port)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    sent = 0
    try:
        while sent < 64 << 20:                    # 64 MiB offered against a 1 MiB limit
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert sent < 16 << 20                        # the server stopped reading long before the end
    s.close()
    r = post(guarded.port, REQUEST)
    assert r.status_code == 200


def test_a_declared_length_over_the_limit_is_413_before_the_body(guarded):
    s = raw(guarded.port)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 999999999\r\n\r\n")
    assert status_of(s) == 413
    s.close()


# --- connections: a fresh client is served whatever idle sockets do -------------------------------
def test_idle_sockets_beyond_the_cap_make_room_for_a_fresh_client(guarded):
    idle = []
    try:
        for _ in range(120):                      # five times the cap of 24
            idle.append(raw(guarded.port))
        for _ in range(5):
            t = time.monotonic()
            r = post(guarded.port, REQUEST)
            assert r.status_code == 200 and time.monotonic() - t < 2
    finally:
        for s in idle:
            s.close()


# --- bodies through the JSON reader; the model field ----------------------------------------------
@pytest.mark.parametrize("body, code", [
    (b"[" * 100_000 + b"]" * 100_000, 400),               # nested past any stack
    (b'{"model": "m", "prompt": "the", "max_tokens": true}', 400),     # true is not 1
    (b'{"model": "m", "prompt": "\\ud800"}', 400),          # a lone surrogate is not text
    (b'\xff\xfe{"prompt": "the"}', 400),                    # not UTF-8
    (b'{"model": 7, "prompt": "the"}', 400),
    (b'{"model": "gpt-4", "prompt": "the"}', 404),
])
def test_a_body_is_read_as_every_outside_file_is(guarded, body, code):
    r = httpx.post(f"http://127.0.0.1:{guarded.port}/v1/completions", content=body, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == code, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    if code == 404:
        assert r.json()["error"]["code"] == "model_not_found" and "'m'" in r.json()["error"]["message"]


def test_a_prompt_over_the_context_is_refused_before_it_is_encoded(guarded, monkeypatch):
    encoded = []
    real = guarded.served.tok.encode
    monkeypatch.setattr(guarded.served.tok, "encode", lambda text, *a: encoded.append(len(text)) or real(text, *a))
    r = post(guarded.port, {"model": "m", "prompt": "the cat " * 100_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert encoded == []
    assert post(guarded.port, REQUEST).status_code == 200 and encoded


def test_messages_are_bounded_by_their_templates_tokens_too_before_any_is_rendered(chat_dir, monkeypatch):  # noqa: F811
    """Each message costs its role's opening and its close whatever its text: a conversation of
    empty turns (300,001 fit in the body limit) is refused by the bound, not after the template
    has rendered every one."""
    from tbp.generate import requests
    rendered = []
    real = requests.chatfmt.prompt_ids
    monkeypatch.setattr(requests.chatfmt, "prompt_ids", lambda tok, m: rendered.append(len(m)) or real(tok, m))
    s = Server(chat_dir, limits=FAST)
    try:
        url = f"http://127.0.0.1:{s.port}/v1/chat/completions"
        turns = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
        for n in (20, 5_000):                  # past the context of 72 by 2 tokens a message
            body = {"model": "m", "messages": turns * n + [{"role": "user", "content": "x"}]}
            r = httpx.post(url, json=body, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert f"at least {2 * (2 * n + 1) + 1:,} tokens" in r.json()["error"]["message"]
        assert rendered == []
        ok = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": "the sky?"}], "max_tokens": 2},
                        timeout=30)
        assert ok.status_code == 200 and rendered == [1]
    finally:
        s.stop()


def test_a_request_waits_for_a_place_before_any_model_work(text_run):  # noqa: F811
    """Admission comes before encoding: with every place taken, a request is 429 and its text
    is never read by the tokenizer."""
    s = Server(text_run, parallel=1, queue=0, limits=FAST)
    read = []
    real = s.served.completion
    s.served.completion = lambda body: read.append(1) or real(body)

    def slowly(req):
        for n in range(1, 41):
            time.sleep(0.05)
            yield "x", "length" if n == 40 else None, n, None
    s.served.alone = slowly
    try:
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", s.url + "/completions", json={**REQUEST, "stream": True}) as first:
                lines = first.iter_lines()                       # kept: dropping it hangs up
                next(lines)                                      # it is decoding
                busy = post(s.port, REQUEST)
                assert busy.status_code == 429 and len(read) == 1
    finally:
        s.stop()


# --- who may drive it: Host and Origin ------------------------------------------------------------
def test_a_host_that_is_not_the_servers_is_refused(guarded):
    for host, code in ((f"127.0.0.1:{guarded.port}", 200), (f"localhost:{guarded.port}", 200), ("[::1]", 200),
                       (f"attacker.example:{guarded.port}", 403), ("127.0.0.1.attacker.example", 403), ("", 403)):
        r = post(guarded.port, REQUEST, host=host)
        assert r.status_code == code, (host, r.text)
        if code == 403:
            assert r.json()["error"]["code"] == "host_not_allowed"


def test_a_web_page_of_another_site_cannot_post_even_as_plain_text(guarded):
    url = f"http://127.0.0.1:{guarded.port}/v1/completions"
    for origin in ("http://attacker.example", f"http://localhost:{guarded.port + 1}", "null"):
        r = httpx.post(url, content=json.dumps(REQUEST), timeout=30,
                       headers={"content-type": "text/plain", "origin": origin})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", origin
        assert "access-control-allow-origin" not in r.headers
    own = httpx.post(url, json=REQUEST, headers={"origin": f"http://127.0.0.1:{guarded.port}"}, timeout=30)
    assert own.status_code == 200 and "access-control-allow-origin" not in own.headers   # no CORS by default


def test_two_hosts_or_two_origins_are_refused_whichever_comes_first(guarded):
    """Which of two Host (or Origin) headers counts depends on who reads them (a proxy, a
    browser, this gate): a request with two is 400 (RFC 9112 for Host) in either order."""
    own, stranger = f"127.0.0.1:{guarded.port}", "attacker.example"
    body = json.dumps(REQUEST).encode()
    for name, pair in (("host", (stranger, own)), ("host", (own, stranger)),
                       ("origin", (f"http://{own}", f"http://{stranger}")), ("origin", (f"http://{stranger}", f"http://{own}"))):
        lines = [f"{name}: {v}" for v in pair] + ([] if name == "host" else [f"host: {own}"])
        s = raw(guarded.port)
        s.sendall(("POST /v1/completions HTTP/1.1\r\n" + "\r\n".join(lines) + f"\r\ncontent-type: application/json\r\n"
                   f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body)
        s.settimeout(10)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        s.close()
        # h11 refuses two Hosts itself; two Origins reach the gate
        assert got.startswith(b"HTTP/1.1 400") and (name == "host" or b"duplicate_header" in got), (name, pair, got[:300])
    assert post(guarded.port, REQUEST).status_code == 200


def test_a_websocket_upgrade_stays_plain_http_under_the_guards(guarded):
    """No route speaks WebSocket, and an upgraded connection would leave the HTTP protocol whose
    deadlines and cap guard.py sets: the upgrade is answered as the HTTP request it also is."""
    s = raw(guarded.port)
    s.sendall(f"GET /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{guarded.port}\r\nUpgrade: websocket\r\n"
              "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
              .encode())
    assert status_of(s) == 405                 # the POST route's answer to a GET, not 101 or a socket's 403
    s.close()


def test_an_allowed_origin_and_host_are_served_with_cors(text_run):  # noqa: F811
    s = Server(text_run, limits=FAST, allowed_hosts=("tbp.lan",), allowed_origins=("http://localhost:3000",))
    try:
        url = f"http://127.0.0.1:{s.port}/v1/completions"
        pre = httpx.options(url, headers={"origin": "http://localhost:3000", "access-control-request-method": "POST",
                                          "access-control-request-headers": "content-type"}, timeout=30)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = httpx.post(url, json=REQUEST, headers={"origin": "http://localhost:3000", "host": "tbp.lan"}, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert httpx.post(url, json=REQUEST, headers={"origin": "http://localhost:3001"}).status_code == 403
    finally:
        s.stop()


def test_health_and_unknown_paths_answer_json(guarded):
    base = f"http://127.0.0.1:{guarded.port}"
    assert httpx.get(base + "/health").json()["status"] == "ok"
    r = httpx.get(base + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(base + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


# --- the log ---------------------------------------------------------------------------------------
def test_one_kind_of_log_line_is_bounded_and_the_rest_counted():
    f = RateLimitedLog(burst=5, window_s=0.5)
    rec = lambda: logging.LogRecord("uvicorn.error", logging.WARNING, "", 0, "Invalid HTTP request received.",
                                    (), None)
    assert sum(f.filter(rec()) for _ in range(10_000)) == 5
    assert f.filter(logging.LogRecord("x", logging.WARNING, "", 0, "another kind", (), None))
    time.sleep(0.6)
    later = rec()
    assert f.filter(later) and "9995 more like this" in later.getMessage()


def test_a_flood_of_connections_never_meets_the_descriptor_limit(text_run):  # noqa: F811
    """asyncio, when an accept fails for want of a descriptor, logs it and stops accepting for a
    whole second, so every fresh client waits that second. The connection cap leaves room for the
    descriptors accepting keeps in flight (accepted, not yet counted; evicted, not yet closed):
    a flood several times the limit, its sockets reopened as the server closes them, never
    makes an accept fail, and a fresh client is answered meanwhile."""
    import resource
    limit, crowd = 400, 1500
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < crowd + 200:
        pytest.skip(f"this process may open {hard} descriptors; the flood needs {crowd + 200}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (crowd + 200, hard))
    env = {**os.environ, "COLUMNS": "400"}
    p = subprocess.Popen([sys.executable, "-m", "tbp", "serve", "--checkpoint", str(text_run), "--port", "0", "--quiet"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    held: list[socket.socket] = []
    try:
        port = serving_port(p)
        reopened, end = 0, time.monotonic() + 5
        while time.monotonic() < end:
            alive = []
            for s in held:                          # the server closed some: open them again
                s.setblocking(False)
                try:
                    if s.recv(1) == b"":
                        s.close()
                        continue
                except BlockingIOError:
                    pass
                alive.append(s)
            held = alive
            while len(held) < crowd:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
                reopened += 1
        assert reopened > 2 * crowd                 # the crowd was many times the cap, and churned
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
    finally:
        for s in held:
            s.close()
        p.terminate()
        out = p.communicate(timeout=30)[0]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "out of system resource" not in out and "Too many open files" not in out, out[-2000:]


# --- the lifecycle of a service --------------------------------------------------------------------
def serve_process(run_dir, *args):
    env = {**os.environ, "COLUMNS": "400"}
    return subprocess.Popen([sys.executable, "-m", "tbp", "serve", "--checkpoint", str(run_dir), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def serving_port(p) -> int:
    lines = []
    while not lines or "serving" not in lines[-1]:
        lines.append(p.stdout.readline())
        assert lines[-1] and len(lines) < 5, lines
    return int(lines[-1].split("/v1")[0].rsplit(":", 1)[1])


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_port_0_names_its_port_and_a_signal_stops_it_whatever_clients_hold(text_run, sig, code):  # noqa: F811
    p = serve_process(text_run, "--port", 0)
    try:
        port = serving_port(p)
        assert port != 0 and post(port, {"prompt": "the", "max_tokens": 2}).status_code == 200
        half = raw(port)                           # a client holding half a body
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        t = time.monotonic()
        p.send_signal(sig)
        assert p.wait(timeout=15) == code and time.monotonic() - t < 6
        assert "Traceback" not in p.stdout.read()
        half.close()
    finally:
        p.kill()


def test_a_port_in_use_is_one_line_before_anything_says_serving(text_run):  # noqa: F811
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = serve_process(text_run, "--port", port)
        out, _ = p.communicate(timeout=60)
    assert p.returncode == 1 and f"--port {port}" in out and "in use" in out
    assert "serving" not in out and "Traceback" not in out
