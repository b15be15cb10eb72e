"""`tbp serve`: a run behind OpenAI's HTTP API on this machine."""
from __future__ import annotations

import errno
import signal
import socket
import sys
from pathlib import Path

import click

from ..errors import TbpError
from ..generate.guard import ACCEPT_BURST, raise_fd_limit
from ..machine.cores import blas_threads
from .common import Terminated, console, the_run, load_run
from .speculation import speculation_options

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")       # this machine's loopback: no key needed


@click.command()
@click.option("--checkpoint", "run", type=click.Path(path_type=Path), default=None,
              help="Run directory. Default: TBP_CHECKPOINT, else the newest run under checkpoints/ that did not abort (tbp runs).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; any other than this machine's loopback needs --api-key.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port.")
@click.option("--api-key", envvar="TBP_API_KEY", default=None,
              help="Clients must send 'Authorization: Bearer KEY' (or set TBP_API_KEY).")
@click.option("--name", default=None, help="The model's id in /v1/models and in answers. Default: the run's folder name.")
@click.option("--parallel", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Requests decoded at once, together: one batched step feeds them all (each its own cache, "
                   "random generator and settings).")
@click.option("--queue", type=click.IntRange(0, 4096), default=16, show_default=True,
              help="Requests that may wait for a place; beyond them a request is answered 429.")
@click.option("--best", is_flag=True, help="Serve the weights with the best validation loss.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="Another name clients reach the server by (repeatable; '*' any): a request's Host header must "
                   "be a loopback name, the --host address or one of these, so that no web page can reach it "
                   "through a name of its own (DNS rebinding).")
@click.option("--allowed-origin", "allowed_origins", multiple=True, metavar="ORIGIN",
              help="A web page's origin allowed to use the server from a browser, e.g. http://localhost:3000 "
                   "(repeatable; '*' any): it gets CORS headers. Requests from any other page are refused.")
@click.option("--threads", type=click.IntRange(1, 256), default=1, show_default=True,
              help="Threads of NumPy's BLAS in each product. More pays for a large model on an otherwise idle "
                   "machine; beside other work its threads spin waiting for a core and decoding stalls "
                   "(the serve page has the measurements).")
@click.option("--quiet", "-q", is_flag=True, help="No access log (by default one line a request on stderr: method, "
                                                  "path, status, tokens, time and time queued).")
@speculation_options
def serve(run, host, port, api_key, name, parallel, queue, best, allowed_hosts, allowed_origins, threads, quiet,
          speculation=None):
    """Serve a run with OpenAI's API: /v1/models, /v1/completions, /v1/chat/completions.

    Any OpenAI client works: point its base URL at http://HOST:PORT/v1. Streaming (server-sent
    events), max_tokens, temperature, top_p, stop, seed and usage counts are supported; chat
    needs a model trained on conversations. GET /health answers {"status": "ok"}. The server
    only reads the run. --lookup or --draft RUN decode speculatively (with --parallel 1): the same
    text, faster where drafts are kept; the usage says how many were.

    Web pages cannot use it unless allowed: a request whose Host header is not one of the
    server's names, or whose Origin is another site's, is refused (--allowed-host,
    --allowed-origin). Slow or idle clients are cut off (headers within 10 s, a body within
    30 s, idle connections after 5 s), and the oldest idle connection makes room for a new one.
    SIGTERM or Ctrl-C stops it within seconds, whatever the clients do.

    \b
    Examples:
      tbp serve --checkpoint checkpoints/dialogue
      curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
           -d '{"model": "dialogue", "prompt": "ROMEO:", "max_tokens": 40}'
      tbp serve --port 0                        # any free port; the line it prints names it
    """
    api_key = api_key or None               # TBP_API_KEY="" is no key
    if speculation is not None and parallel > 1:
        raise click.UsageError(f"{'--lookup' if speculation.lookup else '--draft'} decodes one request at a time: "
                               f"it cannot run with --parallel {parallel} (batched requests already share each "
                               f"read of the weights)")
    if host not in LOCAL_HOSTS and not api_key:
        raise click.UsageError(f"--host {host} opens the server to other machines: give it an --api-key "
                               f"(or TBP_API_KEY)")
    try:
        import uvicorn  # noqa: F401
        import starlette  # noqa: F401
    except ImportError:
        raise TbpError("tbp serve needs Starlette and uvicorn: pip install 'tbp[serve]'") from None
    from ..generate.server import config, server as make_server
    from ..generate.requests import Served
    run = the_run(run)
    model, tok, _ = load_run(run, best=best)
    drafter = speculation.drafter(model, tok, run) if speculation is not None else None
    served = Served(model, tok, name or Path(run).resolve().name, drafter)
    if model.config.causal:
        served.folds.prepare()               # the weights folded for decoding now, not on the first request
    raise_fd_limit()                         # room for the connection cap, where the hard limit allows
    sock = listen(host, port)                # before anything says "serving": a port in use is one line
    port = sock.getsockname()[1]
    routes = "/v1/models, /v1/completions" + (", /v1/chat/completions" if served.chat_template else "")
    where = f"[{host}]" if ":" in host else host                # an IPv6 address goes in brackets
    console.print(f"serving {run} as {served.name!r} on http://{where}:{port}/v1 ({routes}); Ctrl-C stops",
                  soft_wrap=True)
    def access(line: str) -> None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    server = make_server(config(served, sock, parallel, queue, api_key, allowed_hosts=allowed_hosts,
                                allowed_origins=allowed_origins, access=None if quiet else access))
    # the event loop (accepting, reading, answering) shares the GIL with the decoding threads:
    # a shorter slice lets it in sooner while they step
    sys.setswitchinterval(0.001)
    # the server stops on SIGTERM or Ctrl-C (waiting 2 s at most for clients) and says which it
    # was: tbp then exits as for any other command, "terminated", 143, or "interrupted", 130.
    # The BLAS's own threads busy-wait between products: beside the event loop, the clients or
    # any other process they take the core the decoder is waiting for, so by default the products
    # run on one thread
    with blas_threads(threads):
        server.run(sockets=[sock])
    if server.stopped_by is not None:
        raise Terminated() if server.stopped_by == signal.SIGTERM else KeyboardInterrupt()


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening; TbpError naming the port if it is taken."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise TbpError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(ACCEPT_BURST)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise TbpError(f"--port {port}: the port is in use on {host} (another server?); choose another, "
                           f"or --port 0 for any free one") from None
        raise TbpError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.set_inheritable(True)
    return sock
