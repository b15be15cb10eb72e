"""`tbp generate` through CliRunner."""
import pytest
from click.testing import CliRunner
from helpers import run, train_tiny

from tbp import checkpoint
from tbp.cli import main


@pytest.fixture
def run_dir(tmp_path, corpus_file, monkeypatch):
    return train_tiny(tmp_path, corpus_file, monkeypatch, "checkpoints/g", 5)


def test_generate_defaults_to_latest_run_and_streams_text(run_dir):
    r = CliRunner().invoke(main, ["generate", "--max-new-tokens", "30", "--seed", "1"])
    assert r.exit_code == 0, r.output
    assert "tokens/s" in r.output and "KV cache" in r.output


def test_same_seed_same_text_with_and_without_cache(run_dir):
    runner = CliRunner()
    args = ["generate", "--checkpoint", str(run_dir), "--prompt", "the cat", "--max-new-tokens", "40",
            "--seed", "3", "--temperature", "0.9", "--top-k", "10", "--top-p", "0.95"]
    a = runner.invoke(main, args)
    b = runner.invoke(main, args + ["--no-kv-cache"])
    assert a.exit_code == b.exit_code == 0
    assert a.stdout == b.stdout and a.stdout.startswith("the cat")


def test_prompt_longer_than_context_is_cropped_with_a_warning(run_dir):
    r = run(["generate", "--checkpoint", run_dir, "--prompt", "the cat sat on the mat " * 4,
             "--max-new-tokens", 5])
    assert r.exit_code == 0, r.output
    assert "keeping the last 16" in r.output


def test_several_samples(run_dir):
    r = run(["generate", "--checkpoint", run_dir, "--num-samples", 3, "--max-new-tokens", 10, "--seed", 0])
    assert r.exit_code == 0 and r.stdout.count("--- sample") == 3


@pytest.mark.parametrize("args,code,msg", [
    (["--temperature", "-1"], 2, "Invalid value for '--temperature'"),
    (["--temperature", "nan"], 2, "not a finite number"),
    (["--top-p", "0"], 2, "Invalid value for '--top-p'"),
    (["--top-p", "1.5"], 2, "Invalid value for '--top-p'"),
    (["--top-p", "nan"], 2, "not a finite number"),
    (["--top-k", "0"], 2, "Invalid value for '--top-k'"),
    (["--prompt", "Zé"], 1, "2 character(s) not in this char tokenizer's vocabulary of 27, first on line 1: "
                                "'Z' (U+005A) x1, 'é' (U+00E9) x1"),
])
def test_bad_input(run_dir, args, code, msg):
    r = run(["generate", "--checkpoint", run_dir, *args])
    assert r.exit_code == code, r.output
    assert msg in r.output and "Traceback" not in r.output


def test_missing_and_damaged_checkpoints(tmp_path, run_dir):
    r = run(["generate", "--checkpoint", tmp_path / "nope"])
    assert r.exit_code == 1 and "no such checkpoint directory" in r.output
    checkpoint.weights_path(run_dir).write_bytes(b"garbage")
    r = run(["generate", "--checkpoint", run_dir])
    assert r.exit_code == 1 and "damaged safetensors" in r.output and "Traceback" not in r.output


def test_no_checkpoint_at_all(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run(["generate"])
    assert r.exit_code == 1 and "no checkpoint under checkpoints" in r.output


def test_a_dataset_folder_is_not_a_checkpoint(run_dir):
    r = run(["generate", "--checkpoint", run_dir.parent.parent / "data" / "corpus"])
    assert r.exit_code == 1 and "is a prepared dataset, not a checkpoint" in r.output


def test_a_stop_string_typed_with_backslash_escapes_stops_at_the_newline(run_dir):
    """--stop "\\n" as a shell passes it (a backslash and an n) ends the sample at its first
    newline; without the stop the same seed runs on through several lines."""
    args = ["generate", "--checkpoint", run_dir, "--prompt", "the", "--max-new-tokens", 300, "--seed", 2]
    free = run(args)
    stopped = run(args + ["--stop", "\\n"])
    assert free.exit_code == stopped.exit_code == 0, stopped.output
    assert free.stdout.rstrip("\n").count("\n") >= 2                  # the model writes lines
    text = stopped.stdout.rstrip("\n")
    assert "\n" not in text and free.stdout.startswith(text)


def test_stop_escapes():
    from tbp.cli.options import unescape
    assert unescape(r"\n\n") == "\n\n" and unescape(r"a\tb") == "a\tb"
    assert unescape("x\\\\n") == "x\\n" and unescape(r"\q") == r"\q" and unescape("end\\") == "end\\"


@pytest.mark.parametrize("command", [["generate", "--max-new-tokens", "3"], ["attention", "--prompt", "the"],
                                     ["info"], ["eval"]], ids=lambda c: c[0])
def test_every_command_names_the_run_it_read_first(run_dir, command):
    """Without --checkpoint a command takes the newest run: its first line on stderr says which,
    and that it was chosen for the user."""
    r = run(command)
    assert r.exit_code == 0, r.output
    first = r.stderr.splitlines()[0]
    assert first.startswith("run: ") and "checkpoints/g" in first and "the newest" in first


def test_a_given_run_is_named_too(run_dir):
    r = run(["generate", "--checkpoint", run_dir, "--max-new-tokens", "3"])
    assert r.exit_code == 0 and r.stderr.splitlines()[0] == f"run: {run_dir}"
