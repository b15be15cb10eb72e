"""Setting up a training run: new, resumed, or initialised from another run (full or LoRA).

Everything here is decisions and validation; the loop itself is in train.py and the
terminal in cli/. ``prepare`` callables let the front end show progress while a raw text
file is turned into a dataset on the fly.
"""
from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from . import checkpoint, data
from .config import ModelConfig, TrainConfig
from .data import Dataset
from .errors import TbpError
from .model import GPT
from .nn import LORA_TARGETS, add_lora
from .tokenizer import Tokenizer
from .train import State, Trainer, trim_metrics

Prepare = Callable[..., dict]   # (path, kind, vocab_size, out, force, tokenizer) -> meta


@dataclass
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}


# --- data -----------------------------------------------------------------------------------
def resolve_dataset(arg: str | None, prepare: Prepare, tokenizer: Tokenizer | None = None,
                    kind: str = "char", vocab_size: int | None = None) -> Dataset:
    """A prepared folder as is; a text file (or folder of text) prepared on the fly; None -> the
    built-in corpus. With ``tokenizer`` (resume / fine-tune) the text is encoded with it."""
    if arg is not None and Path(arg).is_dir() and (Path(arg) / "meta.json").is_file():
        ds = Dataset.load(arg)
    else:
        text_name = data.BUILTIN if arg is None else (Path(arg).stem if Path(arg).is_file() else Path(arg).name)
        if arg is not None and not Path(arg).exists():
            raise TbpError(f"{arg}: no such file or directory")
        if tokenizer is not None:
            out = data.default_out(f"{text_name}-tok{tokenizer.sha256()[:8]}")
        else:
            out = data.default_out(text_name if kind == "char" else f"{text_name}-bpe{vocab_size or 1024}")
        ds = _reuse(out, arg, tokenizer)
        if ds is None:
            prepare(arg, kind, vocab_size, out, out.exists(), tokenizer)
            ds = Dataset.load(out)
    if tokenizer is not None and ds.tokenizer.sha256() != tokenizer.sha256():
        raise TbpError(f"{ds.path}: its tokenizer differs from the checkpoint's "
                       f"(SHA-256 {ds.tokenizer.sha256()[:12]} vs {tokenizer.sha256()[:12]}); "
                       f"pass the raw text file instead and it will be encoded with the checkpoint's")
    return ds


def _reuse(out: Path, arg: str | None, tokenizer: Tokenizer | None) -> Dataset | None:
    """The dataset already prepared at ``out`` from the same text, if there is one."""
    if not (out / "meta.json").is_file():
        return None
    try:
        ds = Dataset.load(out)
    except TbpError:
        return None
    text, _, _ = data.read_corpus(arg)
    if ds.meta.get("source_sha256") != hashlib.sha256(text.encode("utf-8")).hexdigest():
        return None
    if tokenizer is not None and ds.tokenizer.sha256() != tokenizer.sha256():
        return None
    return ds


# --- run directories ------------------------------------------------------------------------
def claim_run_dir(out: Path, force: bool) -> None:
    """Refuse to write into an existing run unless forced; with force, clear a previous run."""
    if not out.exists():
        return
    if out.is_file():
        raise TbpError(f"{out}: is a file, not a run directory")
    contents = list(out.iterdir())
    if not contents:
        return
    if not force:
        raise TbpError(f"{out} already holds a run; use --resume to continue it, --force to replace it, "
                       f"or --out for a new one")
    if not (out / "config.json").is_file():
        raise TbpError(f"{out} is not empty and is not a tbp run; refusing to delete it")
    shutil.rmtree(out)


def _record(mcfg: ModelConfig, tcfg: TrainConfig, ds: Dataset, lora: LoraSpec | None,
            base: dict | None) -> dict:
    return {"model": mcfg.to_dict(), "train": tcfg.to_dict(), "data": str(ds.path),
            "lora": lora.to_dict() if lora else None, "base": base}


def new_run(out: Path, mcfg: ModelConfig, tcfg: TrainConfig, ds: Dataset, force: bool,
            callbacks=None) -> Trainer:
    claim_run_dir(out, force)
    model = GPT(mcfg, seed=tcfg.seed, dtype=np.dtype(tcfg.dtype))
    record = _record(mcfg, tcfg, ds, None, None)
    checkpoint.write_run_header(out, record, ds.tokenizer)
    return Trainer(model, ds, tcfg, out, record, adapter=False, callbacks=callbacks)


def init_from(out: Path, base_run: Path, tcfg: TrainConfig, ds: Dataset, force: bool,
              lora: LoraSpec | None, model_overrides: dict, callbacks=None) -> Trainer:
    """Fine-tune a copy of ``base_run``'s weights: all of them, or LoRA adapters only."""
    base_cfg = checkpoint.read_config(base_run)
    if base_cfg.get("lora"):
        raise TbpError(f"{base_run} is a LoRA adapter run; fold it first with tbp merge {base_run} --out DIR")
    if Path(out).resolve() == Path(base_run).resolve():
        raise TbpError("--out must differ from --init-from: the base run is never modified")
    model, tok, _ = checkpoint.load_model(base_run, dtype=np.dtype(tcfg.dtype), cls=GPT)
    _refuse_model_changes(model.config, model_overrides, f"the base run {base_run}")
    claim_run_dir(out, force)
    base = None
    if lora:
        if not lora.targets:
            raise TbpError("--lora-targets needs at least one layer")
        add_lora(model, lora.rank, lora.alpha, lora.targets, seed=tcfg.seed)
        weights = Path(base_run) / checkpoint.weights_name(False)
        base = {"path": str(Path(base_run).resolve()), "sha256": checkpoint.file_sha256(weights)}
    record = _record(model.config, tcfg, ds, lora, base)
    record["init_from"] = str(Path(base_run).resolve())
    checkpoint.write_run_header(out, record, tok)
    return Trainer(model, ds, tcfg, out, record, adapter=lora is not None, callbacks=callbacks)


def resume(out: Path, train_overrides: dict, model_overrides: dict, ds: Dataset | None,
           callbacks=None) -> Trainer:
    """Continue the run in ``out`` exactly where its last checkpoint left it."""
    out = Path(out)
    cfg = checkpoint.read_config(out)
    state_d = checkpoint.read_json(out / "state.json")
    try:
        tcfg = TrainConfig.from_dict({**cfg["train"], **train_overrides})
        state = State(**state_d)
    except (TypeError, ValueError, KeyError) as e:
        raise TbpError(f"{out}: cannot resume ({e})") from None
    model, tok, _ = checkpoint.load_model(out, dtype=np.dtype(tcfg.dtype), cls=GPT)
    _refuse_model_changes(model.config, model_overrides, f"the run being resumed ({out})")
    if ds is None:
        ds = Dataset.load(cfg["data"])
    if ds.tokenizer.sha256() != state.tokenizer_sha256:
        raise TbpError(f"{ds.path}: its tokenizer differs from the one {out} was trained with")
    adapter = bool(cfg.get("lora"))
    opt_arrays, opt_meta = checkpoint.read_arrays(out / "optimizer.safetensors")
    _, w_meta = checkpoint.read_arrays(out / checkpoint.weights_name(adapter))
    steps = {"state.json": state.step, "optimizer": opt_meta.get("step"), "weights": w_meta.get("step")}
    if len({str(v) for v in steps.values()}) != 1:
        raise TbpError(f"{out}: files are from different steps ({steps}); the run was cut mid-save")
    record = {**cfg, "train": tcfg.to_dict(), "data": str(ds.path)}
    record.pop("format", None)
    checkpoint.write_run_header(out, record, tok)
    trim_metrics(out, state.step)
    trainer = Trainer(model, ds, tcfg, out, record, adapter=adapter, callbacks=callbacks, state=state,
                      optimizer_state=(opt_arrays, state.step))
    trainer.last_saved_step = state.step
    return trainer


def _refuse_model_changes(cfg: ModelConfig, overrides: dict, what: str) -> None:
    current = cfg.to_dict()
    for k, v in overrides.items():
        if current.get(k) != v:
            raise TbpError(f"--{k.replace('_', '-')} {v} differs from {what} ({current.get(k)}); "
                           f"a model's shape is fixed once trained")


def lora_targets(spec: str) -> tuple[str, ...]:
    """'attn,mlp' style shorthands -> LORA_TARGETS names."""
    groups = {"attn": ("attn.c_attn", "attn.c_proj"), "mlp": ("mlp.c_fc", "mlp.c_proj"),
              "all": LORA_TARGETS[:4]}
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        names = groups.get(part, (part,))
        for n in names:
            if n not in LORA_TARGETS:
                raise TbpError(f"unknown LoRA target {n!r}; choose from {', '.join(LORA_TARGETS)}, "
                               f"or attn, mlp, all")
            if n not in out:
                out.append(n)
    return tuple(out)
