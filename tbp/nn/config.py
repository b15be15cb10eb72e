"""ModelConfig: the shape and options every model has, each declared once, and a design's own
options beside them.

Every field is declared with :func:`option`: its default, a line of help, its range or its
choices. Validation here, the ``tbp train`` flags, ``--config`` files and ``tbp info`` are all
derived from those declarations, so a new model option is one field (plus the layer code and
its gradcheck row). A design's own options live in its folder, as a small frozen dataclass of
:class:`Options` declared with its variant (variant.py); a config holds one of each in
``designs``, and what a design refuses or checks is declared by the design (build.py installs
those checks in ``CHECKS``).

Each option has one flat name, its ``tbp train`` flag and ``--config`` key: a core field's own,
or a design's ``PREFIX`` + field (``mta_ck``, ``n_kv_head``). A run's config.json keeps a
design's options under its key (``"designs": {"mta": {"ck": 9, ...}}``); one written with the
flat names before designs kept their options reads the same.
"""
from __future__ import annotations

import math
import typing
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields, replace

from . import registry


class ConfigError(ValueError):
    """An option value outside its declared range or choices (a usage error, not a bug)."""


def option(default, help: str, *, min=None, max=None, min_open: bool = False, max_open: bool = False,
           choices=None, cli: bool = True, flag: str | None = None, gpt2=None):
    """A config field: default, help, and what makes a value valid.

    min/max: bounds, inclusive unless ``min_open``/``max_open``; choices: allowed strings;
    cli: False for values derived from the data or the engine (no flag); flag: a click flag
    spelling for booleans ("--tie-head/--untie-head"); gpt2: the value GPT-2 itself uses, for
    options an exported GPT-2 folder cannot represent otherwise.
    """
    meta = {"help": help, "min": min, "max": max, "min_open": min_open, "max_open": max_open, "choices": choices,
            "cli": cli, "flag": flag, "gpt2": gpt2}
    return field(default=default, metadata=meta)


class DictConfig:
    """Validation from the field declarations, and a JSON round trip (unknown keys are an error)."""
    KIND = "config"

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            _check(f.name, getattr(self, f.name), hints[f.name], f.metadata)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        if not isinstance(d, dict):
            raise ConfigError(f"a {cls.KIND} must be a JSON object, got {type(d).__name__}")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown {cls.KIND} keys: {', '.join(sorted(unknown))}")
        return cls(**d)

    @classmethod
    def options(cls) -> list[Flag]:
        """The options a user sets (the ``tbp train`` flags), in declaration order."""
        return [f for f in cls.flags() if f.metadata.get("cli", False)]

    @classmethod
    def flags(cls, prefix: str = "") -> list[Flag]:
        """Every declared field as a :class:`Flag` named ``prefix`` + its name."""
        hints = typing.get_type_hints(cls)
        return [Flag(prefix + f.name, hints[f.name], f.default, f.metadata) for f in fields(cls) if f.metadata]

    @classmethod
    def defaults(cls) -> dict:
        return {f.name: f.default for f in cls.flags() if f.default is not MISSING}


@dataclass(frozen=True)
class Flag:
    """One option as the command line and ``--config`` files see it: its flat name, its type
    hint, its default and its declaration (:func:`option`'s metadata)."""
    name: str
    kind: object
    default: object
    metadata: typing.Mapping


class Options(DictConfig):
    """A design's own options: subclass it as a frozen dataclass in the design's folder, with
    :func:`option` fields, and declare it with the design's variant (``Variant(options=...)``).
    ``PREFIX`` + a field's name is its flat name (the flag, the ``--config`` key; ``mta_`` +
    ``ck``); a value out of range is refused under that name. ``KEPT_WHEN_OFF``: the options may
    differ from their defaults while the design is off (otherwise that is refused)."""
    PREFIX = ""
    KEPT_WHEN_OFF = False
    KIND = "design options"

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            _check(self.PREFIX + f.name, getattr(self, f.name), hints[f.name], f.metadata)

    @classmethod
    def flags(cls, prefix: str | None = None) -> list[Flag]:
        return super().flags(cls.PREFIX if prefix is None else prefix)


def _check(name: str, value, kind, meta) -> None:
    """Raise ConfigError unless ``value`` fits the field's type, range and choices."""
    args = typing.get_args(kind)
    if value is None:
        if type(None) in args:
            return
        raise ConfigError(f"{name} must be set")
    base = next((a for a in args if a is not type(None)), kind) if args else kind
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return
    if base is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if base is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if base is str and not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices")
    if lo is not None and (value <= lo if meta.get("min_open") else value < lo):
        raise ConfigError(f"{name} must be {'>' if meta.get('min_open') else '>='} {lo}, got {value!r}")
    if hi is not None and (value >= hi if meta.get("max_open") else value > hi):
        raise ConfigError(f"{name} must be {'<' if meta.get('max_open') else '<='} {hi}, got {value!r}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


ACTIVATIONS = ("gelu", "relu")
class _KernelChoices:
    """``auto`` beside the attention kernels the engine has registered (registry.py)."""

    def __contains__(self, value) -> bool:
        return value == "auto" or value in registry.KERNEL

    def __iter__(self):
        return iter(("auto", *registry.KERNEL))


ATTN_IMPLS = _KernelChoices()
POSITIONS = registry.POSITIONS        # the positions schemes the engine has registered (registry.py)
# the choices of the design axes: what the engine has registered (registry.py)
ARCHS, ATTENTIONS, RESIDUALS = registry.ARCH, registry.ATTENTION, registry.RESIDUAL
NORMS, MLPS = registry.NORM, registry.MLP
PROJ_INITS = ("flat", "scaled")


N_CTX_MAX = 65536          # the longest context any model here reads: a bound for data too
# how the model computes or trains, not what it is (a kernel, dropout, recomputation): free to
# change on resume or fine-tune
COMPUTE_FIELDS = ("attn_impl", "dropout", "recompute")
# installed by build.py: check(cfg) raises ConfigError; refusal(cfg, use) -> the reason or None
CHECKS: list = []
REFUSALS: list = []


def _designs() -> dict[str, type]:
    """Each registered design that has options of its own: its key -> its Options class."""
    registry.complete()
    return {v.key: v.options for v in registry.VARIANTS if v.options is not None}


def _flat_names() -> dict[str, tuple[str, str]]:
    """A design option's flat name -> (its design's key, its field): ``mta_ck`` -> ("mta", "ck")."""
    return {flag.name: (key, flag.name[len(cls.PREFIX):]) for key, cls in _designs().items() for flag in cls.flags()}


@dataclass(init=False)
class ModelConfig(DictConfig):
    """A model's shape and options. ``designs``: each registered design's options (its key ->
    its Options), the defaults unless given: ``ModelConfig(attention="gqa", designs={"gqa":
    {"n_kv_head": 2}})``, or an Options object (``designs={"gqa": GQAOptions(n_kv_head=2)}``).
    Read one as ``cfg.designs["gqa"].n_kv_head``."""
    arch: str = option("gpt", "The architecture: gpt, a decoder-only language model.", choices=ARCHS, gpt2="gpt")
    vocab_size: int = option(65, "V: tokens the model reads and predicts (set by the tokenizer).",
                             min=1, cli=False)
    n_ctx: int = option(128, "Context length: tokens per training sequence (learned positions).",
                        min=2, max=N_CTX_MAX)
    n_layer: int = option(4, "L: transformer blocks.", min=1, max=96)
    n_head: int = option(4, "H: attention heads per block.", min=1, max=128)
    d_model: int = option(128, "C: width of the residual stream (divisible by --n-head).", min=1, max=16384)
    d_qk: int | None = option(None, "Dk: query/key width per head, the paper's d_rho "
                                    "(default d_model / n_head, the value width Dv).", min=1, max=4096)
    bias: bool = option(True, "Biases in every linear and layer-norm layer.", gpt2=True)
    activation: str = option("gelu", "MLP nonlinearity: gelu (GPT-2's tanh approximation) or relu.",
                             choices=ACTIVATIONS, gpt2="gelu")
    ln_eps: float = option(1e-5, "The norms' epsilon (the paper's checks use 0).", min=0.0)
    norm: str = option("layer", "The normalisation before each sublayer and the head: layer (GPT-2's layer norm).",
                       choices=NORMS, gpt2="layer")
    mlp: str = option("standard", "The feed-forward sublayer: standard (c_fc, --activation, c_proj; 4 C wide).",
                      choices=MLPS, gpt2="standard")
    tie_head: bool = option(True, "Output head tied to the token embedding, or (untied) a separate "
                                  "layer, the paper's FC_logits.",
                            flag="--tie-head/--untie-head", gpt2=True)
    head_bias: bool = option(True, "The untied head's bias (the paper's FC_logits has one; imported heads often "
                                   "have none). A tied head has none.", flag="--head-bias/--no-head-bias")
    causal: bool = option(True, "Causal mask; False gives permutation-equivariant attention.",
                          cli=False, gpt2=True)
    attn_impl: str = option("auto", "Attention kernel: dense keeps the T x T attention weights for the "
                                    "backward; auto picks, at a long context, a kernel registered to take over "
                                    "there (tbp info shows the choice).", choices=ATTN_IMPLS)
    positions: str = option("learned", "Position encoding: learned (a vector per position, GPT-2's); a scheme "
                                       "without one reads past the context as a sliding window.",
                            choices=POSITIONS, gpt2="learned")
    attention: str = option("standard", "The self-attention: standard (the paper's).",
                            choices=ATTENTIONS, gpt2="standard")
    residual: str = option("sum", "How each sublayer's input is formed: sum (the residual stream).",
                           choices=RESIDUALS, gpt2="sum")
    proj_init: str = option("flat", "Initial spread of the projections that write into the residual stream: flat "
                                    "(N(0, 0.02), as every matrix) or scaled (GPT-2's N(0, 0.02 / sqrt(S)), S the "
                                    "residual additions of the stack: 2 per block, 3 in a decoder block).",
                            choices=PROJ_INITS)
    recompute: bool = option(False, "Activation recomputation: keep only each block's input in the forward and run "
                                    "the block again in the backward (one block's activations in memory at a time, "
                                    "a quarter to a third more time per step, the same gradients).",
                             flag="--recompute/--no-recompute")
    dropout: float = option(0.0, "Dropout probability on attention weights and on each sublayer's output, in "
                                 "training only (nanoGPT's Shakespeare recipe uses 0.2; 0: off).",
                            min=0.0, max=1.0, max_open=True)
    designs: dict = field(default_factory=dict)
    KIND = "model config"

    def __init__(self, designs: dict | None = None, **values) -> None:
        flat = _flat_names()
        legacy = {name: values.pop(name) for name in list(values) if name in flat}
        if legacy:
            # the one place an old spelling is read: a design's option given as a ModelConfig keyword
            nested = {}
            for name, value in legacy.items():
                nested.setdefault(flat[name][0], {})[flat[name][1]] = value
            warnings.warn(f"ModelConfig({', '.join(f'{k}=...' for k in legacy)}): a design's options live with the "
                          f"design now; pass designs={nested!r}", FutureWarning, stacklevel=2)
        for f in fields(self):
            if f.name == "designs":
                continue
            if f.name in values:
                setattr(self, f.name, values.pop(f.name))
            elif f.default is not MISSING:
                setattr(self, f.name, f.default)
            else:
                raise TypeError(f"ModelConfig() is missing {f.name}")
        if values:
            raise TypeError(f"ModelConfig() got an unexpected keyword argument {next(iter(values))!r}")
        self.designs = _options(designs, {flat[k]: v for k, v in legacy.items()})
        self.__post_init__()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.d_model % self.n_head:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.d_qk is None:
            self.d_qk = self.d_v
        for check in CHECKS:
            check(self)

    # --- the flat names: flags, --config files, a run's record of the previous release ---------
    @classmethod
    def flags(cls, prefix: str = "") -> list[Flag]:
        """The core fields, then each design's options under their flat names; an axis's help
        ends with what each registered choice on it is (its variant's ``summary``)."""
        designs = _designs()
        summaries: dict[str, list[str]] = {}
        for v in registry.VARIANTS:
            if v.axis and v.summary:
                summaries.setdefault(v.axis, []).append(v.summary)
        core = [Flag(f.name, f.kind, f.default, {**f.metadata, "help": " ".join([f.metadata["help"], *summaries[f.name]])})
                if f.name in summaries else f for f in super().flags()]
        return core + [flag for opts in designs.values() for flag in opts.flags()]

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """A config from its JSON object: a design's options under ``designs`` (this release's
        config.json) or by their flat names (the command line, ``--config`` files, the previous
        release's config.json); unknown keys are an error."""
        if not isinstance(d, dict):
            raise ConfigError(f"a {cls.KIND} must be a JSON object, got {type(d).__name__}")
        core = {f.name for f in fields(cls)} - {"designs"}
        flat = _flat_names()
        unknown = set(d) - core - set(flat) - {"designs"}
        if unknown:
            raise ConfigError(f"unknown {cls.KIND} keys: {', '.join(sorted(unknown))}")
        nested = d.get("designs") or {}
        if not isinstance(nested, dict) or not all(isinstance(v, dict) for v in nested.values()):
            raise ConfigError(f"a {cls.KIND}'s designs must be a JSON object of JSON objects")
        designs = {key: dict(values) for key, values in nested.items()}
        for name in set(d) & set(flat):
            key, attr = flat[name]
            designs.setdefault(key, {})[attr] = d[name]
        return cls(designs=designs, **{k: v for k, v in d.items() if k in core})

    def to_dict(self) -> dict:
        """The JSON object of a run's config.json: the core fields, and under ``designs`` the
        options of each design this model has switched on."""
        on = {v.key for v in registry.VARIANTS if v.active(self)}
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "designs"}
        d["designs"] = {key: asdict(opts) for key, opts in self.designs.items() if key in on}
        return d

    def flat(self) -> dict:
        """Every option by its flat name: the core fields, then each design's options."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "designs"}
        for opts in self.designs.values():
            d.update({opts.PREFIX + k: v for k, v in asdict(opts).items()})
        return d

    @classmethod
    def defaults(cls) -> dict:
        """Every option's default by its flat name."""
        return {f.name: f.default for f in cls.flags() if f.default is not MISSING}

    def replace(self, **changes) -> "ModelConfig":
        """This config with ``changes`` by flat name (``n_kv_head=2``, ``attn_impl="flash"``)."""
        return type(self).from_dict({**self.flat(), **changes})

    @property
    def attn_kernel(self) -> str:
        """The kernel attn_impl stands for at this context (every kernel gives the same results):
        for ``auto``, the one registered to take over at the longest context up to n_ctx that no
        variant of this model refuses (flash from 2,048: registry.KERNEL_FROM), else dense."""
        if self.attn_impl == "auto":
            fits = [(T, name) for name, T in registry.KERNEL_FROM.items()
                    if self.n_ctx >= T and not any(r(self, name) for r in REFUSALS)]
            return max(fits)[1] if fits else "dense"
        return self.attn_impl

    @property
    def d_v(self) -> int:
        """Dv: value width per head, C / H, so the heads concatenate back to C."""
        return self.d_model // self.n_head


def _options(given: dict | None, legacy: dict) -> dict:
    """Each registered design's Options: ``given`` (key -> an Options or a dict of its fields)
    over the defaults, then ``legacy`` ((key, field) -> value)."""
    declared = _designs()
    out = {key: cls() for key, cls in declared.items()}
    for key, value in (given or {}).items():
        cls = declared.get(key)
        if cls is None:
            raise ConfigError(f"designs: no design called {key!r} has options "
                              f"({', '.join(declared) or 'none is registered'})")
        if isinstance(value, cls):
            out[key] = value
        elif isinstance(value, dict):
            unknown = set(value) - {f.name for f in fields(cls)}
            if unknown:
                raise ConfigError(f"designs: {key} has no option {', '.join(sorted(unknown))}")
            out[key] = cls(**value)
        else:
            raise ConfigError(f"designs: {key}'s options must be a {cls.__name__} or an object, got {value!r}")
    for (key, attr), value in legacy.items():
        out[key] = replace(out[key], **{attr: value})
    return out
