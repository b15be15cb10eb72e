"""`tbp serve`: a run behind OpenAI's HTTP API (completions, chat completions, models).

The HTTP side is Starlette (ASGI) under uvicorn, an optional extra (``pip install 'tbp[serve]'``);
nothing here parses HTTP by hand. The model side is tbp's own KV-cached decoder, in a
thread of its own (the batcher's, or one per request for a model that cannot batch): it hands each
token's text to the request's :class:`Mailbox`, and the event loop sends whatever has arrived when
it next looks -- one wake-up per look, not a thread hop per token, so eight streams cost the loop
little more than one. A slow client or a disconnect is noticed between two tokens.

Admission. At most ``parallel`` requests decode at once, at most ``queue`` more wait for a place,
and any further request is answered 429 at once. With ``parallel`` above 1 the requests decoding
are decoded together, one batched step for all of them (:class:`Batcher`), each with its own
random generator and settings; their logits equal each one's own to float rounding. A client
that disconnects mid-stream frees its place after the token being computed. The server only
reads the run.

What a request may hold, how it is read and what the reply looks like: requests.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import threading
import time
import weakref
from typing import Callable

from ..errors import TbpError
from ..files import jsonio
from .guard import ACCEPT_BURST, Gatekeeper, HeaderLimit, Limits, limit_logs, protocol
from .requests import BadRequest, Request, Served


class Gate:
    """Admission: ``parallel`` places decoding, ``queue`` waiting; beyond that, refuse (429)."""

    def __init__(self, parallel: int, queue: int):
        self.parallel, self.queue = parallel, queue
        self.places = asyncio.Semaphore(parallel)
        self.admitted = 0

    def admit(self) -> None:
        if self.admitted >= self.parallel + self.queue:
            raise BadRequest(f"the server is busy: {self.parallel} request(s) decoding and {self.queue} waiting; "
                             f"retry later", status=429, kind="rate_limit_error", code="server_busy")
        self.admitted += 1

    def leave(self) -> None:
        self.admitted -= 1


class Mailbox:
    """Items from a decoding thread to the event loop. ``put`` (any thread) appends and wakes the
    loop only if it is waiting; ``take`` (the loop) returns everything that arrived since it last
    looked, waiting if nothing has. A busy loop thus takes several tokens in one look and sends
    them in one write."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.lock, self.waiter = loop, [], threading.Lock(), None

    def put(self, item) -> None:
        with self.lock:
            self.items.append(item)
            waiter, self.waiter = self.waiter, None
        if waiter is not None:
            self.loop.call_soon_threadsafe(_wake, waiter)

    async def take(self) -> list:
        with self.lock:
            if not self.items:
                self.waiter = waiter = self.loop.create_future()
        if not self.items:
            await waiter
        with self.lock:
            items, self.items = self.items, []
        return items


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():                   # a waiter whose request was cancelled stays cancelled
        waiter.set_result(None)


class Access:
    """One request's line of the access log: ``done`` writes it once, when the answer (or its
    stream) has ended -- method, path, status, the prompt's and the answer's tokens, the time from
    the request's arrival and how much of it was spent waiting for a place."""

    def __init__(self, request, write: Callable[[str], None] | None):
        self.write, self.t0 = write, time.perf_counter()
        self.what = f"{request.method} {request.url.path}"
        client = request.client
        self.who = f"{client.host}:{client.port}" if client else "-"
        self.waited, self.prompt, self.answer = 0.0, None, None

    def started(self, prompt: int) -> None:
        """The request got its place: the wait ends, its prompt's tokens are known."""
        self.waited, self.prompt = time.perf_counter() - self.t0, prompt

    def done(self, status: int, answer: int | None = None) -> None:
        if self.write is None:
            return
        tokens = "" if self.prompt is None else f" · prompt {self.prompt} · answer {answer or 0} tokens"
        self.write(f"{self.who} \"{self.what}\" {status}{tokens} · {time.perf_counter() - self.t0:.2f} s"
                   + (f" (queued {self.waited:.2f} s)" if self.prompt is not None else ""))
        self.write = None


class Ticket:
    """One admitted request's place in the gate, given back exactly once."""

    def __init__(self, gate: Gate):
        self.gate = gate

    def release(self) -> None:
        if self.gate is not None:
            self.gate.leave()
            self.gate = None


def app(served: Served, parallel: int = 1, queue: int = 16, api_key: str | None = None,
        limits: Limits = Limits(), access: Callable[[str], None] | None = None):
    """The Starlette application answering OpenAI's routes for ``served``; ``access`` is given
    each request's access-log line (None: no log)."""
    from anyio import CapacityLimiter, fail_after, to_thread
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    served.batch(parallel)              # --parallel requests decoded together, where the model allows
    gate: Gate | None = None            # made inside the server's event loop
    # the threads that encode prompts (decoding has threads of its own: Served.decode)
    workers = CapacityLimiter(parallel + 1)

    def error(e: BadRequest) -> JSONResponse:
        # a body refused unread (too large, too slow) is not drained: the connection ends with the answer
        unread = {"connection": "close"} if e.status in (408, 413) else None
        return JSONResponse(e.body(), status_code=e.status, headers=unread)

    def authorised(request) -> bool:
        if not api_key:
            return True
        given = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(given, f"Bearer {api_key}".encode())       # in constant time

    async def read(request) -> bytearray:
        """The body's bytes: counted as it arrives (chunked or not), whole within the deadline."""
        too_big = BadRequest(f"the request body is over {limits.body_bytes // 2 ** 20} MiB", status=413,
                             code="request_too_large")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limits.body_bytes:
            raise too_big
        body = bytearray()
        try:
            with fail_after(limits.body_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limits.body_bytes:
                        raise too_big
        except TimeoutError:
            raise BadRequest(f"the request body did not arrive within {limits.body_s:g} s", status=408,
                             code="request_timeout") from None
        except ClientDisconnect:            # gone mid-body (or the server is stopping): nobody to answer
            raise BadRequest("the client left before its body arrived", status=408) from None
        return body                         # as received: a copy of up to 16 MiB would stall the loop

    def parsed(raw: bytearray):
        """The body as JSON, through the reader every outside file takes (depth bounded, text
        checked). Run in a worker thread, as encoding is: parsing 16 MiB takes a second and
        ten times its size in objects, which the event loop must not wait for, and the workers'
        limit bounds how many bodies are parsed at once."""
        try:
            return jsonio.parse(raw.decode("utf-8"), "the request body")
        except UnicodeDecodeError:
            raise BadRequest("the request body is not UTF-8 text") from None
        except TbpError as e:
            raise BadRequest(str(e)) from None

    def logged(handler):
        """``handler`` with its request's access-log line written when the answer is made (a
        stream writes its own when it ends)."""
        async def route(request):
            log = Access(request, access)
            response = await handler(request, log)
            if not isinstance(response, StreamingResponse):
                log.done(response.status_code, log.answer)
            return response
        return route

    async def models(request, log: Access):
        if not authorised(request):
            return error(BadRequest("invalid API key", status=401, code="invalid_api_key"))
        return JSONResponse(served.models())

    async def answer(request, log: Access, chat: bool):
        nonlocal gate
        if not authorised(request):
            return error(BadRequest("invalid API key", status=401, code="invalid_api_key"))
        if gate is None:
            gate = Gate(parallel, queue)
        try:
            raw = await read(request)
            gate.admit()                        # a place in the queue before any model work
        except BadRequest as e:
            return error(e)
        checked = served.chat if chat else served.completion
        try:
            # parsing a body and encoding a prompt take a while: off the event loop, where other
            # clients are answered and streams are sent
            req = await to_thread.run_sync(lambda: checked(parsed(raw)), limiter=workers)
        except BadRequest as e:
            gate.leave()
            return error(e)
        if req.stream:
            # the place is given back when the stream ends, fails or is cancelled -- or, for a
            # client gone before its stream started, when the unstarted generator is collected
            ticket = Ticket(gate)
            events = stream(req, ticket, log)
            weakref.finalize(events, ticket.release)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        cancel = None
        try:
            async with gate.places:
                log.started(len(req.ids))
                box = Mailbox(asyncio.get_running_loop())
                cancel = served.decode(req, box.put)
                text, finish, n, lps = [], None, 0, []
                while finish is None:
                    for piece, finish, n, lp in delivered(await box.take()):
                        text.append(piece)
                        if lp is not None:
                            lps.append(lp)
                    log.answer = n
                    if finish is None and await request.is_disconnected():
                        return error(BadRequest("the client left", status=408))     # its place, back now
        except TbpError as e:               # the model itself failed (its logits overflow): said, not a traceback
            return error(BadRequest(str(e), status=500, kind="server_error"))
        finally:
            if cancel is not None:
                cancel()
            gate.leave()
        return JSONResponse(served.whole(req, "".join(text), finish, n, lps))

    def delivered(items: list):
        """A mailbox's items in order; the exception that ended the decoding raised where it came."""
        for item in items:
            if isinstance(item, Exception):
                raise item
            yield item

    async def stream(req: Request, ticket: "Ticket", log: Access):
        def event(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
        cancel = None
        n, status = 0, 200
        try:
            async with gate.places:
                log.started(len(req.ids))
                box = Mailbox(asyncio.get_running_loop())
                cancel = served.decode(req, box.put)
                if req.chat:
                    yield event(served.chunk(req, None, None, first=True))
                finish, n, lps, sent = None, 0, [], 0
                while finish is None:
                    events = []                 # every token that arrived since the last look: one write
                    try:
                        for piece, finish, n, lp in delivered(await box.take()):
                            if lp is not None:  # a token's log-probabilities ride with the next text sent
                                lps.append(lp)
                            if piece:
                                events.append(event(served.chunk(req, piece, None, lps=lps, offset=sent)))
                                sent += len(piece)
                                lps = []
                    except TbpError as e:       # mid-stream: the error as the last event, as OpenAI sends one
                        status = 500
                        yield "".join(events) + event(BadRequest(str(e), status=500, kind="server_error").body())
                        return
                    if finish is not None:
                        events.append(event(served.chunk(req, None, finish, lps=lps, offset=sent)))
                        if req.include_usage:
                            events.append(event(served.usage_chunk(req, n)))
                        events.append("data: [DONE]\n\n")
                    if events:
                        yield "".join(events)
        finally:
            if cancel is not None:
                cancel()
            ticket.release()
            log.done(status, n)

    async def completions(request, log: Access):
        return await answer(request, log, chat=False)

    async def chat_completions(request, log: Access):
        return await answer(request, log, chat=True)

    async def health(request, log: Access):
        # llama-server's probe: the model is loaded once the server listens; and how busy it is
        admitted = gate.admitted if gate is not None else 0
        decoding = min(admitted, parallel)
        return JSONResponse({"status": "ok", "model": served.name, "decoding": decoding,
                             "waiting": admitted - decoding, "parallel": parallel, "queue": queue})

    async def not_found(request, exc):
        if exc.status_code == 405:
            return error(BadRequest(f"{request.method} is not allowed on {request.url.path}", status=405,
                                    code="method_not_allowed"))
        return error(BadRequest(f"no route {request.url.path}: this server answers /v1/models, /v1/completions, "
                                f"/v1/chat/completions and /health (/v1/health)", status=404, code="not_found"))

    async def refused(request, exc):
        response = await not_found(request, exc)
        Access(request, access).done(response.status_code)
        return response

    return Starlette(routes=[Route("/v1/models", logged(models), methods=["GET"]),
                             Route("/v1/completions", logged(completions), methods=["POST"]),
                             Route("/v1/chat/completions", logged(chat_completions), methods=["POST"]),
                             Route("/health", logged(health), methods=["GET"]),
                             Route("/v1/health", logged(health), methods=["GET"])],
                     exception_handlers={404: refused, 405: refused})


LISTEN_QUEUE = 4096      # connections the kernel holds for accepting (a SYN beyond it waits a second)


def server(config):
    """uvicorn's Server for ``config``, with the listening socket's kernel queue deep
    (LISTEN_QUEUE) while asyncio accepts few connections a turn (config.backlog, ACCEPT_BURST,
    which asyncio also makes the queue's length): a burst of connections waits in the queue
    instead of being refused by the kernel, and never outruns the descriptor limit.

    A stop (SIGTERM, Ctrl-C) ends the serving gracefully and is kept in ``stopped_by`` for the
    caller to act on. uvicorn itself raises the caught signal again once it has stopped; a
    SIGINT raised there reaches asyncio's runner, which takes it as a cancel of a task that is
    already ending and may return as if nothing happened. So this server does not raise it:
    the command that runs it says how it ended."""
    import uvicorn

    class Service(uvicorn.Server):
        stopped_by: int | None = None            # the signal that stopped it

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            for sock in sockets or ():
                sock.listen(LISTEN_QUEUE)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield                            # signals reach the main thread only
                return
            stops = (signal.SIGINT, signal.SIGTERM)
            before = {sig: signal.signal(sig, self.handle_exit) for sig in stops}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            self.stopped_by = sig
            super().handle_exit(sig, frame)      # a second Ctrl-C forces the exit, as in uvicorn

    return Service(config)


def config(served: Served, sock, parallel: int = 1, queue: int = 16, api_key: str | None = None,
           limits: Limits = Limits(), allowed_hosts=(), allowed_origins=(), log_level: str = "warning",
           access: Callable[[str], None] | None = None):
    """uvicorn's Config for ``served`` on the bound, listening socket ``sock``: the routes behind
    the Host and Origin gate, the HTTP protocol with the connection limits, and a shutdown that
    waits for no client (guard.py)."""
    import uvicorn
    host, port = sock.getsockname()[:2]
    application = HeaderLimit(Gatekeeper.around(app(served, parallel, queue, api_key, limits, access), host, port,
                                                allowed_hosts, allowed_origins), limits.header_bytes)
    limit_logs(limits)
    # ws="none": OpenAI's API has no WebSocket route, and an upgraded connection would leave the
    # HTTP protocol whose deadlines and connection cap guard.py sets
    return uvicorn.Config(application, http=protocol(limits), ws="none", log_level=log_level, lifespan="off",
                          timeout_keep_alive=int(max(1, limits.idle_s)), timeout_graceful_shutdown=2,
                          h11_max_incomplete_event_size=limits.header_bytes, backlog=ACCEPT_BURST)
