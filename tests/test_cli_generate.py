"""`tbp generate` through CliRunner."""
import pytest
from click.testing import CliRunner
from helpers import run, train_tiny

from tbp.runs import disk
from tbp.cli.main import main


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
    disk.weights_path(run_dir).write_bytes(b"garbage")
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


def test_many_prompts_from_a_file_as_json_lines(run_dir, tmp_path):
    """--prompts: one prompt a line; --json: a record per sample with its prompt, settings and
    seed; prompt i uses seed + i, so its record repeats a single run with that seed."""
    import json
    (tmp_path / "p.txt").write_text("the cat\n\nthe dog\nline 3\n")
    r = run(["generate", "--checkpoint", run_dir, "--prompts", tmp_path / "p.txt", "--max-new-tokens", 12,
             "--seed", 5, "--num-samples", 2, "--json"])
    assert r.exit_code == 0, r.output
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["prompt"], x["sample"], x["seed"]) for x in records] == [
        ("the cat", 0, 5), ("the cat", 1, 5), ("the dog", 0, 6), ("the dog", 1, 6), ("line 3", 0, 7), ("line 3", 1, 7)]
    assert records[0]["temperature"] == 0.8 and records[0]["max_new_tokens"] == 12 and records[0]["run"] == str(run_dir)
    one = run(["generate", "--checkpoint", run_dir, "--prompt", "the dog", "--max-new-tokens", 12, "--seed", 6,
               "--num-samples", 2, "--json"])
    assert [json.loads(line)["completion"] for line in one.stdout.splitlines()] == \
        [x["completion"] for x in records if x["prompt"] == "the dog"]
    text = run(["generate", "--checkpoint", run_dir, "--prompts", tmp_path / "p.txt", "--max-new-tokens", 5])
    assert text.exit_code == 0 and text.stdout.count("=== prompt") == 3
    unseeded = run(["generate", "--checkpoint", run_dir, "--prompt", "the", "--max-new-tokens", 5, "--json"])
    record = json.loads(unseeded.stdout)
    again = run(["generate", "--checkpoint", run_dir, "--prompt", "the", "--max-new-tokens", 5, "--json",
                 "--seed", record["seed"]])
    assert isinstance(record["seed"], int) and json.loads(again.stdout)["completion"] == record["completion"]
    from tbp.cli.generate import read_prompts
    (tmp_path / "q.txt").write_text('"the cat," she said\nthe dog\n')        # a quote, not JSON
    assert read_prompts(str(tmp_path / "q.txt")) == ['"the cat," she said', "the dog"]
    (tmp_path / "j.txt").write_text('"the cat"\n{"prompt": "the dog"}\n')  # JSON lines in a .txt
    assert read_prompts(str(tmp_path / "j.txt")) == ["the cat", "the dog"]


def test_prompts_as_json_lines_and_their_refusals(run_dir, tmp_path):
    from helpers import clean_fail
    (tmp_path / "p.jsonl").write_text('{"prompt": "the cat"}\n"the dog"\n')
    r = run(["generate", "--checkpoint", run_dir, "--prompts", tmp_path / "p.jsonl", "--max-new-tokens", 4, "--json"])
    assert r.exit_code == 0, r.output
    assert [line.split('"prompt": ')[1].split(",")[0] for line in r.stdout.splitlines()] == ['"the cat"', '"the dog"']
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": 3}\n')
    clean_fail(run(["generate", "--checkpoint", run_dir, "--prompts", tmp_path / "bad.jsonl"]), 1, "bad.jsonl:2")
    clean_fail(run(["generate", "--checkpoint", run_dir, "--prompts", tmp_path / "p.jsonl", "--prompt", "x"]), 2,
               "not both")


def test_a_prompt_that_cannot_be_encoded_is_named_by_file_and_line_before_any_output(run_dir, tmp_path):
    from helpers import clean_fail
    (tmp_path / "p.txt").write_text("the cat\n\nthe ☃ dog\n")
    r = run(["generate", "--checkpoint", run_dir, "--prompts", tmp_path / "p.txt", "--max-new-tokens", 4, "--json"])
    clean_fail(r, 1, f"{tmp_path / 'p.txt'}:3: 1 character(s) not in this char tokenizer's vocabulary")
    assert r.stdout == ""                        # the first prompt was not sampled either
    (tmp_path / "p.jsonl").write_text('"the cat"\n{"prompt": "☃"}\n')
    clean_fail(run(["generate", "--checkpoint", run_dir, "--prompts", tmp_path / "p.jsonl", "--max-new-tokens", 4]),
               1, f"{tmp_path / 'p.jsonl'}:2:")
