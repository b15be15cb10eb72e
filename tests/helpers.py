"""What the CLI test modules share: invoking `tbp`, asserting a clean refusal, a tiny run."""
from click.testing import CliRunner

from tbp.cli import main

# a model small enough that a training run takes a fraction of a second
TINY_OPTIONS = dict(n_layer=1, n_head=2, d_model=16, n_ctx=16, batch_size=4, eval_batches=1, eval_interval=5,
                    log_interval=5)


def tiny(**changes) -> list[str]:
    """`tbp train` arguments for the tiny model, with some options changed, and -q."""
    opts = {**TINY_OPTIONS, **changes}
    return [a for k, v in opts.items() for a in (f"--{k.replace('_', '-')}", str(v))] + ["-q"]


TINY = tiny()


def run(args, **kw):
    """`tbp ARGS` in-process; arguments may be paths or numbers."""
    return CliRunner().invoke(main, [str(a) for a in args], **kw)


def clean_fail(result, code, message):
    """Exit code as given, the message shown, and no traceback."""
    assert result.exit_code == code, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def train_tiny(tmp_path, corpus_file, monkeypatch, out, iters, *extra):
    """Train TINY on the test corpus from inside tmp_path; returns the run directory."""
    monkeypatch.chdir(tmp_path)
    r = run(["train", "--data", corpus_file, "--out", out, "--max-iters", iters, *TINY, *extra])
    assert r.exit_code == 0, r.output
    return tmp_path / out
