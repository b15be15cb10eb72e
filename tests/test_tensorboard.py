"""tbp train --tensorboard: the same scalars as metrics.jsonl, in TensorBoard's event files."""
import builtins
import json
import struct

import pytest
from helpers import clean_fail, train_tiny

pytest.importorskip("tensorboardX", reason="the tensorboard extra is not installed: pip install -e '.[tensorboard]'")


def scalars(folder) -> dict:
    """{tag: {step: value}} from the event files: TFRecords (length, crc, Event, crc)."""
    from tensorboardX.proto.event_pb2 import Event
    out = {}
    for path in folder.glob("events.out.tfevents.*"):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + n])
            at += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def test_the_event_files_hold_the_metrics(tmp_path, corpus_file, monkeypatch):
    run = train_tiny(tmp_path, corpus_file, monkeypatch, "r", 10, "--tensorboard", tmp_path / "tb")
    got = scalars(tmp_path / "tb" / "r")                # a TensorBoard run per tbp run
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for m in lines:
        assert got["train_loss"][m["step"]] == pytest.approx(m["train_loss"], rel=1e-6)
    last = lines[-1]
    assert got["val_loss"][10] == pytest.approx(last["val_loss"], rel=1e-6)
    for group, value in last["layers"]["grad_norm"].items():
        assert got[f"grad_norm/{group}"][10] == pytest.approx(value, rel=1e-6)
    assert len([t for t in got if t.startswith("stream_rms/")]) == len(last["layers"]["stream_rms"])


def test_without_the_extra_one_line(tmp_path, corpus_file, monkeypatch):
    real = builtins.__import__

    def no_tensorboardx(name, *a, **kw):
        if name.startswith("tensorboardX"):
            raise ImportError(name)
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_tensorboardx)
    monkeypatch.chdir(tmp_path)
    from helpers import TINY, run
    r = run(["train", "--data", corpus_file, "--out", "r", "--max-iters", 2, *TINY, "--tensorboard", "tb"])
    clean_fail(r, 1, "pip install 'tbp[tensorboard]'")
    assert not (tmp_path / "r").exists()


def test_two_trainings_at_once_never_share_a_file_or_a_run(tmp_path, corpus_file, monkeypatch):
    """The second writer of a name takes NAME-2 while the first holds NAME; each folder holds
    one training's points only, and a resume continues its own folder in a file of its own."""
    from tbp.files.locks import RunLock
    monkeypatch.chdir(tmp_path)
    from helpers import TINY, run
    held = RunLock(tmp_path / "tb" / "r").acquire()     # a training named r writing there now
    try:
        r = run(["train", "--data", corpus_file, "--out", "x/r", "--max-iters", 5, *TINY, "--tensorboard", "tb"])
        assert r.exit_code == 0, r.output
    finally:
        held.release()
    assert not list((tmp_path / "tb" / "r").glob("events.*"))
    first = scalars(tmp_path / "tb" / "r-2")
    assert sorted(first["train_loss"]) == [1, 2, 3, 4, 5]
    r = run(["train", "--data", corpus_file, "--out", "y/r", "--max-iters", 5, *TINY, "--tensorboard", "tb"])
    assert r.exit_code == 0, r.output
    assert sorted(scalars(tmp_path / "tb" / "r")["train_loss"]) == [1, 2, 3, 4, 5]
    r = run(["train", "--out", "y/r", "--resume", "--max-iters", 10, "-q", "--tensorboard", "tb"])
    assert r.exit_code == 0, r.output
    assert len(list((tmp_path / "tb" / "r").glob("events.*"))) == 2
    assert sorted(scalars(tmp_path / "tb" / "r")["train_loss"]) == list(range(1, 11))
    assert sorted(scalars(tmp_path / "tb" / "r-2")["train_loss"]) == [1, 2, 3, 4, 5]


def test_a_refused_training_leaves_no_event_folder_and_tb_inside_the_run_is_refused(tmp_path, corpus_file,
                                                                                   monkeypatch):
    run_dir = train_tiny(tmp_path, corpus_file, monkeypatch, "r", 5)
    from helpers import TINY, run
    clean_fail(run(["train", "--data", corpus_file, "--out", "r", *TINY, "--tensorboard", "tb"]), 1, "already holds")
    assert not (tmp_path / "tb").exists()
    clean_fail(run(["train", "--data", corpus_file, "--out", "r2", *TINY, "--tensorboard", "r2"]), 2, "inside --out")
    clean_fail(run(["train", "--out", "r", "--resume", "--max-iters", 8, "-q", "--tensorboard", "r/tb"]), 2,
               "inside --out")
    assert not (run_dir / "tb").exists() and not (tmp_path / "r2").exists()


def test_tensorboard_at_the_runs_parent_is_refused_not_moved_aside(tmp_path, corpus_file, monkeypatch):
    """--out ck/r --tensorboard ck: the run's event folder would be the run itself."""
    monkeypatch.chdir(tmp_path)
    from helpers import TINY, run
    r = run(["train", "--data", corpus_file, "--out", "ck/r", "--max-iters", 3, *TINY, "--tensorboard", "ck"])
    clean_fail(r, 1, "would be the run folder itself")
    assert not (tmp_path / "ck" / "r-2").exists() and not (tmp_path / "ck" / "r").exists()
