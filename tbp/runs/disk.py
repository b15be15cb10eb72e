"""A run's files: their names, and reading them validated (no pickle, ever).

A run directory holds::

    config.json                    {"format", "model", "train", "data", "lora", "base"}
    tokenizer.json                 the tokenizer the model reads
    model-000250.safetensors       weights at step 250, GPT-2 names (adapter-... for a LoRA run)
    best-model-000250.safetensors  weights at the best validation loss so far
    optimizer-000250.safetensors   AdamW moments m.<name>, v.<name>
    state.json                     step, RNG state, best val loss, ..., and "files": the names above
    metrics.jsonl                  one JSON object per logged step

Every file is checked as it is read: config and state field by field (schema.py), a weights
file's names, shapes and dtype from its header before its tensors are read, a LoRA run's base
by its SHA-256. :func:`open_run` reads a run's records once (a :class:`RunRecord`), and
:func:`load_model` builds its model from them. Writing a run -- the commit protocol -- is
commit.py's. Runs written before step-stamped names (``model.safetensors`` ...) are read as
they are.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..files import jsonio, schema
from ..machine import memory
from ..files.jsonio import read_json
from ..errors import TbpError
from ..files.atomic import from_recorded, not_a_file
from ..nn.config import ModelConfig
from ..nn.lora import add_lora
from ..nn.build import build_model, model_class
from ..data.tokenizer import Tokenizer

FORMAT = 1
DATA_FIELDS = ("data", "data_source_sha256", "data_kind")   # a run record's data: carried by merge
# the checkpoint files tbp writes, by their role in state.json's "files": a step of 6 or more
# digits (model-000250.safetensors), or none (the first release's fixed names)
FILE_NAMES = {"weights": re.compile(r"(model|adapter)(-\d{6,})?\.safetensors"),
              "best": re.compile(r"best-(model|adapter)(-\d{6,})?\.safetensors"),
              "optimizer": re.compile(r"optimizer(-\d{6,})?\.safetensors")}


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` is a weights or moments file name tbp writes into a run."""
    return any(p.fullmatch(name) for p in FILE_NAMES.values())


# every name tbp writes into a run directory: what --force may replace (a user's own
# "model-good.safetensors" is not among them)
_STEP = "[0-9]" * 6
RUN_FILES = ("config.json", "tokenizer.json", "state.json", "metrics.jsonl", ".lock", ".*.tmp", ".owner",
             *(f"{stem}-{_STEP}{more}.safetensors" for stem in ("model", "adapter", "best-model", "best-adapter",
                                                                "optimizer") for more in ("", "[0-9]", "[0-9][0-9]")),
             "model.safetensors", "adapter.safetensors", "best-model.safetensors", "best-adapter.safetensors",
             "optimizer.safetensors")


def weights_name(adapter: bool, best: bool = False, step: int | None = None) -> str:
    """model-000250.safetensors, best-adapter-000100.safetensors, ... (no step: the old names)."""
    stem = ("best-" if best else "") + ("adapter" if adapter else "model")
    return f"{stem}-{step:06d}.safetensors" if step is not None else f"{stem}.safetensors"


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class MissingFile(TbpError):
    """A file a checkpoint names is not there (damage, or a newer commit removed it)."""


def read_state(run: Path) -> dict:
    """A run's state.json (checked field by field), or {} for a folder that has none."""
    path = Path(run) / "state.json"
    return schema.check(read_json(path), schema.STATE, str(path)) if path.is_file() else {}


def read_metrics(run: Path) -> list[dict]:
    """The lines of a run's metrics.jsonl that are a record tbp writes (schema.METRICS_LINE: a
    step, a finite training loss, an evaluation's numbers all or none). A line that is not -- a
    torn last line from a hard kill, a hand edit -- is skipped, so ``info`` and ``plot`` read
    only whole records."""
    path = Path(run) / "metrics.jsonl"
    out = []
    if path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, line in jsonio.lines(text):
            try:
                m = schema.check(jsonio.parse(line, f"{path}:{n}"), schema.METRICS_LINE, f"{path}:{n}")
            except TbpError:
                continue
            if m["step"] >= 0 and len({k for k in schema.EVAL_KEYS if k in m}) in (0, len(schema.EVAL_KEYS)):
                if "layers" in m and not _layer_stats_ok(m["layers"]):
                    del m["layers"]               # the line's own numbers stand; its damaged statistics do not
                out.append(m)
    return out


def _layer_stats_ok(layers: dict) -> bool:
    """A metrics line's per-layer statistics are as layerstats.py writes them: names to numbers."""
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    for key in ("grad_norm", "update_ratio"):
        got = layers.get(key, {})
        if not all(isinstance(k, str) and number(v) for k, v in got.items()):
            return False
    return all(number(v) for v in layers.get("stream_rms", []))


def checkpoint_files(run: Path, state: dict | None = None) -> dict[str, Path | None]:
    """{"weights", "best", "optimizer"}: the paths of the committed set state.json names (or the
    fixed names of a run written before step-stamped files); None where there is none."""
    run = Path(run)
    state = read_state(run) if state is None else state
    files = state.get("files")
    if files is None:                                       # the first release's layout
        adapter = (run / weights_name(True)).is_file()
        files = {"weights": weights_name(adapter), "best": weights_name(adapter, best=True),
                 "optimizer": "optimizer.safetensors"}
        files = {k: (v if (run / v).is_file() else None) for k, v in files.items()}
        if files["weights"] is None:
            raise TbpError(f"{run}: no weights saved yet (state.json is missing)")
    unknown = sorted(set(files) - set(FILE_NAMES))
    if unknown:
        raise TbpError(f"{run / 'state.json'}: files.{unknown[0]} is not a file tbp records")
    files = {key: files.get(key) for key in FILE_NAMES}
    for key, name in files.items():
        # a plain name of tbp's own: "../x" or "/abs/x" would read weights from outside the run
        if (name is not None or key == "weights") and not (isinstance(name, str) and FILE_NAMES[key].fullmatch(name)):
            raise TbpError(f"{run / 'state.json'}: files.{key} is {name!r}, not a checkpoint file name tbp writes")
    return {k: (run / v if v else None) for k, v in files.items()}


def weights_path(run: Path, best: bool = False, files: dict | None = None) -> Path:
    files = checkpoint_files(run) if files is None else files
    if best and files["best"] is None:
        raise TbpError(f"{run}: has no best-validation weights (it never evaluated); drop --best")
    return files["best" if best else "weights"]


_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "I8": "int8", "U8": "uint8",
           "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool"}


def _check_file(path: Path) -> None:
    """MissingFile for a missing file, TbpError for one that is not a regular file (a FIFO,
    a link to a device), which reading would block on or never finish."""
    why = not_a_file(path)
    if why == "missing":
        raise MissingFile(f"{path}: missing")
    if why is not None:
        raise TbpError(f"{path}: {why}")


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) from a safetensors file's header, without reading the tensors."""
    _check_file(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}
            return {k: (tuple(s.get_shape()), _DTYPES.get(s.get_dtype(), s.get_dtype())) for k, s in slices.items()}
    except Exception as e:    # safetensors raises its own error types for truncated/garbled files
        raise TbpError(f"{path}: damaged safetensors file ({' '.join(str(e).split())[:100]})") from None


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    return {k: shape for k, (shape, _) in read_header(path).items()}


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """A weights file's shapes from its header, after checking its tensors are of one float
    dtype tbp computes in (float32, or float64 from a check): float16, bfloat16 or integers
    are refused here, naming the file, before anything is read or built."""
    header = read_header(path)
    kinds = {dtype for _, dtype in header.values()}
    other = kinds - {"float32", "float64"}
    if other:
        raise TbpError(f"{path}: holds {', '.join(sorted(other))} tensors; tbp weights are float32 "
                       f"(or float64): convert the file, or export it again from tbp")
    if len(kinds) > 1:
        raise TbpError(f"{path}: mixes float32 and float64 tensors; a tbp weights file has one dtype")
    return {k: shape for k, (shape, _) in header.items()}


def check_shapes(shapes: dict, want: dict, source: Path) -> None:
    """Refuse a file whose tensor names or shapes differ from what the model needs."""
    missing = [k for k in want if k not in shapes]
    extra = [k for k in shapes if k not in want]
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise TbpError(f"{source}: tensor names do not match the model ({what})")
    for k, shape in want.items():
        if tuple(shapes[k]) != tuple(shape):
            raise TbpError(f"{source}: {k} has shape {tuple(shapes[k])}, the config needs {tuple(shape)}")


def read_arrays(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, metadata) of a safetensors file; data only, nothing executable."""
    _check_file(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            arrays = {k: f.get_tensor(k) for k in f.keys()}
        if "tbp" in meta:                      # write_arrays' one key (files of earlier releases: several)
            try:
                ours = json.loads(meta["tbp"])
            except ValueError:
                ours = None
            if not isinstance(ours, dict) or not all(isinstance(v, str) for v in ours.values()):
                raise TbpError(f"{path}: damaged metadata (the 'tbp' entry is not an object of strings)")
            meta = {**{k: v for k, v in meta.items() if k != "tbp"}, **ours}
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
    return schema.check(cfg, schema.RUN_CONFIG, str(run / "config.json"))


# A run of the release before designs kept their options wrote every design's options by their
# flat names, at these values when the design was off. Where this tbp lacks one of those designs,
# an option at that value says nothing and is dropped; any other value is still refused by name.
RELEASE4_OFF = {"n_enc_layer": None, "rope_base": 10000.0, "n_kv_head": None, "mta_cq": 2, "mta_ck": 9,
                "mta_layers": "all", "mta_post": False, "mta_mix": False, "mta_group": 0, "mta_norm": False,
                "mta_depth_scale": False, "residual_blocks": 0, "residual_query_scale": 1.0, "pad_id": None}


def read_model_config(run: Path, cfg: dict | None = None) -> ModelConfig:
    """The ModelConfig of a run (from its config.json, or the record ``cfg`` already read)."""
    cfg = read_config(run) if cfg is None else cfg
    model = cfg.get("model")
    if isinstance(model, dict) and "designs" not in model:              # the previous release's flat record
        known = {f.name for f in ModelConfig.flags()}
        model = {k: v for k, v in model.items() if k in known or k not in RELEASE4_OFF or v != RELEASE4_OFF[k]}
    try:
        return ModelConfig.from_dict(model)
    except (TypeError, ValueError) as e:
        raise TbpError(f"{Path(run) / 'config.json'}: bad model config ({e})") from None


def load_into(model, arrays: dict[str, np.ndarray], source: Path, names: list[str] | None = None) -> None:
    """Copy ``arrays`` into the model's parameters after checking names, shapes, dtypes, values."""
    want = names if names is not None else list(model.params)
    check_shapes({k: a.shape for k, a in arrays.items()}, {k: model.params[k].shape for k in want}, source)
    for k in want:
        a, p = arrays[k], model.params[k]
        if a.dtype not in (np.float32, np.float64):
            raise TbpError(f"{source}: {k} has dtype {a.dtype}; expected float32 or float64")
        if not np.isfinite(a).all():
            raise TbpError(f"{source}: {k} holds non-finite values")
        np.copyto(p, a, casting="unsafe" if a.dtype != p.dtype else "no")


@dataclasses.dataclass
class RunRecord:
    """A run directory read once: its config.json (``config``), the model config in it, its
    state.json (``state``, {} where there is none), the committed files that names (``files``:
    weights, best, optimizer) and its tokenizer. Loading a model and resuming a run share it, so
    neither reads a file twice."""
    path: Path
    config: dict
    model_config: ModelConfig
    state: dict
    files: dict
    tokenizer: Tokenizer


def open_run(run: str | Path, config: dict | None = None) -> RunRecord:
    """Read a run's records (``config``: its config.json, if already read), checking each."""
    run = Path(run)
    cfg = read_config(run) if config is None else config
    mcfg = read_model_config(run, cfg)
    tok = Tokenizer.load(run / "tokenizer.json")         # before the state: a folder with a config alone says so
    state = read_state(run)
    return RunRecord(run, cfg, mcfg, state, checkpoint_files(run, state), tok)


def load_model(run: str | Path, dtype=None, best: bool = False, compute: dict | None = None):
    """(model, tokenizer, config dict) of a run: a full model or a base plus its LoRA adapter.

    dtype: None keeps the checkpoint's; float32/float64 converts explicitly. Every shape is
    checked against the weight file's header, and the memory the model needs against what the
    machine has, before anything is built. A run that commits a new checkpoint while it is
    read (training goes on) is read again from its new state.json. ``compute``: options that
    change how the model computes, not what (nn.config.COMPUTE_FIELDS), to build it with.
    """
    for attempt in range(3):
        try:
            record = open_run(run)
            model, _ = model_of(record, dtype, best, compute)
            return model, record.tokenizer, record.config
        except MissingFile:
            if attempt == 2 or not (Path(run) / "state.json").is_file():
                raise


def model_of(record: RunRecord, dtype=None, best: bool = False, compute: dict | None = None):
    """(model, the weights file's metadata) of an opened run: shapes checked against the
    headers first, the weights file read once."""
    run, cfg, mcfg = record.path, record.config, record.model_config
    if record.tokenizer.vocab_size != mcfg.vocab_size:
        raise TbpError(f"{run}: tokenizer has {record.tokenizer.vocab_size} tokens but the embedding has "
                       f"{mcfg.vocab_size} rows: the files belong to different models")
    if compute:
        mcfg = dataclasses.replace(mcfg, **compute)      # checked again: a ConfigError is a usage error
    lora = cfg.get("lora")
    path, base_weights = verify_weights(run, cfg, mcfg, best, record.files)
    memory.check_fits(memory.model_bytes(mcfg, dtype or np.float32), f"the model in {run}")
    arrays, meta = read_arrays(path)
    file_dtype = next(iter(arrays.values())).dtype if arrays else np.float32
    model = build_model(mcfg, seed=0, dtype=dtype or file_dtype)
    if lora:
        load_into(model, read_arrays(base_weights)[0], base_weights)
        try:
            add_lora(model, lora["rank"], lora["alpha"], tuple(lora["targets"]))
        except ValueError as e:
            raise TbpError(f"{run / 'config.json'}: bad lora record ({e})") from None
        load_into(model, arrays, path, names=list(model.layout.entries))     # the adapters
    else:
        load_into(model, arrays, path)
    return model, meta


def verify_weights(run: Path, cfg: dict, mcfg: ModelConfig, best: bool = False,
                   files: dict | None = None) -> tuple[Path, Path | None]:
    """(weights, base weights or None) of a run, after checking every tensor's name and shape in
    the files' headers against the config: nothing is read or allocated for a mismatch.
    ``files``: the run's committed files, if already read (RunRecord)."""
    path = weights_path(run, best, files)
    want = model_class(mcfg).shapes(mcfg)
    if cfg.get("lora"):
        base_weights = _base_weights(run, cfg.get("base"))
        check_shapes(weight_shapes(base_weights), want, base_weights)
        weight_shapes(path)                              # the adapters: their dtype
        return path, base_weights
    check_shapes(weight_shapes(path), want, path)
    return path, None


def _base_weights(run: Path, base) -> Path:
    """The weights a LoRA run's adapters were trained on, proven unchanged by their SHA-256."""
    if not (isinstance(base, dict) and isinstance(base.get("path"), str) and isinstance(base.get("sha256"), str)):
        raise TbpError(f"{run / 'config.json'}: a LoRA run needs its base recorded (a 'base' object with "
                       f"'path' and 'sha256'); this one has {json.dumps(base)[:60]}")
    base_run = from_recorded(run, base["path"])          # relative to the run (files/atomic.portable_path)

    try:
        path = weights_path(base_run)
    except TbpError:
        path = base_run / weights_name(False)
    if not path.is_file():
        raise TbpError(f"{run}: its base model {base_run} is missing")
    if file_sha256(path) != base["sha256"]:
        raise TbpError(f"{run}: its base {base_run} has changed since the adapter was trained "
                       f"(SHA-256 mismatch); the adapter only makes sense on the exact base")
    return path


def is_run(path: Path) -> bool:
    """A folder holding a committed checkpoint: config.json beside state.json (or beside a
    weights file of the first release, which wrote state.json only when training)."""
    path = Path(path)
    return (path / "config.json").is_file() and any(
        (path / name).is_file() for name in ("state.json", weights_name(False), weights_name(True)))
