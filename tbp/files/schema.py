"""Checking the JSON files tbp reads against the shape tbp wrote them in.

A damaged or hand-edited file (a step that is a string, a missing key, a list where an
object belongs) must be refused at load with one line naming the file and the field, never
surface later as a TypeError deep inside. A spec maps each key to its kind:

    int, float (an int is accepted), str, bool, dict (any object), list (any array),
    [kind] (an array of that kind), {...} (a nested spec), (kind, None) (nullable);
    a key ending in "?" may be absent. Keys the spec does not name are allowed.
"""
from __future__ import annotations

import math

from ..errors import TbpError


def check(obj, spec: dict, where: str, path: str = "") -> dict:
    """Return ``obj`` if it matches ``spec``; else raise TbpError('where: field ...')."""
    if not isinstance(obj, dict):
        raise TbpError(f"{where}: {path or 'the file'} must be a JSON object, got {_name(obj)}")
    for key, kind in spec.items():
        optional = key.endswith("?")
        key = key.rstrip("?")
        field = f"{path}.{key}" if path else key
        if key not in obj:
            if optional:
                continue
            raise TbpError(f"{where}: missing field {field!r}")
        _value(obj[key], kind, where, field)
    return obj


def _value(value, kind, where: str, field: str) -> None:
    if isinstance(kind, tuple):                     # nullable
        if value is None:
            return
        kind = kind[0]
    if isinstance(kind, dict):
        check(value, kind, where, field)
        return
    if isinstance(kind, list):
        if not isinstance(value, list):
            raise TbpError(f"{where}: {field} must be an array, got {_name(value)}")
        for i, item in enumerate(value):
            _value(item, kind[0], where, f"{field}[{i}]")
        return
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool),
          dict: lambda v: isinstance(v, dict), list: lambda v: isinstance(v, list)}[kind](value)
    if not ok:
        want = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false",
                dict: "an object", list: "an array"}[kind]
        raise TbpError(f"{where}: {field} must be {want}, got {value!r:.60}")


def _name(obj) -> str:
    return {list: "an array", str: "a string", type(None): "null", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(obj), type(obj).__name__)


# --- the files tbp writes ---------------------------------------------------------------------
RNG_STATE = {"bit_generator": str, "state": {"state": int, "inc": int}, "has_uint32": int, "uinteger": int}

STATE = {"step": int, "tokens_seen?": int, "elapsed_s?": float, "best_val_loss?": (float, None),
         "best_step?": (int, None), "data_rng?": dict, "tokenizer_sha256?": str, "stopped?": (str, None), "evals_since_best?": int,
         "files?": {"weights": str, "best?": (str, None), "optimizer?": (str, None)}}

RUN_CONFIG = {"format": int, "model": dict, "train?": (dict, None), "data?": (str, None),
              "data_source_sha256?": (str, None), "data_kind?": (str, None),
              "lora?": ({"rank": int, "alpha": float, "targets": [str]}, None),
              "base?": ({"path": str, "sha256": str}, None)}

DATASET_META = {"format": int, "tokenizer": str, "vocab_size": int, "dtype": str, "train_tokens": int,
                "val_tokens": int, "train_bytes": int, "val_bytes": int, "source_sha256": str,
                "source?": str, "characters?": int, "bytes_per_token?": float, "seconds?": float}

METRICS_LINE = {"step": int, "lr": float, "train_loss": float, "grad_norm?": float, "tokens_per_s?": float,
                "elapsed_s?": float, "val_loss?": float, "eval_train_loss?": float, "val_bpb?": float,
                "val_split_loss?": float, "val_split_tokens?": int, "val_split_every?": int, "val_split_bpb?": float,
                "layers?": {"grad_norm?": dict, "update_ratio?": dict, "stream_rms?": [float], "stats_ms?": float}}
EVAL_KEYS = ("val_loss", "eval_train_loss", "val_bpb")       # an evaluation writes all of them
