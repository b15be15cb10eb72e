"""Checkpoints: safe (no pickle, ever), atomic on write, validated on read.

A run directory holds::

    config.json            {"format", "model", "train", "lora", "base"}
    tokenizer.json         the tokenizer the model reads
    model.safetensors      weights, GPT-2 names          (adapter.safetensors for a LoRA run)
    best-model.safetensors weights at the best validation loss   (best-adapter.safetensors)
    optimizer.safetensors  AdamW moments m.<name>, v.<name>
    state.json             step, RNG state, best val loss, tokenizer SHA-256, ...
    metrics.jsonl          one JSON object per logged step

Each weight file records its step in the safetensors metadata, so a resume can prove that
weights, moments and state belong together.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save as st_save

from .errors import TbpError
from .fsutil import atomic_write_bytes, atomic_write_json, atomic_write_text, staged_dir
from .nn import GPT, ModelConfig, add_lora
from .tokenizer import Tokenizer

FORMAT = 1
def weights_name(adapter: bool, best: bool = False) -> str:
    return ("best-" if best else "") + ("adapter" if adapter else "model") + ".safetensors"


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --- writing --------------------------------------------------------------------------------
def write_arrays(path: str | Path, arrays: dict[str, np.ndarray], step: int, kind: str) -> None:
    data = st_save({k: np.ascontiguousarray(v) for k, v in arrays.items()},
                   metadata={"format": f"tbp-{FORMAT}", "kind": kind, "step": str(step)})
    atomic_write_bytes(path, data)


def write_run_header(run: Path, config: dict, tokenizer: Tokenizer) -> None:
    run.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run / "config.json", {"format": FORMAT, **config})
    atomic_write_text(run / "tokenizer.json", tokenizer.to_str())


def save(run: Path, model: GPT, optimizer, state: dict, adapter: bool, best: bool) -> None:
    """Weights, moments, then state.json last: the state names the step the others hold."""
    step = state["step"]
    weights = model.layout.views(model.layout.params)     # what trains: all, or the adapters
    write_arrays(run / weights_name(adapter), weights, step, "weights")
    if best:
        write_arrays(run / weights_name(adapter, best=True), weights, step, "weights")
    write_arrays(run / "optimizer.safetensors", optimizer.state_arrays(), step, "optimizer")
    atomic_write_json(run / "state.json", state)


# --- reading --------------------------------------------------------------------------------
def read_json(path: Path) -> dict:
    if not path.is_file():
        raise TbpError(f"{path}: missing")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise TbpError(f"{path}: damaged JSON ({e})") from None
    if not isinstance(obj, dict):
        raise TbpError(f"{path}: expected a JSON object")
    return obj


def read_state(run: Path) -> dict:
    """A run's state.json, or {} for a run that has not saved yet (or a merged/imported one)."""
    path = Path(run) / "state.json"
    return read_json(path) if path.is_file() else {}


def read_metrics(run: Path) -> list[dict]:
    """The lines of a run's metrics.jsonl, skipping a torn last line from a hard kill."""
    path = Path(run) / "metrics.jsonl"
    out = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                m = json.loads(line)
            except ValueError:
                continue
            if isinstance(m, dict):
                out.append(m)
    return out


def read_arrays(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, metadata) of a safetensors file; data only, nothing executable."""
    if not path.is_file():
        raise TbpError(f"{path}: missing")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            arrays = {k: f.get_tensor(k) for k in f.keys()}
    except TypeError as e:    # bfloat16 (and other dtypes numpy lacks)
        raise TbpError(f"{path}: {e}; convert the weights to float32 or float16 first") from None
    except Exception as e:    # safetensors raises its own error types for truncated/garbled files
        raise TbpError(f"{path}: damaged safetensors file ({' '.join(str(e).split())[:100]})") from None
    return arrays, meta


def read_config(run: Path) -> dict:
    run = Path(run)
    if not run.is_dir():
        raise TbpError(f"{run}: no such checkpoint directory")
    if not (run / "config.json").is_file():
        if (run / "meta.json").is_file():
            raise TbpError(f"{run} is a prepared dataset, not a checkpoint "
                           f"(train on it with: tbp train --data {run})")
        raise TbpError(f"{run}: not a checkpoint (no config.json)")
    cfg = read_json(run / "config.json")
    if cfg.get("format") != FORMAT:
        raise TbpError(f"{run / 'config.json'}: checkpoint format {cfg.get('format')!r}, this tbp reads {FORMAT}")
    return cfg


def read_model_config(run: Path, cfg: dict | None = None) -> ModelConfig:
    """The ModelConfig of a run (from its config.json, or the record ``cfg`` already read)."""
    cfg = read_config(run) if cfg is None else cfg
    try:
        return ModelConfig.from_dict(cfg.get("model"))
    except (TypeError, ValueError) as e:
        raise TbpError(f"{Path(run) / 'config.json'}: bad model config ({e})") from None


def load_into(model: GPT, arrays: dict[str, np.ndarray], source: Path, names: list[str] | None = None) -> None:
    """Copy ``arrays`` into the model's parameters after checking names, shapes, dtypes, values."""
    want = names if names is not None else list(model.params)
    missing = [k for k in want if k not in arrays]
    extra = [k for k in arrays if k not in want]
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise TbpError(f"{source}: tensor names do not match the model ({what})")
    for k in want:
        a, p = arrays[k], model.params[k]
        if a.shape != p.shape:
            raise TbpError(f"{source}: {k} has shape {a.shape}, the config needs {p.shape}")
        if a.dtype not in (np.float32, np.float64):
            raise TbpError(f"{source}: {k} has dtype {a.dtype}; expected float32 or float64")
        if not np.isfinite(a).all():
            raise TbpError(f"{source}: {k} holds non-finite values")
        np.copyto(p, a, casting="unsafe" if a.dtype != p.dtype else "no")


def load_model(run: str | Path, dtype=None, best: bool = False):
    """(model, tokenizer, config dict) of a run: a full model or a base plus its LoRA adapter.

    dtype: None keeps the checkpoint's; float32/float64 converts explicitly.
    """
    run = Path(run)
    cfg = read_config(run)
    mcfg = read_model_config(run, cfg)
    tok = Tokenizer.load(run / "tokenizer.json")
    if tok.vocab_size != mcfg.vocab_size:
        raise TbpError(f"{run}: tokenizer has {tok.vocab_size} tokens but the embedding has "
                       f"{mcfg.vocab_size} rows: the files belong to different models")
    lora = cfg.get("lora")
    path = run / weights_name(bool(lora), best)
    arrays, _ = read_arrays(path)
    file_dtype = next(iter(arrays.values())).dtype if arrays else np.float32
    model = GPT(mcfg, seed=0, dtype=dtype or file_dtype)
    if lora:
        base = cfg.get("base") or {}
        base_path = Path(base.get("path", ""))
        base_weights = base_path / weights_name(False)
        if not base_weights.is_file():
            raise TbpError(f"{run}: its base model {base_weights} is missing")
        if file_sha256(base_weights) != base.get("sha256"):
            raise TbpError(f"{run}: its base {base_weights} has changed since the adapter was trained "
                           f"(SHA-256 mismatch); the adapter only makes sense on the exact base")
        load_into(model, read_arrays(base_weights)[0], base_weights)
        add_lora(model, lora["rank"], lora["alpha"], tuple(lora["targets"]))
        load_into(model, arrays, path, names=list(model.layout.entries))     # the adapters
    else:
        load_into(model, arrays, path)
    return model, tok, cfg


def latest_run(root: str | Path = "checkpoints") -> Path:
    """The run under ``root`` whose weights were written most recently."""
    root = Path(root)
    found = [p for name in ("model.safetensors", "adapter.safetensors") for p in root.glob(f"*/{name}")] \
        if root.is_dir() else []
    if not found:
        raise TbpError(f"no checkpoint under {root}/ (train one with tbp train, or pass --checkpoint)")
    return max(found, key=lambda p: p.stat().st_mtime).parent


def save_plain(out: Path, model: GPT, tokenizer: Tokenizer, record: dict, force: bool = False) -> None:
    """A stand-alone checkpoint (config, tokenizer, weights), written as one atomic folder."""
    with staged_dir(out, force) as tmp:
        write_run_header(tmp, record, tokenizer)
        write_arrays(tmp / weights_name(False), dict(model.params), record.get("step", 0), "weights")
