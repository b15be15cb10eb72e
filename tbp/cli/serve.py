"""`tbp serve`: a run behind OpenAI's HTTP API on this machine."""
from __future__ import annotations

from pathlib import Path

import click

from ..runs import disk
from ..errors import TbpError
from .common import console, the_run

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
def serve(run, host, port, api_key, name, parallel, queue, best):
    """Serve a run with OpenAI's API: /v1/models, /v1/completions, /v1/chat/completions.

    Any OpenAI client works: point its base URL at http://HOST:PORT/v1. Streaming (server-sent
    events), max_tokens, temperature, top_p, stop, seed and usage counts are supported; chat
    needs a model trained on conversations. The server only reads the run.

    \b
    Examples:
      tbp serve --checkpoint checkpoints/dialogue
      curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
           -d '{"model": "dialogue", "prompt": "ROMEO:", "max_tokens": 40}'
    """
    api_key = api_key or None               # TBP_API_KEY="" is no key
    if host not in LOCAL_HOSTS and not api_key:
        raise click.UsageError(f"--host {host} opens the server to other machines: give it an --api-key "
                               f"(or TBP_API_KEY)")
    try:
        import uvicorn
        import starlette  # noqa: F401
    except ImportError:
        raise TbpError("tbp serve needs Starlette and uvicorn: pip install 'tbp[serve]'") from None
    from ..generate.server import app
    from ..generate.requests import Served
    run = the_run(run)
    model, tok, _ = disk.load_model(run, best=best)
    served = Served(model, tok, name or Path(run).resolve().name)
    routes = "/v1/models, /v1/completions" + (", /v1/chat/completions" if served.chat_ids else "")
    where = f"[{host}]" if ":" in host else host                # an IPv6 address goes in brackets
    console.print(f"serving {run} as {served.name!r} on http://{where}:{port}/v1 ({routes}); Ctrl-C stops")
    uvicorn.run(app(served, parallel, queue, api_key), host=host, port=port, log_level="warning")
