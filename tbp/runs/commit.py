"""Checkpoints: written safely (no pickle, ever) and committed atomically as a whole.

A save is one commit: the step-stamped files are written first (each atomically), then
``state.json``, which names them, is renamed into place; only then are the previous set's
files removed. A crash or a full disk at any instant leaves ``state.json`` naming a complete
earlier set, so ``--resume`` always finds a whole checkpoint. Each weight file also records
its step in the safetensors metadata, so a resume can prove the set belongs together. What a
run directory holds, and reading it validated, is disk.py's.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save as st_save

from ..errors import TbpError
from ..files.atomic import (atomic_write_bytes, atomic_write_json, atomic_write_text, claim_output,
                            link_or_copy, sweep_temporaries)
from ..files.locks import RunLock
from .disk import FORMAT, RUN_FILES, checkpoint_files, is_checkpoint_file, read_state, weights_name
from ..files.staging import staged_dir
from ..data.tokenizer import Tokenizer


def write_arrays(path: str | Path, arrays: dict[str, np.ndarray], step: int, role: str) -> None:
    """A safetensors file of ``arrays``, its metadata (format, ``role`` as "kind", step) as one key: safetensors
    writes several keys in a hash map's order, which differs from run to run, so two identical
    runs would write different bytes; one key holding sorted JSON makes the bytes the run's alone."""
    meta = json.dumps({"format": f"tbp-{FORMAT}", "kind": role, "step": str(step)}, sort_keys=True)
    data = st_save({k: np.ascontiguousarray(v) for k, v in arrays.items()}, metadata={"tbp": meta})
    atomic_write_bytes(path, data)


def write_run_header(run: Path, config: dict, tokenizer: Tokenizer) -> None:
    run.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run / "config.json", {"format": FORMAT, **config})
    atomic_write_text(run / "tokenizer.json", tokenizer.to_str())


def save(run: Path, model, optimizer, state: dict, adapter: bool, best: bool) -> None:
    """Commit one checkpoint: step-stamped weights (and best weights, a hard link to the same
    bytes) and moments, then state.json naming them, then remove the previous set.

    ``optimizer`` None writes a checkpoint that loads but does not resume (merge, import).
    """
    run = Path(run)
    step = state["step"]
    before = {}                            # the committed set: its best file is kept until a better one
    if (run / "state.json").is_file():
        with contextlib.suppress(TbpError):
            before = {k: p.name for k, p in checkpoint_files(run).items() if p is not None}
    files = {"weights": weights_name(adapter, step=step), "best": before.get("best"), "optimizer": None}
    if best:
        files["best"] = weights_name(adapter, best=True, step=step)
    if optimizer is not None:
        files["optimizer"] = f"optimizer-{step:06d}.safetensors"
    try:
        write_arrays(run / files["weights"], model.layout.views(model.layout.params), step, "weights")
        if best:
            link_or_copy(run / files["weights"], run / files["best"])
        if optimizer is not None:
            write_arrays(run / files["optimizer"], optimizer.state_arrays(), step, "optimizer")
        atomic_write_json(run / "state.json", {**state, "files": files})        # the commit
    except BaseException:
        # a failed commit (a full disk) takes back the files it wrote, so a retry finds the room;
        # unless it did commit (interrupted just after the rename): then they are the checkpoint
        now = None
        with contextlib.suppress(Exception):
            now = {k: p.name if p is not None else None for k, p in checkpoint_files(run).items()}
        if now != files:
            _remove(run, set(files.values()) - set(before.values()))
        raise
    sweep_unreferenced(run, files)


def write_state(run: Path, state: dict) -> None:
    """Replace the committed state.json's fields with ``state``, keeping the files it names (a
    note about the committed step, such as why training stopped there)."""
    run = Path(run)
    files = read_state(run).get("files")
    atomic_write_json(run / "state.json", {**state, **({"files": files} if files else {})})


def _remove(run: Path, names) -> None:
    for name in names:
        if name:
            with contextlib.suppress(OSError):
                (run / name).unlink()


def sweep_unreferenced(run: Path, files: dict) -> None:
    """Remove the checkpoint files ``files`` (the committed set) does not name -- the previous
    set, or what a commit killed half-way wrote -- and killed writers' temporaries. Only names
    tbp writes (:func:`is_checkpoint_file`) are ever removed: a user's own copy stays."""
    keep = set(files.values())
    _remove(run, [p.name for p in Path(run).iterdir() if p.name not in keep and is_checkpoint_file(p.name)
                  and p.is_file()])
    sweep_temporaries(run)


def claim_run_output(out: Path, force: bool, inputs: tuple = ()) -> None:
    """--out for a command that writes a run (merge, import): new, or --force over a tbp run
    that is none of the command's inputs and that no live tbp process is writing (its lock is
    tried, and let go: :func:`holding_run` holds it for the replacement itself)."""
    claim_output(out, force, RUN_FILES, "config.json", "a tbp run", inputs)
    if Path(out).is_dir():                     # refused at once if a training holds it
        lock = RunLock(out).acquire()
        if lock.made_lock:
            with contextlib.suppress(OSError):
                (Path(out) / RunLock.NAME).unlink()
        lock.release()


@contextlib.contextmanager
def holding_run(out: Path):
    """The run lock of an existing folder ``out``, held for the block: a training writing ``out``
    refuses the command (one line naming its pid), and no training can start on ``out`` until
    the block ends. A lock file this took for a folder that then stays (the command failed)
    is taken away again; a new ``out`` needs no lock (the staged folder appears whole)."""
    out = Path(out)
    if not out.is_dir():
        yield
        return
    lock = RunLock(out).acquire()
    try:
        yield
    except BaseException:
        if lock.made_lock:                     # failed: out is still the folder the lock was made in
            with contextlib.suppress(OSError):
                (out / RunLock.NAME).unlink()
        raise
    finally:
        lock.release()


def save_plain(out: Path, model, tokenizer: Tokenizer, record: dict, force: bool = False,
               inputs: tuple = ()) -> None:
    """A stand-alone checkpoint (config, tokenizer, weights), written as one atomic folder,
    replacing (with ``force``) a run only while holding its lock."""
    claim_run_output(out, force, inputs)
    with holding_run(out), staged_dir(out, force) as tmp:
        write_run_header(tmp, record, tokenizer)
        save(tmp, model, None, {"step": record.get("step", 0)}, adapter=False, best=False)
