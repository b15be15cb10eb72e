"""tbp deletes only names it wrote, per path component; a temporary file left by a killed writer
is swept by the next writer of the same file, and only then."""
import os
import signal
import subprocess
import sys

import pytest
from helpers import clean_fail, run, tiny

from tbp.files.atomic import TMP_MARK, atomic_file, foreign_files, sweep_stale
from tbp.runs import disk


@pytest.mark.parametrize("planted", [".notes.tmp/a.txt", ".notes.tmp/.x.tmp", ".a.tmp/b/model.safetensors",
                                     "sub/config.json", "config.json.d/state.json"])
def test_a_users_folder_inside_a_run_is_never_taken_for_tbps(tmp_path, corpus_file, planted):
    r = run(["train", "--data", corpus_file, "--out", tmp_path / "r", "--max-iters", 2, *tiny()])
    assert r.exit_code == 0, r.output
    mine = tmp_path / "r" / planted
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text("keep me")
    assert foreign_files(tmp_path / "r", disk.RUN_FILES)
    clean_fail(run(["runs", "rm", tmp_path / "r", "--yes"]), 1, "did not write")
    clean_fail(run(["train", "--data", corpus_file, "--out", tmp_path / "r", "--max-iters", 2, "--force", *tiny()]),
               1, "did not write")
    assert mine.read_text() == "keep me"


def test_a_folder_with_tbps_names_alone_is_tbps(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / f".model.safetensors.{TMP_MARK}abcdefgh.tmp").write_text("")
    assert foreign_files(tmp_path, disk.RUN_FILES) == []


WRITER = """
import sys, time
from tbp.files.atomic import atomic_file
with atomic_file(sys.argv[1]) as tmp:
    open(tmp, "wb").write(b"x" * 100000)
    print("writing", flush=True)
    time.sleep(120)
"""


def _writer(path):
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    return p


def _temporaries(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))


def test_a_killed_writers_temporary_is_swept_by_the_next_writer_a_live_ones_is_not(tmp_path):
    target = tmp_path / "m.gguf"
    live, dead = _writer(target), _writer(target)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    users = tmp_path / ".m.gguf.userfile.tmp"            # a name of the user's, near tbp's
    users.write_text("mine")
    assert len(_temporaries(tmp_path)) == 3
    try:
        with atomic_file(target) as tmp:
            tmp.write_bytes(b"new")
        left = _temporaries(tmp_path)
        assert users.name in left and len(left) == 2        # the live writer's and the user's
    finally:
        live.kill()
        live.wait()
    sweep_stale(target)
    assert _temporaries(tmp_path) == [users.name] and target.read_bytes() == b"new"


def test_an_export_sweeps_what_a_killed_export_left(tmp_path, corpus_file):
    pytest.importorskip("gguf", reason="the gguf extra: pip install -e '.[test-all]'")
    r = run(["train", "--data", corpus_file, "--out", tmp_path / "r", "--max-iters", 2, *tiny(), "--no-bias"])
    assert r.exit_code == 0, r.output
    stale = tmp_path / f".m.gguf.{TMP_MARK}k1ll3d00.tmp"
    stale.write_bytes(b"\0" * 1_000_000)                # as a kill -9 mid-export leaves it: no writer holds it
    r = run(["export", "--checkpoint", tmp_path / "r", "--format", "gguf", "--out", tmp_path / "m.gguf"])
    assert r.exit_code == 0, r.output
    assert not stale.exists() and (tmp_path / "m.gguf").stat().st_size > 0


def test_a_full_disk_while_appending_names_the_file(tmp_path, monkeypatch):
    import errno
    from tbp.files.atomic import append_line

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        append_line(tmp_path / "metrics.jsonl", "{}")
    assert e.value.filename == str(tmp_path / "metrics.jsonl") and e.value.errno == errno.ENOSPC
