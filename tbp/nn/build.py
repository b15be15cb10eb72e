"""The builder: which class each config value stands for, every variant's declaration, and
the one way a model is built. The model's parts (parts.py: its positions object, its residual
scheme, how each block's attention is made) are made here once and handed to its constructor.

A config value maps to a class through the registry (registry.py), where each class enters
with a decorator; the class builds itself from the config (``from_config``), and what the
rest of tbp asks of a variant it asks through ``active``, ``refusal`` and the declarations
(variant.py), not by testing config strings. The architectures build their blocks from this
module: the GPT (gpt.py) and the encoder-decoder with the designs wing (designs/encdec), which
this module imports; the model modules import neither this module nor the decoder.
"""
from __future__ import annotations

from dataclasses import fields

import numpy as np

# the modules that register a choice, in the order each axis lists its choices (the command
# line's order); then the designs wing
from . import positions as _positions, residual as _residual, attention as _attention  # noqa: F401
from . import layernorm as _layernorm, mlp as _mlp  # noqa: F401
from . import config, gpt, designs, dropout, recompute, registry  # noqa: F401
from .config import ConfigError, ModelConfig
from .parts import parts
from .variant import Variant

ATTENTION, RESIDUAL, ARCH = registry.ATTENTION, registry.RESIDUAL, registry.ARCH     # the registry's axes

# every variant's declaration (variant.py): the core's training options, then the designs'
# (tbp/nn/designs/) -- the registry's own list, so a declaration made after this module was
# first imported (a design imported before the builder) is in it too
VARIANTS: list[Variant] = registry.VARIANTS


def attention_class(cfg: ModelConfig) -> type:
    return ATTENTION[cfg.attention]


def model_class(cfg: ModelConfig) -> type:
    """The class that builds ``cfg.arch``."""
    return ARCH[cfg.arch]


def build_model(cfg: ModelConfig, seed: int = 0, dtype=np.float32):
    """The model ``cfg.arch`` names (a GPT, an EncoderDecoder), its parts made here and handed in."""
    return model_class(cfg)(cfg, seed=seed, dtype=dtype, parts=parts(cfg, np.dtype(dtype)))


def kv_cache_bytes(cfg: ModelConfig, batch: int, dtype) -> int:
    """Bytes of the KV cache an Inference for ``batch`` sequences allocates (decode.py)."""
    return cfg.n_layer * batch * attention_class(cfg).cache_numbers(cfg) * np.dtype(dtype).itemsize


# --- the variants' declarations, asked ----------------------------------------------------
def active(cfg: ModelConfig) -> list[Variant]:
    """The variants ``cfg`` has switched on."""
    return [v for v in VARIANTS if v.active(cfg)]


def declarations_are_consistent() -> list[str]:
    """What is wrong with the declarations: a refusal of a key no variant has and no use
    (registry.USES) names, or two variants with one key. Empty when all is well (a test asks)."""
    keys = [v.key for v in VARIANTS]
    problems = [f"two variants are called {k!r}" for k in set(keys) if keys.count(k) > 1]
    problems += [f"{v.key} refuses {other!r}, which is neither a variant nor a use"
                 for v in VARIANTS for other in v.refuses if other not in keys and other not in registry.USES]
    return problems


def refusal(cfg: ModelConfig, use: str) -> str | None:
    """Why ``cfg`` cannot have ``use`` -- another variant's key, or a use, "thin" / "export" --, or
    None: the reason the first active variant refusing it gives."""
    for v in VARIANTS:
        if v.key != use and use in v.refuses and v.active(cfg):
            return v.refuses[use]
    return None


def conversion(base: ModelConfig, cfg: ModelConfig):
    """(trained model of ``base``) -> model of ``cfg``, where ``cfg`` differs from ``base`` only
    in the axis and options of one active variant that declares how to convert (``convert``;
    it raises ConfigError for a base it cannot take); None where no variant does, or nothing
    changes."""
    was, now = base.to_dict(), cfg.to_dict()
    changed = {k for k in now if k != "designs" and was.get(k) != now[k]}
    changed |= {key for key in cfg.designs if base.designs.get(key) != cfg.designs[key]}
    if not changed:
        return None
    for v in VARIANTS:
        if v.convert is not None and v.active(cfg) and changed <= {v.axis, v.key}:
            return v.convert(base, cfg)
    return None


def check(cfg: ModelConfig) -> None:
    """ModelConfig's validation, from the declarations, in this order: each variant's options
    only with the variant; no pair of active variants one of which refuses the other (in the
    order of VARIANTS); each active one's own check."""
    on = active(cfg)
    for v in VARIANTS:
        if v in on or v.options is None or v.options.KEPT_WHEN_OFF:
            continue
        given, default = cfg.designs[v.key], v.options()
        changed = [v.options.PREFIX + f.name for f in fields(v.options)
                   if getattr(given, f.name) != getattr(default, f.name)]
        if changed:
            article = "an" if v.name[0].lower() in "aeiou" else "a"
            raise ConfigError(f"{changed[0]} is {article} {v.name} option (pass {v.switch})")
    keys = {v.key for v in on}
    for v in on:
        for other, why in v.refuses.items():
            if other in keys:
                raise ConfigError(why)
    for v in on:
        if v.check is not None:
            v.check(cfg)


config.CHECKS.append(check)
config.REFUSALS.append(refusal)
