"""What the CLI test modules share: invoking `tbp`, asserting a clean refusal, a tiny run."""
from click.testing import CliRunner

from tbp.cli import main

# a model small enough that a training run takes a fraction of a second
TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--n-ctx", "16", "--batch-size", "4",
        "--eval-batches", "1", "--eval-interval", "5", "--log-interval", "5", "-q"]


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
