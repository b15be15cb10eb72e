"""`tbp info` on runs and datasets, `tbp merge` refusals, and the top-level help."""
import json

from click.testing import CliRunner

from tbp.cli import main
from tbp.cli.info import sparkline

TINY = ["--n-layer", "2", "--n-head", "2", "--d-model", "16", "--n-ctx", "16", "--batch-size", "4",
        "--eval-batches", "1", "--eval-interval", "5", "-q"]


def run(args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_info_on_a_run_and_on_its_dataset(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(["train", "--data", corpus_file, "--out", "checkpoints/r", "--max-iters", 10, *TINY]).exit_code == 0
    r = run(["info", "checkpoints/r"])
    assert r.exit_code == 0, r.output
    for text in ("2 layers", "parameters per layer", "h.1.mlp", "best val loss", "evaluations"):
        assert text in r.output
    d = json.loads(run(["info", "checkpoints/r", "--json"]).stdout)
    assert d["state"]["step"] == 10 and d["kind"] == "model"
    assert sum(d["layers"].values()) == d["parameters"]
    assert list(d["layers"])[:3] == ["wte", "wpe", "h.0.attn"]
    ds = json.loads(run(["info", "data/corpus", "--json"]).stdout)
    assert ds["tokenizer"] == "char" and ds["train_tokens"] > 0
    assert run(["info"]).exit_code == 0                       # newest run by default


def test_info_on_a_folder_that_is_neither(tmp_path):
    r = run(["info", tmp_path])
    assert r.exit_code == 1 and "neither a run" in r.output


def test_merge_refuses_a_plain_run(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(["train", "--data", corpus_file, "--out", "r", "--max-iters", 2, *TINY]).exit_code == 0
    r = run(["merge", "r", "--out", "m"])
    assert r.exit_code == 1 and "no LoRA adapters" in r.output


def test_sparkline_spans_the_range():
    s = sparkline([4.0, 3.0, 2.0, 1.0])
    assert s[0] == "█" and s[-1] == "▁" and len(s) == 4
    assert len(sparkline(list(range(500)), width=40)) == 40


def test_every_command_has_help_with_an_example():
    for cmd in ("prepare", "train", "generate", "gradcheck", "merge", "info"):
        r = run([cmd, "--help"])
        assert r.exit_code == 0 and "Example" in r.output, cmd
    assert "tbp train" in run(["--help"]).output
