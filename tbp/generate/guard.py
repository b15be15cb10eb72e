"""What a client can make ``tbp serve`` spend, bounded before it is spent; and who may drive it.

The connection side (below the application, in uvicorn's HTTP protocol):

- a request's headers must arrive whole within ``header_s`` of its first byte (of the
  connection, for the first request), however they are trickled: one deadline per request,
  not per read, so a byte a second cannot hold a connection;
- an idle keep-alive connection closes after ``idle_s``;
- at most ``connections`` are open (the descriptor limit, raised toward the hard limit at
  start, less what accepting keeps in flight and a margin): one more evicts the
  oldest that has no request being answered and never had one (a silent socket first, then one
  trickling its headers) -- a client's
  kept-alive connection only if there is no such one -- so a fresh client is served whatever a
  crowd of idle sockets does, and the process never meets its file-descriptor limit;
- a header block over ``header_bytes`` is refused: by the HTTP parser (h11's limit) while it
  arrives in pieces, by :class:`HeaderLimit` when it arrives whole in one read;
- log lines: each kind of message at most ``log_burst`` times a minute, then one line counting
  the rest (a client cannot fill the disk with "invalid HTTP request");
- a stop (SIGTERM, Ctrl-C) closes every connection at once: no client can hold it.

The application side (server.py): the body must arrive within ``body_s`` and hold at most
``body_bytes``, counted as it arrives (chunked or not), and is only read once the key, the Host
and the Origin have passed; a request is admitted to the queue before any of its text is
encoded, and a prompt is refused by a cheap bound on its tokens before the tokenizer runs.

Who may drive it (:class:`Gatekeeper`, an ASGI middleware). A web page the user opens can send
a request to a server on loopback (a ``text/plain`` POST needs no preflight), and by DNS
rebinding -- a name the page controls, pointed at 127.0.0.1 -- read the answer. So the Host
header must name an address the server is reached by (the loopback names and the listening
address by default, ``--allowed-host`` more), and a request with an Origin other than the
server's own is refused unless ``--allowed-origin`` names it, in which case (and only then)
CORS headers let that page read the answers. A request with two Host or two Origin headers
is refused outright (400): which of the two counts must not depend on who reads it.
"""
from __future__ import annotations

import json
import logging
import resource
import time
from collections import Counter
from dataclasses import dataclass

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


# connections accepted in one turn of the event loop (asyncio accepts up to the listen backlog
# at once), before the evictions they cause have closed anything
ACCEPT_BURST = 64
# turns of accepts whose descriptors are open beyond the connections counted: a connection
# accepted in one turn is made (counted, and evicts another) in the next but one, and the one it
# evicts closes its descriptor a turn later still
BURSTS_IN_FLIGHT = 3
FD_LIMIT_WANTED = 8192     # the soft descriptor limit tbp serve asks for, where the hard one allows


def fd_budget() -> int:
    """Connections the process can hold open: its soft file-descriptor limit less the
    descriptors of connections accepted but not yet counted or evicted but not yet closed
    (BURSTS_IN_FLIGHT turns of ACCEPT_BURST accepts) and a margin for what else it holds (the
    listening socket, the log, the threads' pipes, a file being read), at most 4,096. The
    limit must never be met: asyncio, when an accept fails for want of a descriptor, stops
    accepting for a whole second, and every fresh client waits that second."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(8, min(4096, soft - BURSTS_IN_FLIGHT * ACCEPT_BURST - 64))


def raise_fd_limit(wanted: int = FD_LIMIT_WANTED) -> None:
    """Lift the process's soft descriptor limit to ``wanted``, or to the hard limit if that is
    lower (a soft limit of 1,024 beside a hard one of 500,000 is common): room for the full
    connection cap. A hard limit the user set (``ulimit -n``) is kept."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


@dataclass(frozen=True)
class Limits:
    """The bounds on what one client can make the server spend (seconds, bytes, sockets)."""
    header_s: float = 10.0
    body_s: float = 30.0
    idle_s: float = 5.0
    connections: int = 0                 # 0: from the file-descriptor limit (fd_budget)
    header_bytes: int = 16 * 1024
    body_bytes: int = 16 * 2 ** 20
    log_burst: int = 20

    def open_connections(self) -> int:
        return self.connections or fd_budget()


def protocol(limits: Limits):
    """uvicorn's h11 HTTP protocol with the request deadline and the connection cap (a class,
    which uvicorn.Config takes as ``http``)."""
    from collections import OrderedDict

    from uvicorn.protocols.http.h11_impl import H11Protocol

    cap = limits.open_connections()
    # the connections that may be evicted, each in the order it entered (oldest first), in the
    # order they go: silent ones, ones sending their first request's headers, then kept-alive
    # clients between two requests; a connection whose request is being answered is in none.
    # Dictionaries, so that admitting one more costs the same whatever the crowd.
    silent, sending, kept = OrderedDict(), OrderedDict(), OrderedDict()
    pools = (silent, sending, kept)

    class Guarded(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.headers_due = None
            self._await_headers()
            silent[self] = None
            if len(self.connections) > cap:
                self._evict()

        def _busy(self) -> bool:
            """A request is being answered: its headers are in and its response not finished."""
            return self.cycle is not None and not self.cycle.response_complete

        def _await_headers(self) -> None:
            if self.headers_due is None:
                self.headers_due = self.loop.call_later(limits.header_s, self._too_slow)

        def _too_slow(self) -> None:
            self.headers_due = None
            if not self._busy():
                self.transport.close()

        def _evict(self) -> None:
            for pool in pools:
                while pool:
                    victim, _ = pool.popitem(last=False)
                    if not victim.transport.is_closing():
                        victim.transport.close()
                        return
            self.transport.close()              # every other one is being answered: not this one

        def _leave_pools(self) -> None:
            for pool in pools:
                pool.pop(self, None)

        def data_received(self, data: bytes) -> None:
            if self in silent:
                del silent[self]
                sending[self] = None
            if not self._busy():
                self._await_headers()           # a next request on a kept-alive connection: its own deadline
            super().data_received(data)
            if self._busy():
                self._leave_pools()
                if self.headers_due is not None:
                    self.headers_due.cancel()   # the headers are in: the body has the application's deadline
                    self.headers_due = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                kept[self] = None

        def shutdown(self) -> None:
            # the server is stopping (SIGTERM, Ctrl-C): every connection ends now, so no client can
            # hold the stop; an answer being decoded sees its client gone after the current token
            self.transport.close()

        def connection_lost(self, exc) -> None:
            self._leave_pools()
            if self.headers_due is not None:
                self.headers_due.cancel()
                self.headers_due = None
            super().connection_lost(exc)

    return Guarded


class RateLimitedLog(logging.Filter):
    """At most ``burst`` lines of each message kind (its format string) a minute; the first
    line after a quiet spell says how many were left out."""

    def __init__(self, burst: int, window_s: float = 60.0):
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self.seen: dict[str, list] = {}          # kind -> [window start, lines in it, left out]

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        key = str(record.msg)[:200]
        if len(self.seen) > 1000:                # bounded too: old kinds forgotten
            self.seen = {k: v for k, v in self.seen.items() if now - v[0] < self.window_s}
        start, n, left = self.seen.setdefault(key, [now, 0, 0])
        if now - start >= self.window_s:
            start, n = now, 0
        if n >= self.burst:
            self.seen[key] = [start, n, left + 1]
            return False
        if left:
            record.msg = f"{record.msg} ({left} more like this left out of the log)"
        self.seen[key] = [start, n + 1, 0]
        return True


def limit_logs(limits: Limits) -> None:
    """Put the rate limit on the loggers a client's behaviour can make write: uvicorn's and
    asyncio's."""
    for name in ("uvicorn.error", "uvicorn", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitedLog) for f in logger.filters):
            logger.addFilter(RateLimitedLog(limits.log_burst))


def _host_name(value: str) -> str:
    """The name part of a Host header or an origin's authority: without the port, IPv6
    brackets dropped, lower-case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class HeaderLimit:
    """ASGI middleware: refuse (431) a request whose request line and headers hold more than
    ``limit`` bytes. h11's own limit holds for a header block that arrives in pieces; one that
    arrives whole in a single read (up to the transport's 256 KiB) is parsed before h11 can
    count it, so it is counted here, before any other part of the server sees the request."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") \
                + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.limit:
                return await _refuse(send, f"the request line and headers hold {size:,} bytes, over "
                                           f"{self.limit:,}", "headers_too_large", status=431)
        return await self.app(scope, receive, send)


class Gatekeeper:
    """ASGI middleware: refuse (403, OpenAI's error shape) a request whose Host is not an
    address the server is reached by, or whose Origin is a page not allowed to drive it."""

    def __init__(self, app, hosts: set[str], origins: set[str], port: int):
        self.app, self.hosts, self.origins, self.port = app, hosts, origins, port

    @classmethod
    def around(cls, app, listen: str, port: int, allowed_hosts=(), allowed_origins=()):
        """The application behind the gate, with CORS for the origins named (none by default)."""
        hosts = {*LOOPBACK_NAMES, *(_host_name(h) for h in allowed_hosts)}
        if listen not in ("0.0.0.0", "::"):
            hosts.add(_host_name(listen))
        origins = {o.rstrip("/").lower() for o in allowed_origins}
        if origins:
            from starlette.middleware.cors import CORSMiddleware
            app = CORSMiddleware(app, allow_origins=sorted(origins), allow_methods=["GET", "POST"],
                                 allow_headers=["authorization", "content-type"])
        return cls(app, hosts, origins, port)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        named = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k in (b"host", b"origin")]
        headers = dict(named)
        if len(named) > len(headers):
            # two Hosts (RFC 9112 says 400) or two Origins: which one a proxy, a browser or this
            # gate believes is not for a client to choose
            twice = sorted(k for k, n in Counter(k for k, _ in named).items() if n > 1)
            return await _refuse(send, f"more than one {' and more than one '.join(twice)} header in one request",
                                 "duplicate_header",
                                 status=400)
        host = _host_name(headers.get("host", ""))
        if "*" not in self.hosts and host not in self.hosts:
            return await _refuse(send, f"Host {headers.get('host', '')!r} is not an address this server answers "
                                       f"to (tbp serve --allowed-host NAME adds one)", "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self._allowed(origin):
            return await _refuse(send, f"requests from the web page at {origin} are refused (tbp serve "
                                       f"--allowed-origin {origin} lets it use this server)", "origin_not_allowed")
        return await self.app(scope, receive, send)

    def _allowed(self, origin: str) -> bool:
        origin = origin.rstrip("/").lower()
        if "*" in self.origins or origin in self.origins:
            return True
        scheme, _, authority = origin.partition("://")
        # the server's own origin (it serves no page, but a browser may name it): its scheme,
        # one of its names and its port -- another port on this machine is another site
        port = authority.rsplit(":", 1)[1] if authority.rsplit("]", 1)[-1].count(":") == 1 else "80"
        return scheme == "http" and _host_name(authority) in self.hosts and port == str(self.port)


async def _refuse(send, message: str, code: str, status: int = 403) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
