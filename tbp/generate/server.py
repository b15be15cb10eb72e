"""`tbp serve`: a run behind OpenAI's HTTP API (completions, chat completions, models).

The HTTP side is Starlette (ASGI) under uvicorn, an optional extra (``pip install 'tbp[serve]'``);
nothing here parses HTTP by hand. The model side is tbp's own KV-cached decoder
(:func:`tbp.generate.sampling.generate_ids`), stepped one token at a time in a worker thread, so a slow
client or a disconnect is noticed between two tokens.

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
import hmac
import json
import weakref

from ..errors import TbpError
from .requests import BadRequest, Request, Served

MAX_BODY = 16 * 2 ** 20          # bytes of one request: far more than any context holds, refused beyond


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


class Ticket:
    """One admitted request's place in the gate, given back exactly once."""

    def __init__(self, gate: Gate):
        self.gate = gate

    def release(self) -> None:
        if self.gate is not None:
            self.gate.leave()
            self.gate = None


def app(served: Served, parallel: int = 1, queue: int = 16, api_key: str | None = None):
    """The Starlette application answering OpenAI's routes for ``served``."""
    from anyio import CapacityLimiter, to_thread
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    served.batch(parallel)              # --parallel requests decoded together, where the model allows
    gate: Gate | None = None            # made inside the server's event loop
    # the threads that decode: one per place, and one more to read requests beside them
    workers = CapacityLimiter(parallel + 1)

    def error(e: BadRequest) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    def authorised(request) -> bool:
        if not api_key:
            return True
        given = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(given, f"Bearer {api_key}".encode())       # in constant time

    async def read(request):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY:
            raise BadRequest(f"the request body is over {MAX_BODY // 2 ** 20} MiB", status=413)
        body = await request.body()
        if len(body) > MAX_BODY:
            raise BadRequest(f"the request body is over {MAX_BODY // 2 ** 20} MiB", status=413)
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None

    async def models(request):
        if not authorised(request):
            return error(BadRequest("invalid API key", status=401, code="invalid_api_key"))
        return JSONResponse(served.models())

    async def answer(request, chat: bool):
        nonlocal gate
        if not authorised(request):
            return error(BadRequest("invalid API key", status=401, code="invalid_api_key"))
        if gate is None:
            gate = Gate(parallel, queue)
        try:
            body = await read(request)
            # encoding a long prompt takes a while: off the event loop, where other streams are sent
            req = await to_thread.run_sync(served.chat if chat else served.completion, body, limiter=workers)
            gate.admit()
        except BadRequest as e:
            return error(e)
        if req.stream:
            # the place is given back when the stream ends, fails or is cancelled -- or, for a
            # client gone before its stream started, when the unstarted generator is collected
            ticket = Ticket(gate)
            events = stream(req, ticket)
            weakref.finalize(events, ticket.release)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            async with gate.places:
                steps = served.steps(req)
                text, finish, n = [], None, 0
                while finish is None:
                    piece, finish, n = await to_thread.run_sync(next, steps, limiter=workers)
                    text.append(piece)
        except TbpError as e:               # the model itself failed (its logits overflow): said, not a traceback
            return error(BadRequest(str(e), status=500, kind="server_error"))
        finally:
            gate.leave()
        return JSONResponse(served.whole(req, "".join(text), finish, n))

    async def stream(req: Request, ticket: "Ticket"):
        def event(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
        steps = None
        try:
            async with gate.places:
                steps = served.steps(req)
                if req.chat:
                    yield event(served.chunk(req, None, None, first=True))
                finish, n = None, 0
                while finish is None:
                    try:
                        piece, finish, n = await to_thread.run_sync(next, steps, limiter=workers)
                    except TbpError as e:       # mid-stream: the error as the last event, as OpenAI sends one
                        yield event(BadRequest(str(e), status=500, kind="server_error").body())
                        return
                    if piece:
                        yield event(served.chunk(req, piece, None))
                yield event(served.chunk(req, None, finish))
                if req.include_usage:
                    yield event(served.usage_chunk(req, n))
                yield "data: [DONE]\n\n"
        finally:
            if steps is not None:
                steps.close()
            ticket.release()

    async def completions(request):
        return await answer(request, chat=False)

    async def chat_completions(request):
        return await answer(request, chat=True)

    return Starlette(routes=[Route("/v1/models", models, methods=["GET"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"])])
