"""The runs under a folder (checkpoints/): what each is, how it ended, which one a command uses
when none is named, and removing one.

A run's status, from its files alone:

- training: a live process holds its lock (locks.RunLock);
- finished: it ran all its steps;
- stopped: it ended early and said why in state.json ("early stop: ...", "max time: ...",
  "interrupted": Ctrl-C or SIGTERM, saved);
- aborted: it ended early without saying so (killed, or crashed), at its last checkpoint;
- imported / merged: written by tbp import or tbp merge, not trained here.

A command that reads a run and is given none uses the run TBP_CHECKPOINT names, else the
newest under checkpoints/ that is usable -- finished, stopped, imported, merged or training
(its last checkpoint) -- and of a kind the command reads (``tbp chat``: a chat run). Aborted runs
and other kinds are passed over, and the command says which run it took and what it passed over.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import commit, disk
from ..errors import TbpError
from ..files.atomic import foreign_files
from ..files.locks import is_held

ROOT = Path("checkpoints")
ENV = "TBP_CHECKPOINT"
USABLE = ("training", "finished", "stopped", "imported", "merged")


def status(run: Path, cfg: dict | None = None, state: dict | None = None) -> str:
    """training, finished, stopped, aborted, imported or merged (see the module's docstring)."""
    run = Path(run)
    cfg = cfg if cfg is not None else disk.read_config(run)
    if is_held(run):
        return "training"
    if cfg.get("imported_from"):
        return "imported"
    if cfg.get("merged_from"):
        return "merged"
    state = state if state is not None else disk.read_state(run)
    train = cfg.get("train") or {}
    if state.get("step", 0) >= train.get("max_iters", 0):
        return "finished"
    return "stopped" if state.get("stopped") else "aborted"


def kind(cfg: dict) -> str:
    """What the run was trained on: text, pairs or chat (imported runs: text)."""
    return cfg.get("data_kind") or "text"


def _stat(p: Path):
    """os.stat of ``p``, or None for a file a live training removed meanwhile (an old step's file,
    a temporary)."""
    try:
        return p.stat()
    except FileNotFoundError:
        return None


def _size(run: Path) -> int:
    return sum(st.st_size for p in run.rglob("*") if not p.is_symlink() and (st := _stat(p)) is not None
               and p.is_file())


def _newest(run: Path) -> float:
    return max((st.st_mtime for p in run.iterdir() if (st := _stat(p)) is not None and p.is_file()), default=0.0)


def describe(run: Path) -> dict:
    """One run's line: name, kind, shape, status (with the reason it stopped), steps, losses, size."""
    run = Path(run)
    cfg = disk.read_config(run)
    state = disk.read_state(run) if (run / "state.json").is_file() else {}
    m = cfg.get("model") or {}
    evals = [x for x in disk.read_metrics(run) if "val_loss" in x]
    return {"run": str(run), "kind": kind(cfg) + (" (LoRA)" if cfg.get("lora") else ""),
            "shape": f"{m.get('n_layer')} × {m.get('d_model')}, context {m.get('n_ctx')}",
            "status": status(run, cfg, state), "why": state.get("stopped"),
            "step": state.get("step"), "max_iters": (cfg.get("train") or {}).get("max_iters"),
            "best_val_loss": state.get("best_val_loss"), "best_step": state.get("best_step"),
            "last_val_loss": evals[-1]["val_loss"] if evals else None, "bytes": _size(run),
            "modified": _newest(run)}


def runs(root: Path = ROOT) -> list[Path]:
    """The runs directly under ``root``, newest checkpoint first."""
    root = Path(root)
    found = [p for p in root.iterdir() if not p.name.startswith(".") and p.is_dir() and disk.is_run(p)] \
        if root.is_dir() else []
    return sorted(found, key=_newest, reverse=True)


def default_run(kinds: tuple[str, ...] | None = None, root: Path = ROOT, lora: bool = False) -> tuple[Path, str]:
    """(run, why it was chosen) for a command given no run: TBP_CHECKPOINT, else the newest usable
    run of one of ``kinds`` (None: any) under ``root`` -- a LoRA run if ``lora`` (tbp merge).
    TbpError naming what was passed over."""
    named = os.environ.get(ENV)
    if named:
        if not disk.is_run(Path(named)):
            raise TbpError(f"{ENV}={named}: not a run (no config.json and checkpoint there)")
        return Path(named), f"from {ENV}"
    passed = []
    for run in runs(root):
        try:
            cfg = disk.read_config(run)
            st = status(run, cfg)
        except TbpError:
            passed.append(f"{run} (unreadable)")
            continue
        if st not in USABLE:
            passed.append(f"{run} ({st})")
        elif kinds is not None and kind(cfg) not in kinds:
            passed.append(f"{run} (a {kind(cfg)} run)")
        elif lora and not cfg.get("lora"):
            passed.append(f"{run} (no LoRA adapters)")
        else:
            what = ("/".join(kinds) + " " if kinds else "") + ("LoRA " if lora else "")
            over = f"; passed over {', '.join(passed[:3])}{' and more' * (len(passed) > 3)}" if passed else ""
            return run, f"the newest {what}run under {root}/{over}"
    if passed:
        what = ("/".join(kinds) + " " if kinds else "") + ("LoRA " if lora else "")
        raise TbpError(f"no usable {what}run under {root}/ (passed over "
                       f"{', '.join(passed[:3])}{' and more' * (len(passed) > 3)}): pass --checkpoint")
    raise TbpError(f"no checkpoint under {root}/ (train one with tbp train, or pass --checkpoint)")


def check_removable(run: Path) -> None:
    """Refuse (TbpError) to remove ``run`` unless it is a run holding only what tbp writes in one
    and no training is writing it."""
    run = Path(run)
    if not disk.is_run(run):
        raise TbpError(f"{run}: not a run (no config.json and checkpoint); nothing removed")
    foreign = foreign_files(run, disk.RUN_FILES)
    if foreign:
        raise TbpError(f"{run}: holds files tbp did not write ({', '.join(sorted(foreign)[:3])}); nothing removed")
    if is_held(run):
        raise TbpError(f"{run}: a training is writing it; stop it first; nothing removed")


def remove(run: Path) -> int:
    """Delete a run tbp wrote, whole (:func:`check_removable` first); returns the bytes freed."""
    run = Path(run)
    check_removable(run)
    size = _size(run)
    with commit.holding_run(run):        # no training may start in it while it goes
        shutil.rmtree(run)
    return size


__all__ = ["status", "describe", "runs", "default_run", "remove"]
