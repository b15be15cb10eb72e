"""What tbp guarantees under faults: kills, full disks, damaged files, absurd sizes, two writers.

Each test is named after the promise it checks; the numbers refer to the list in
docs/reference/guarantees.md.
"""
import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY, clean_fail, run, tiny, train_tiny

from tbp.runs import commit, disk
from tbp.data import datasets
from tbp.generate.sampling import Sampling, generate_ids
from tbp.nn.gpt import GPT
from tbp.nn.config import ModelConfig


def _step(run_dir):
    return json.loads((Path(run_dir) / "state.json").read_text())["step"]


def _newest(run_dir, stem):
    """The newest file of a kind (model, optimizer, ...) in a run, whatever the naming."""
    return max(Path(run_dir).glob(f"{stem}*.safetensors"), key=lambda p: p.stat().st_mtime_ns)


def _weights_digest(run_dir):
    return sorted(disk.file_sha256(p) for p in Path(run_dir).glob("*.safetensors"))

# --- 1. a save is one commit ----------------------------------------------------------------


def _failing(real, when, err=errno.ENOSPC):
    """``real`` (a write function) that raises OSError(err) instead when ``when(path)``."""
    def write(path, *args, **kw):
        if when(Path(path)):
            raise OSError(err, os.strerror(err), str(path))
        return real(path, *args, **kw)
    return write


@pytest.mark.parametrize("target", ["state.json", "optimizer", "model"])
def test_a_full_disk_during_a_save_leaves_the_previous_checkpoint_resumable(
        tmp_path, corpus_file, monkeypatch, target):
    run_dir = train_tiny(tmp_path, corpus_file, monkeypatch, "r", 10)
    before = json.loads((run_dir / "state.json").read_text())
    if target == "state.json":
        monkeypatch.setattr(commit, "atomic_write_json",
                            _failing(commit.atomic_write_json, lambda p: p.name == "state.json"))
    else:
        monkeypatch.setattr(commit, "atomic_write_bytes",
                            _failing(commit.atomic_write_bytes, lambda p: p.name.startswith(target)))
    r = run(["train", "--out", run_dir, "--resume", "--max-iters", 15, "-q"])
    clean_fail(r, 1, "No space left on device")
    assert ".tmp" not in r.output                          # the file at fault, not a temporary one
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert json.loads((run_dir / "state.json").read_text()) == before
    r = run(["train", "--out", run_dir, "--resume", "--max-iters", 15, "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads((run_dir / "state.json").read_text())["step"] == 15
    assert not list(run_dir.glob(".*.tmp"))                # temporaries swept
    assert len(list(run_dir.glob("model-*.safetensors"))) == 1     # only the committed set is kept


class Crash(BaseException):
    """A process dying at this instant (nothing after it runs, as with kill -9)."""


def test_a_crash_before_any_file_operation_of_a_save_never_loses_the_run(tmp_path, corpus_file, monkeypatch):
    """Die just before the k-th rename, link or unlink of a save, for every k: the run resumes,
    from the step before or the step after, never from a mixture."""
    import shutil
    run_dir = train_tiny(tmp_path, corpus_file, monkeypatch, "r", 5)
    snapshot = tmp_path / "snapshot"
    shutil.copytree(run_dir, snapshot)
    real = {name: getattr(os, name) for name in ("replace", "link", "unlink", "rename")}
    k = 0
    while True:
        k += 1
        calls = [0]

        def dying(name):
            def op(*args, **kw):
                calls[0] += 1
                if calls[0] == k:
                    raise Crash
                return real[name](*args, **kw)
            return op
        for name in real:
            monkeypatch.setattr(os, name, dying(name))
        try:
            r = run(["train", "--out", run_dir, "--resume", "--max-iters", 10, "-q"], catch_exceptions=False)
            completed = True
        except Crash:
            completed = False
        for name, fn in real.items():
            monkeypatch.setattr(os, name, fn)
        assert _step(run_dir) in (5, 10)
        r = run(["train", "--out", run_dir, "--resume", "--max-iters", 10, "-q"])
        assert r.exit_code == 0, f"crash before file operation {k}: {r.output}"
        assert _step(run_dir) == 10
        if completed:
            break
        shutil.rmtree(run_dir)
        shutil.copytree(snapshot, run_dir)
    assert k > 3                                            # the save has several operations to cut


def _tbp(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "tbp", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, **kw)


def _progressed(proc, state: Path, past: int, limit_s: float = 300.0) -> None:
    """Wait until the run in ``proc`` has committed a step after ``past`` -- however slow or busy
    the machine -- failing only if it ends or makes no progress for ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
        try:
            if _step(state.parent) > past:
                return
        except (OSError, ValueError):            # not written yet
            pass
        time.sleep(0.01)
    raise AssertionError(f"no step committed past {past} in {limit_s:.0f} s")


def test_kill_9_at_random_moments_never_loses_the_run(tmp_path, corpus_file):
    """A run that saves at every step, killed (SIGKILL) at random instants, always resumes. Each
    kill comes a random moment after the run has committed a new step (never a fixed time after
    launch: a loaded machine may not have saved anything by then), so it lands among the next
    steps' saves."""
    rng = random.Random(4)
    args = ["--data", corpus_file, "--out", "r", "--max-iters", 10_000, *tiny(eval_interval=1, log_interval=1)]
    state = tmp_path / "r" / "state.json"
    steps = []
    for _ in range(6):
        resume = state.is_file()
        past = _step(tmp_path / "r") if resume else 0
        proc = _tbp("train", *(["--out", "r", "--resume", "-q"] if resume else args), cwd=tmp_path)
        try:
            _progressed(proc, state, past)
            time.sleep(rng.uniform(0.0, 0.3))         # a step of the tiny model takes milliseconds
        finally:
            proc.kill()
            proc.wait()
        if (tmp_path / "r" / "state.json").is_file():
            steps.append(_step(tmp_path / "r"))
    assert steps and steps == sorted(steps)                 # never back, never a damaged set
    final = max(steps) + 3
    r = subprocess.run([sys.executable, "-m", "tbp", "train", "--out", "r", "--resume", "--max-iters", str(final),
                        "-q"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _step(tmp_path / "r") == final


# --- 2. --force replaces only what tbp wrote -------------------------------------------------


def test_force_never_deletes_a_folder_of_the_users_own_files(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    for args in (["prepare", "--data", corpus_file], ["train", "--data", corpus_file, *TINY]):
        clean_fail(run([*args, "--out", mine, "--force"]), 1, "holds files tbp did not write (notes.txt)")
        assert (mine / "notes.txt").read_text() == "precious"


def test_force_never_replaces_the_commands_own_input(tmp_path, corpus_file, monkeypatch):
    base = train_tiny(tmp_path, corpus_file, monkeypatch, "base", 5)
    before = _weights_digest(base)
    clean_fail(run(["export", base, "--out", base, "--force"]), 1, "own input")
    assert run(["train", "--init-from", base, "--data", corpus_file, "--lora-rank", 2, "--out", "ft",
                "--max-iters", 5, *TINY]).exit_code == 0
    clean_fail(run(["merge", "ft", "--out", base, "--force"]), 1, "own input")
    clean_fail(run(["merge", "ft", "--out", "ft", "--force"]), 1, "own input")
    assert _weights_digest(base) == before
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text\n" * 50)
    clean_fail(run(["prepare", "--data", tmp_path / "texts", "--out", tmp_path / "texts", "--force"]), 1,
               "own input")
    assert (tmp_path / "texts" / "a.txt").is_file()


def test_force_replaces_what_tbp_wrote(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(["prepare", "--data", corpus_file, "--out", "ds"]).exit_code == 0
    assert run(["prepare", "--data", corpus_file, "--out", "ds", "--force", "--val-fraction", 0.2]).exit_code == 0
    assert json.loads((tmp_path / "ds" / "meta.json").read_text())["val_fraction"] == 0.2
    base = train_tiny(tmp_path, corpus_file, monkeypatch, "base", 5)
    for _ in range(2):
        assert run(["export", base, "--out", "hf", "--force"]).exit_code == 0


# --- 3. a damaged file is a user error ----------------------------------------------------------


@pytest.fixture
def trained(tmp_path, corpus_file, monkeypatch):
    return train_tiny(tmp_path, corpus_file, monkeypatch, "r", 10)


def _edit_json(path, fn):
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


@pytest.mark.parametrize("file,edit,msg", [
    ("state.json", lambda s: s.update(step="20"), "state.json: step must be an integer"),
    ("state.json", lambda s: s["data_rng"].pop("state"), "data_rng is not a generator state"),
    ("state.json", lambda s: s.update(files=[1]), "state.json: files must be a JSON object"),
    ("config.json", lambda c: c.pop("data"), "names no dataset; pass --data"),
    ("config.json", lambda c: c.update(model=[]), "config.json: model must be an object"),
    ("config.json", lambda c: c["model"].update(n_layer="2"), "n_layer must be an integer"),
    ("config.json", lambda c: c["train"].update(lr=-1), "bad training config"),
])
def test_a_damaged_run_file_is_one_line_naming_file_and_field(trained, file, edit, msg):
    _edit_json(trained / file, edit)
    clean_fail(run(["train", "--out", trained, "--resume", "--max-iters", 12, "-q"]), 1, msg)


def test_info_and_generate_refuse_damaged_files_in_one_line(trained):
    with open(trained / "metrics.jsonl", "a") as f:
        f.write("[1, 2]\n\"text\"\n{\"no step\": 1}\n")
    assert run(["info", trained]).exit_code == 0            # a log with junk lines still reads
    _edit_json(trained / "state.json", lambda s: s.update(step=None))
    clean_fail(run(["info", trained]), 1, "state.json: step must be an integer")
    clean_fail(run(["generate", "--checkpoint", trained]), 1, "state.json: step must be an integer")


@pytest.mark.parametrize("edit,msg", [
    (lambda m: m.pop("val_bytes"), "meta.json: missing field 'val_bytes'"),
    (lambda m: m.update(dtype="float13"), "is not a token dtype"),
    (lambda m: m.update(train_tokens="many"), "train_tokens must be an integer"),
])
def test_a_damaged_dataset_is_refused_at_load(tmp_path, corpus_file, monkeypatch, edit, msg):
    monkeypatch.chdir(tmp_path)
    assert run(["prepare", "--data", corpus_file, "--out", "ds"]).exit_code == 0
    _edit_json(tmp_path / "ds" / "meta.json", edit)
    clean_fail(run(["train", "--data", "ds", "--out", "r", *TINY]), 1, msg)
    assert not (tmp_path / "r").exists()


def test_a_config_file_that_is_not_an_object_is_a_usage_error(tmp_path):
    (tmp_path / "c.json").write_text("[1, 2]")
    clean_fail(run(["train", "--config", tmp_path / "c.json"]), 2, "expected a JSON object")


# --- 4. everything validated at load ------------------------------------------------------------


def test_a_token_id_outside_the_vocabulary_is_named_at_load(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(["prepare", "--data", corpus_file, "--out", "ds"]).exit_code == 0
    ids = np.fromfile(tmp_path / "ds" / "train.bin", dtype=np.uint16)
    ids[1234] = 60000
    ids.tofile(tmp_path / "ds" / "train.bin")
    clean_fail(run(["train", "--data", "ds", "--out", "r", *TINY]), 1,
               "train.bin: token id 60000 at position 1234 is outside the vocabulary")


def test_a_token_file_of_a_torn_size_is_named(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(["prepare", "--data", corpus_file, "--out", "ds"]).exit_code == 0
    with open(tmp_path / "ds" / "val.bin", "ab") as f:
        f.write(b"\x01")
    clean_fail(run(["train", "--data", "ds", "--out", "r", *TINY]), 1, "val.bin: 6721 bytes is not a whole number")


def test_moments_of_the_wrong_shape_are_refused_not_broadcast(trained):
    opt = _newest(trained, "optimizer")
    arrays, meta = disk.read_arrays(opt)
    arrays["m.ln_f.weight"] = np.zeros((1,), np.float32)       # broadcastable to (16,), still wrong
    commit.write_arrays(opt, arrays, int(meta["step"]), "optimizer")
    clean_fail(run(["train", "--out", trained, "--resume", "--max-iters", 12, "-q"]), 1,
               "m.ln_f.weight has shape (1,), the model needs (16,)")


@pytest.mark.parametrize("value, msg", [(np.nan, "v.ln_f.weight holds non-finite values"),
                                        (-1.0, "v.ln_f.weight holds negative second moments")])
def test_moments_that_cannot_be_are_refused_on_resume(trained, value, msg):
    opt = _newest(trained, "optimizer")
    arrays, meta = disk.read_arrays(opt)
    arrays["v.ln_f.weight"][3] = value
    commit.write_arrays(opt, arrays, int(meta["step"]), "optimizer")
    clean_fail(run(["train", "--out", trained, "--resume", "--max-iters", 12, "-q"]), 1, msg)


@pytest.mark.parametrize("dtype", [np.float16, np.int32])
def test_weights_of_another_dtype_are_one_line_for_every_reader(trained, tmp_path, dtype):
    weights = _newest(trained, "model")
    arrays, meta = disk.read_arrays(weights)
    commit.write_arrays(weights, {k: a.astype(dtype) for k, a in arrays.items()}, int(meta["step"]), "model")
    msg = f"holds {np.dtype(dtype).name} tensors"
    for args in (["generate", "--checkpoint", trained, "--max-new-tokens", 3], ["export", trained, "--out", tmp_path / "hf"],
                 ["eval", "--checkpoint", trained], ["train", "--out", trained, "--resume", "--max-iters", 12, "-q"]):
        clean_fail(run(args), 1, msg)


def test_a_lora_record_without_its_base_is_one_line(trained):
    cfg = json.loads((trained / "config.json").read_text())
    (trained / "config.json").write_text(json.dumps({**cfg, "lora": {"rank": 2, "alpha": 2.0, "targets": ["c_attn"]},
                                                     "base": None}))
    clean_fail(run(["generate", "--checkpoint", trained, "--max-new-tokens", 3]), 1, "needs its base recorded")


def test_a_swapped_tokenizer_is_refused_on_resume(trained, tmp_path):
    datasets.prepare("other letters entirely QXZ\n" * 50, "o", "test", tmp_path / "other")
    (trained / "tokenizer.json").write_text((tmp_path / "other" / "tokenizer.json").read_text())
    clean_fail(run(["train", "--out", trained, "--resume", "--max-iters", 12, "-q"]), 1,
               "tokenizer.json: differs from the tokenizer this run was trained with")


# --- 5. sizes checked before anything is allocated ------------------------------------------


@pytest.mark.parametrize("n_layer,msg", [(100000, "bad model config (n_layer must be <= 96, got 100000)"),
                                         (96, "tensor names do not match the model (missing ['h.1.ln_1.weight'")])
def test_a_config_asking_for_absurd_depth_is_refused_before_building(trained, corpus_file, n_layer, msg):
    _edit_json(trained / "config.json", lambda c: c["model"].update(n_layer=n_layer, d_model=16384, n_head=128))
    t = time.perf_counter()
    for cmd in (["generate", "--checkpoint", trained, "--max-new-tokens", 2],
                ["train", "--init-from", trained, "--data", corpus_file, "--out", "ft", "--max-iters", 1, "-q"],
                ["train", "--out", trained, "--resume", "-q"]):
        clean_fail(run(cmd), 1, msg)
    assert time.perf_counter() - t < 10                     # measured, not allocated


def test_a_model_beyond_memory_is_refused_up_front(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clean_fail(run(["train", "--data", corpus_file, "--n-layer", 96, "--n-head", 128, "--d-model", 16384, "-q"]), 1,
               "GiB of memory")
    assert not (tmp_path / "checkpoints").exists()


def test_a_huge_max_new_tokens_allocates_nothing_in_advance():
    model = GPT(ModelConfig(vocab_size=11, n_ctx=8, n_layer=1, n_head=2, d_model=8))
    gen = generate_ids(model, [1, 2], 10 ** 12, Sampling(1.0), np.random.default_rng(0))
    tokens = [next(gen) for _ in range(20)]                 # past the context: the window slides
    assert len(tokens) == 20


def test_an_import_whose_config_contradicts_its_weights_is_refused_before_building(tmp_path):
    from tbp.interop.hf import export_hf
    from tbp.data.tokenizer import train_char
    tok = train_char("abcdefghij\n")
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, n_ctx=8, n_layer=1, n_head=2, d_model=8))
    export_hf(model, tok, tmp_path / "hf")
    _edit_json(tmp_path / "hf" / "config.json", lambda c: c.update(n_embd=16384, n_head=128, n_layer=96))
    clean_fail(run(["import", tmp_path / "hf", "--out", tmp_path / "imp"]), 1, "but config.json implies")


# --- 6. a failed command changes nothing ------------------------------------------------------


def test_a_run_that_fails_before_its_first_save_leaves_nothing(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run(["train", "--data", corpus_file, "--out", "r", "--lr", 1e4, "--grad-clip", 0, "--max-iters", 30,
             *tiny(eval_interval=50)])
    clean_fail(r, 1, "is nan")
    assert not (tmp_path / "r").exists()
    assert run(["train", "--data", corpus_file, "--out", "r", "--max-iters", 5, *TINY]).exit_code == 0


def test_a_run_killed_before_its_first_commit_does_not_block_the_retry(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(commit, "atomic_write_json",
                        _failing(commit.atomic_write_json, lambda p: p.name == "state.json"))
    clean_fail(run(["train", "--data", corpus_file, "--out", "r", "--max-iters", 5, *TINY]), 1, "No space left")
    assert (tmp_path / "r" / "config.json").is_file() and not (tmp_path / "r" / "state.json").exists()
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    clean_fail(run(["train", "--out", "r", "--resume", "-q"]), 1, "no checkpoint to resume from")
    assert run(["train", "--data", corpus_file, "--out", "r", "--max-iters", 5, *TINY]).exit_code == 0


def test_a_failed_resume_rewrites_nothing(trained, tmp_path):
    before = {p.name: p.read_bytes() for p in trained.iterdir() if p.is_file()}
    (tmp_path / "short.txt").write_text("the cat\n")          # encodable, but shorter than one block
    clean_fail(run(["train", "--out", trained, "--resume", "--data", tmp_path / "short.txt", "--max-iters", 12,
                    "-q"]), 1, "fewer than one block")
    (tmp_path / "other.txt").write_text("Zebra ζ\n" * 100)
    clean_fail(run(["train", "--out", trained, "--resume", "--data", tmp_path / "other.txt", "--max-iters", 12,
                    "-q"]), 1, "not in this char tokenizer's vocabulary")
    clean_fail(run(["train", "--out", trained, "--resume", "--min-lr", 1, "-q"]), 2, "must not exceed lr")
    assert {p.name: p.read_bytes() for p in trained.iterdir() if p.is_file()} == before
    assert run(["train", "--out", trained, "--resume", "--max-iters", 12, "-q"]).exit_code == 0


# --- 7. a run knows its data ------------------------------------------------------------------


def test_two_corpora_with_one_file_name_never_share_a_dataset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for d, words in (("A", "the cat sat on the mat\n"), ("B", "a dog ate a log\n")):
        (tmp_path / d).mkdir()
        (tmp_path / d / "input.txt").write_text(words * 400)
    assert run(["train", "--data", "A/input.txt", "--out", "ra", "--max-iters", 5, *TINY]).exit_code == 0
    assert run(["train", "--data", "B/input.txt", "--out", "rb", "--max-iters", 5, *TINY]).exit_code == 0
    data_a = json.loads((tmp_path / "ra" / "config.json").read_text())["data"]
    data_b = json.loads((tmp_path / "rb" / "config.json").read_text())["data"]
    assert data_a != data_b
    assert "cat" in datasets.Dataset.load(data_a).tokenizer.decode(datasets.Dataset.load(data_a).train[:40])
    assert run(["train", "--out", "ra", "--resume", "--max-iters", 8, "-q"]).exit_code == 0


def test_a_run_refuses_its_dataset_prepared_again_from_other_text(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "input.txt").write_text("the cat sat on the mat\n" * 400)
    assert run(["train", "--data", "input.txt", "--out", "r", "--max-iters", 5, *TINY]).exit_code == 0
    (tmp_path / "input.txt").write_text("the mat sat on the cat\n" * 400)
    assert run(["prepare", "--data", "input.txt", "--out", "data/input", "--force"]).exit_code == 0
    clean_fail(run(["train", "--out", "r", "--resume", "--max-iters", 8, "-q"]), 1,
               "was prepared again from other text")


# --- 8. one writer per run -----------------------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_holder(trained, corpus_file):
    from tbp.files.locks import RunLock
    lock = RunLock(trained).acquire()
    try:
        clean_fail(run(["train", "--out", trained, "--resume", "--max-iters", 12, "-q"]), 1,
                   f"another tbp process (pid {os.getpid()}) is writing this run")
        clean_fail(run(["train", "--data", corpus_file, "--out", trained, "--force", *TINY]), 1, "another tbp process")
    finally:
        lock.release()
    assert run(["train", "--out", trained, "--resume", "--max-iters", 12, "-q"]).exit_code == 0


# --- 9. SIGTERM saves and stops ------------------------------------------------------------------


def test_sigterm_finishes_the_step_saves_and_exits_143(tmp_path, corpus_file):
    proc = _tbp("train", "--data", corpus_file, "--out", "r", "--max-iters", 100_000,
                *tiny(eval_interval=50), cwd=tmp_path)
    deadline = time.time() + 60
    while not (tmp_path / "r" / "state.json").is_file() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert b"SIGTERM" in err and b"Traceback" not in err
    step = _step(tmp_path / "r")
    assert step > 50 and step % 50 != 0 or step >= 50      # saved at the stop, not only at evals
    r = subprocess.run([sys.executable, "-m", "tbp", "train", "--out", "r", "--resume", "--max-iters",
                        str(step + 2), "-q"], cwd=tmp_path, capture_output=True)
    assert r.returncode == 0, r.stderr


# --- 10. usage errors exit 2 -------------------------------------------------------------------


@pytest.mark.parametrize("args,msg", [
    (["train", "--n-head", 3, "--d-model", 32], "divisible"),
    (["train", "--lr", "nan"], "not a finite number"),
    (["train", "--warmup", -1], "--warmup"),
    (["bench", "--d-model", 3, "--n-head", 2], "divisible"),
    (["generate", "--top-p", "inf"], "--top-p"),
    (["generate", "--temperature", "nan"], "not a finite number"),
])
def test_a_bad_option_value_exits_2(tmp_path, monkeypatch, args, msg):
    monkeypatch.chdir(tmp_path)
    clean_fail(run(args), 2, msg)


@pytest.mark.parametrize("args,msg", [
    (["--lora-rank", 999], "LoRA rank must be in [1, 16]"),
    (["--lora-rank", 2, "--lora-targets", "attn,conv"], "unknown LoRA target 'conv'"),
    (["--lora-rank", 2, "--n-layer", 3], "--n-layer 3 differs from the base run"),
])
def test_a_bad_lora_request_exits_2_before_any_work(trained, corpus_file, args, msg):
    clean_fail(run(["train", "--init-from", trained, "--data", corpus_file, "--out", "ft", "-q", *args]), 2, msg)


# --- 11. every error line names the file or value at fault ---------------------------------------


def test_a_file_size_limit_names_the_file(trained, monkeypatch):
    monkeypatch.setattr(commit, "atomic_write_bytes",
                        _failing(commit.atomic_write_bytes, lambda p: p.name.startswith("model-"), errno.EFBIG))
    r = run(["train", "--out", trained, "--resume", "--max-iters", 15, "-q"])
    clean_fail(r, 1, "model-000015.safetensors: File too large")


def test_a_run_of_the_first_release_resumes_and_keeps_its_best_weights(trained):
    """Runs saved as model.safetensors / best-model.safetensors / optimizer.safetensors (no
    "files" in state.json) load, resume, and keep their best weights until a better eval."""
    files = disk.checkpoint_files(trained)
    state = json.loads((trained / "state.json").read_text())
    for key, legacy in (("weights", "model.safetensors"), ("best", "best-model.safetensors"),
                        ("optimizer", "optimizer.safetensors")):
        files[key].rename(trained / legacy)
    state.pop("files")
    state["best_val_loss"] = -1.0                           # no later eval can beat it
    (trained / "state.json").write_text(json.dumps(state))
    best = (trained / "best-model.safetensors").read_bytes()
    assert run(["generate", "--checkpoint", trained, "--max-new-tokens", 3]).exit_code == 0
    r = run(["train", "--out", trained, "--resume", "--max-iters", 15, "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads((trained / "state.json").read_text())["files"]["best"] == "best-model.safetensors"
    assert (trained / "best-model.safetensors").read_bytes() == best
    assert not (trained / "model.safetensors").exists() and (trained / "model-000015.safetensors").is_file()


# --- every command that replaces a run holds its lock ------------------------------------------


def test_merge_and_import_force_never_replace_a_run_being_trained(tmp_path, corpus_file, monkeypatch):
    from tbp.files.locks import RunLock
    base = train_tiny(tmp_path, corpus_file, monkeypatch, "base", 5, "--n-ctx", 16)
    assert run(["train", "--data", corpus_file, "--init-from", base, "--out", "ft", "--lora-rank", 2,
                "--max-iters", 5, *TINY]).exit_code == 0
    assert run(["export", base, "--out", "hf"]).exit_code == 0
    victim = train_tiny(tmp_path, corpus_file, monkeypatch, "victim", 5)
    before = {p.name: p.read_bytes() for p in victim.iterdir() if p.is_file()}
    lock = RunLock(victim).acquire()                # as a live tbp train holds it
    try:
        for args in (["merge", "ft", "--out", victim, "--force"], ["import", "hf", "--out", victim, "--force"]):
            clean_fail(run(args), 1, f"another tbp process (pid {os.getpid()}) is writing this run")
            assert {p.name: p.read_bytes() for p in victim.iterdir() if p.is_file()} == before
    finally:
        lock.release()
    r = run(["merge", "ft", "--out", victim, "--force"])
    assert r.exit_code == 0, r.output
    assert json.loads((victim / "config.json").read_text())["merged_from"]
    assert not (victim / ".lock").exists()          # the replacement is whole; no lock left in it
    r = run(["import", "hf", "--out", victim, "--force"])
    assert r.exit_code == 0, r.output
    assert json.loads((victim / "config.json").read_text())["imported_from"]


def test_a_failed_forced_replacement_leaves_no_lock_of_its_own(tmp_path, corpus_file, monkeypatch):
    """--force over a run with no lock file (copied from elsewhere): the command takes the lock
    (making the file), fails inside the staged write, and takes its lock file away again."""
    victim = train_tiny(tmp_path, corpus_file, monkeypatch, "victim", 5)
    assert run(["export", victim, "--out", "hf"]).exit_code == 0
    (victim / ".lock").unlink()
    before = {p.name: p.read_bytes() for p in victim.iterdir()}

    def full(*a, **kw):                             # the disk fills while the new run is written
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(a[0]))
    monkeypatch.setattr(commit, "write_run_header", full)
    clean_fail(run(["import", "hf", "--out", victim, "--force"]), 1, "No space left")
    assert {p.name: p.read_bytes() for p in victim.iterdir()} == before


def test_weights_that_overflow_are_named_not_sampled_or_averaged(trained):
    """Finite weights whose forward overflows float32: generate and eval say so (exit 1), never
    sample from NaN logits or print NaN as JSON."""
    weights = _newest(trained, "model")
    arrays, meta = disk.read_arrays(weights)
    arrays["ln_f.weight"] = arrays["ln_f.weight"] * np.float32(3e38) / np.abs(arrays["ln_f.weight"]).max()
    arrays["wte"] = arrays["wte"] * np.float32(1e3)
    commit.write_arrays(weights, arrays, int(meta["step"]), "model")
    clean_fail(run(["generate", "--checkpoint", trained, "--max-new-tokens", 3]), 1, "overflows float32")
    r = run(["eval", "--checkpoint", trained, "--json"])
    clean_fail(r, 1, "overflows float32")
    assert "NaN" not in r.stdout


@pytest.mark.parametrize("flags", [["--shard-optimizer"], ["--overlap"], ["--shard-optimizer", "--overlap"]])
def test_mpi_options_without_mpiexec_are_a_usage_error_not_ignored(tmp_path, corpus_file, monkeypatch, flags):
    monkeypatch.chdir(tmp_path)
    clean_fail(run(["train", "--data", corpus_file, "--out", "r", *TINY, *flags]), 2, "under mpiexec")
    assert not (tmp_path / "r").exists()


def test_a_pipe_is_read_once_and_a_device_is_refused(tmp_path, corpus_file, monkeypatch):
    """A named pipe (or a shell's <(...)) is copied once, like stdin, and the copy removed; a
    device such as /dev/zero is refused at once instead of read forever."""
    import threading
    monkeypatch.chdir(tmp_path)
    fifo = tmp_path / "notes"
    os.mkfifo(fifo)
    text = Path(corpus_file).read_text()
    writer = threading.Thread(target=lambda: fifo.write_text(text))
    writer.start()
    r = run(["prepare", "--data", fifo, "--out", "d"])
    writer.join()
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["source"] == str(fifo)
    assert not list(tmp_path.glob(".stdin.*")) and not list((tmp_path / "d").glob(".stdin.*"))
    if os.path.exists("/dev/zero"):
        clean_fail(run(["prepare", "--data", "/dev/zero", "--out", "z"]), 1, "is a device or a socket")
        assert not (tmp_path / "z").exists()


def test_a_stream_copy_left_by_a_killed_writer_is_swept(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    from tbp.data.corpus import _spool_prefix
    host = _spool_prefix().rsplit("-", 1)[0]                 # .stdin.HOST
    left = tmp_path / f"{host}-{dead}.abcd1234.tmp"          # as a writer killed mid-copy leaves it
    left.write_bytes(b"x" * 100)
    mine = tmp_path / f"{host}-{os.getpid()}.live0000.tmp"   # a live process's copy stays
    mine.write_bytes(b"y")
    other = tmp_path / f".stdin.otherhost-{dead}.abcd1234.tmp"   # another machine's: not ours to judge
    other.write_bytes(b"z")
    r = run(["prepare", "--data", "-", "--out", "d"], input=Path(corpus_file).read_text())
    assert r.exit_code == 0, r.output
    assert not left.exists() and mine.exists() and other.exists()


def test_one_huge_json_record_is_refused_in_bounded_memory(tmp_path, monkeypatch):
    """A compressed JSON-lines file whose one record unpacks to far more text than a record may
    hold: refused naming the line, without holding it (the limit lowered so the test is small)."""
    import gzip
    import tracemalloc
    from tbp.data import corpus
    monkeypatch.setattr(corpus, "MAX_RECORD", 1 << 20)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "bomb.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write('{"text": "fine"}\n{"text": "' + "a" * (40 << 20) + '"}\n')
    assert path.stat().st_size < 100_000
    tracemalloc.start()
    clean_fail(run(["prepare", "--data", path, "--out", "d"]), 1, "bomb.jsonl.gz:2: a record longer than 1 Mi")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20, peak                 # not the 40 Mi-character record, nor its parse


def test_too_little_text_leaves_no_dataset_with_an_empty_split(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "one.txt").write_text("a")
    clean_fail(run(["train", "--data", "one.txt", "--out", "r", *TINY]), 1, "one.txt: too little text")
    clean_fail(run(["prepare", "--data", "one.txt", "--out", "d"]), 1, "too little text")
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())
    assert not (tmp_path / "d").exists() and not (tmp_path / "r").exists()


def test_an_input_deleted_mid_prepare_is_named_not_the_output(tmp_path, corpus_file, monkeypatch):
    from tbp.data import texts
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "notes.txt"
    src.write_text(Path(corpus_file).read_text())
    real = texts._encode

    def encode(corpus, *a, **kw):                 # the file vanishes between the reading passes
        src.unlink()
        return real(corpus, *a, **kw)
    monkeypatch.setattr(texts, "_encode", encode)
    r = run(["prepare", "--data", src, "--out", "d"])
    clean_fail(r, 1, str(src))
    assert "d: " not in r.output.replace(str(src), "") and not (tmp_path / "d").exists()


def test_preparing_into_a_folder_that_cannot_be_written_names_that_folder(tmp_path, corpus_file, monkeypatch):
    import tempfile as tf
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ro").mkdir()

    def refused(dir=None, prefix=None, suffix=None):   # as a read-only folder answers (root bypasses chmod)
        raise PermissionError(13, "Permission denied", os.path.join(dir, f"{prefix}x1y2{suffix}"))
    monkeypatch.setattr(tf, "mkdtemp", refused)
    r = run(["prepare", "--data", corpus_file, "--out", "ro/d"])
    clean_fail(r, 1, "ro: cannot write here (Permission denied)")
    assert ".tmp" not in r.output and ".new" not in r.output and "x1y2" not in r.output


@pytest.mark.parametrize("edit, msg", [(lambda m: {**m, "dtype": "float32"}, "is not a token dtype"),
                                       (lambda m: {**m, "vocab_size": m["vocab_size"] + 7}, "meta.json says")])
def test_info_refuses_a_crafted_dataset_as_training_does(tmp_path, corpus_file, monkeypatch, edit, msg):
    monkeypatch.chdir(tmp_path)
    assert run(["prepare", "--data", corpus_file, "--out", "d"]).exit_code == 0
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    (tmp_path / "d" / "meta.json").write_text(json.dumps(edit(meta)))
    clean_fail(run(["train", "--data", "d", "--out", "r", *TINY]), 1, msg)
    clean_fail(run(["info", "d"]), 1, msg)
    clean_fail(run(["info", "d", "--json"]), 1, msg)


def test_identical_runs_write_identical_checkpoint_bytes_and_old_files_still_read(tmp_path, corpus_file,
                                                                                  monkeypatch):
    """Weights and moments depend on the run alone (safetensors' several metadata keys came out in
    a hash map's order); metrics and state differ only by their wall-clock fields."""
    from safetensors.numpy import save as st_save
    a = train_tiny(tmp_path, corpus_file, monkeypatch, "a", 5, "--threads", 1)
    b = train_tiny(tmp_path, corpus_file, monkeypatch, "b", 5, "--threads", 1)
    names = sorted(p.name for p in a.glob("*.safetensors"))
    assert names and names == sorted(p.name for p in b.glob("*.safetensors"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    old = tmp_path / "old.safetensors"                          # an earlier release's metadata
    old.write_bytes(st_save({"x": np.ones(3, np.float32)}, metadata={"format": "tbp-1", "kind": "weights", "step": "7"}))
    assert disk.read_arrays(old)[1]["step"] == "7"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(st_save({"x": np.ones(3, np.float32)}, metadata={"tbp": "[1, 2]"}))
    with pytest.raises(Exception, match="damaged metadata"):
        disk.read_arrays(bad)
