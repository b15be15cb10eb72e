"""Click options derived from the config dataclasses: one declaration per option.

``config_options(ModelConfig)`` turns every user-facing field into a typed, ranged flag with its
default and help, so adding a field to a config adds its flag, its --config key and its
`tbp info` line with no edit here.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from pathlib import Path

import click
from click.core import ParameterSource

from ..files import jsonio
from ..nn.config import ModelConfig
from ..nn import build, registry
from ..errors import TbpError


class FiniteFloat(click.FloatRange):
    """A FloatRange that refuses NaN and infinity (which pass any range comparison)."""

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        if not math.isfinite(value):
            self.fail(f"{value} is not a finite number.", param, ctx)
        return value


def _param_type(f, base):
    m = f.metadata
    if m["choices"] is not None:
        return click.Choice(list(m["choices"]))
    if base is int:
        return click.IntRange(m["min"], m["max"], min_open=m["min_open"], max_open=m["max_open"])
    if base is float:
        return FiniteFloat(m["min"], m["max"], min_open=m["min_open"], max_open=m["max_open"])
    return click.STRING


def config_options(cls, defaults: dict | None = None):
    """A decorator adding one click option per user-facing field of ``cls`` (in declaration
    order), named --field-name, typed and ranged from the field's metadata. ``defaults``
    overrides a field's default for this command."""
    opts = [_click_option(f, (defaults or {}).get(f.name, f.default)) for f in cls.options()]

    def decorate(fn):
        for o in reversed(opts):
            fn = o(fn)
        return fn
    return decorate


# where a value the user set comes from (command line, environment or --config), not a default
USER_SOURCES = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT, ParameterSource.DEFAULT_MAP)


def given(ctx: click.Context, cls) -> dict:
    """The values of ``cls``'s options that the user set (command line, environment or --config)."""
    return {f.name: ctx.params[f.name] for f in cls.options()
            if f.name in ctx.params and ctx.get_parameter_source(f.name) in USER_SOURCES}


class ByteSize(click.ParamType):
    """A size: 500000, 64K, 256M, 1G (powers of 1024)."""
    name = "size"
    UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
        else:
            text = str(value).strip().upper().removesuffix("B").removesuffix("I")
            unit = text[-1:] if text[-1:] in self.UNITS else ""
            try:
                n = int(float(text[:len(text) - len(unit)]) * self.UNITS[unit])
            except (ValueError, OverflowError):      # "64Q", "inf", "1e400"
                self.fail(f"{value!r} is not a size (for example 500000, 64M, 1G)", param, ctx)
        if n < 1:
            self.fail(f"{value!r} must be at least 1", param, ctx)
        return n


def text_encoding(ctx, param, value):
    """--encoding: a codec Python knows that turns bytes into text (exit 2 otherwise)."""
    import codecs
    try:
        info = codecs.lookup(value)
    except LookupError:
        raise click.BadParameter(f"unknown encoding {value!r} (for example utf-8, latin-1, utf-16)", ctx, param) \
            from None
    if not getattr(info, "_is_text_encoding", True):
        raise click.BadParameter(f"{value!r} is not a text encoding", ctx, param)
    return value


ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
    """``\\n``, ``\\t`` and ``\\\\`` typed in a shell (a backslash, then a letter) as the newline,
    tab and backslash they stand for; any other backslash is kept as it is."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in ESCAPES:
            out.append(ESCAPES[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def stop_strings(ctx, param, values) -> tuple[str, ...]:
    """--stop: each value with its typed escapes read (``--stop "\\n\\n"`` ends at a blank line)."""
    return tuple(unescape(v) for v in values)


def refuse_unused(ctx: click.Context, names: tuple[str, ...], mode: str) -> None:
    """Exit 2 if the user gave any of ``names`` (parameter names), which only ``mode`` reads: an
    option silently ignored would let a user believe it took effect. Whether it was given is
    where its value came from (command line, environment, --config), never the value itself."""
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    used = [flags[n] for n in names if ctx.get_parameter_source(n) in USER_SOURCES]
    if used:
        raise click.UsageError(f"{', '.join(used)} {'is' if len(used) == 1 else 'are'} for {mode}; "
                               f"drop {'it' if len(used) == 1 else 'them'} or add {mode.split(' (')[0]}")


def _json_kind(p: click.Parameter) -> str | None:
    """What JSON value --config may give option ``p`` (none for a type it leaves to click)."""
    if getattr(p, "is_flag", False):
        return "true or false"
    if isinstance(p.type, click.types.IntParamType):
        return "an integer"
    if isinstance(p.type, click.types.FloatParamType):
        return "a number"
    if isinstance(p.type, (click.types.StringParamType, click.Choice, click.Path)):
        return "a string"
    return None


def _is_kind(v, want: str) -> bool:
    """A JSON value of the kind ``want``: no silent coercion (true is not 1, 32.7 is not 32)."""
    if v is None:
        return True                                  # null: the option's "unset"
    return {"true or false": isinstance(v, bool),
            "an integer": isinstance(v, int) and not isinstance(v, bool),
            "a number": isinstance(v, (int, float)) and not isinstance(v, bool),
            "a string": isinstance(v, str)}[want]


def load_config_file(ctx, param, value):
    """--config FILE: option values as a JSON object: flat ({"n_layer": 6, "lr": 3e-4}), with
    optional "model" and "train" objects, or a run's own config.json (it has a "format" key),
    of which only the "model" and "train" objects are read: the rest of a run record is not an
    option. Options on the command line still win."""
    if value is None:
        return None
    try:
        obj = jsonio.parse(jsonio.read_text(Path(value)), str(value))
    except TbpError as e:
        raise click.BadParameter(str(e), ctx, param) from None
    if not isinstance(obj, dict):
        raise click.BadParameter(f"{value}: expected a JSON object of option values", ctx, param)
    sections = [obj.get("model") or {}, obj.get("train") or {}]
    if not all(isinstance(s, dict) for s in sections):
        raise click.BadParameter(f"{value}: \"model\" and \"train\" must be JSON objects", ctx, param)
    derived = {f.name for f in ModelConfig.flags()} - {f.name for f in ModelConfig.options()} | {"designs"}
    # a run's config.json keeps a design's options under its key: read back by their flat names
    sections[0] = {**sections[0], **_flat_designs(sections[0].get("designs"), value, ctx, param)}
    values = {} if "format" in obj else {k: v for k, v in obj.items() if k not in ("model", "train")}
    values.update({k: v for s in sections for k, v in s.items() if k not in derived})
    names = {p.name for p in ctx.command.params}
    unknown = sorted(k for k in values if k.replace("-", "_") not in names)
    if unknown:
        raise click.BadParameter(f"{value}: unknown keys {', '.join(unknown)}", ctx, param)
    params = {p.name: p for p in ctx.command.params}
    for k, v in values.items():
        want = _json_kind(params[k.replace("-", "_")])
        if want is not None and not _is_kind(v, want):
            raise click.BadParameter(f"{value}: {k} must be {want}, got {json.dumps(v)[:40]}", ctx, param)
    ctx.default_map = {**(ctx.default_map or {}), **{k.replace("-", "_"): v for k, v in values.items()}}
    return value


def _flat_designs(designs, value, ctx, param) -> dict:
    """A config.json's ``designs`` object ({key: {field: value}}) by the options' flat names."""
    if designs is None:
        return {}
    if not isinstance(designs, dict) or not all(isinstance(d, dict) for d in designs.values()):
        raise click.BadParameter(f"{value}: \"designs\" must be a JSON object of JSON objects", ctx, param)
    prefixes = {v.key: v.options.PREFIX for v in build.VARIANTS if v.options is not None}
    unknown = sorted(set(designs) - set(prefixes))
    if unknown:
        raise click.BadParameter(f"{value}: no design called {', '.join(unknown)} has options", ctx, param)
    return {prefixes[key] + name: v for key, d in designs.items() for name, v in d.items()}


# --- decoding strategies: the options and checks the commands that decode share -------------
USES = ("sample", "time", "show", "show instead")     # how a command uses a strategy (its switch's help)


def _click_option(f, default):
    """One click option for the Flag ``f`` (a config field) with this command's ``default``."""
    base = next((a for a in typing.get_args(f.kind) if a is not type(None)), f.kind)
    flag = "--" + f.name.replace("_", "-")
    if base is bool:
        decl = f.metadata["flag"] or f"{flag}/--no-{flag[2:]}"
        return click.option(decl, f.name, default=default, show_default=True, help=f.metadata["help"])
    return click.option(flag, f.name, type=_param_type(f, base), default=default,
                        show_default=default is not None, help=f.metadata["help"])


def strategy_options(use: str, **defaults):
    """A decorator giving a command that decodes the options of every registered decoding
    strategy (registry.STRATEGY: each declares its ``FLAGS``, the first its switch, the switch's
    ``HELP`` for each of :data:`USES`, and its ``SAMPLING_ONLY`` flags), with ``defaults`` for
    this command, and handing the command ``strategy=``: the one the user switched on, built
    and checked against the flags given, or None (dense decoding; then a companion flag given
    is a usage error). No strategy registered, no options: the command decodes densely."""
    if use not in USES:
        raise ValueError(f"a command uses a decoding strategy to one of {', '.join(USES)}, not {use!r}")
    chosen = []
    for name, cls in registry.STRATEGY.items():
        flags = [f for f in cls.FLAGS.flags() if use == "sample" or f.name not in cls.SAMPLING_ONLY]
        chosen.append((name, cls, flags))

    def wrap(fn):
        @functools.wraps(fn)
        def command(*args, **kw):
            ctx = click.get_current_context()
            on = []
            for name, cls, flags in chosen:
                values = {f.name: kw.pop(f.name) for f in flags}
                switch, companions = flags[0].name, tuple(f.name for f in flags[1:])
                if values[switch] is None:
                    refuse_unused(ctx, companions, "--" + switch.replace("_", "-"))
                    continue
                try:
                    on.append(cls.from_flags(values, {f.name for f in flags
                                                              if ctx.get_parameter_source(f.name) in USER_SOURCES}))
                except ValueError as e:
                    raise click.UsageError(str(e)) from None
            if len(on) > 1:
                raise click.UsageError("one decoding strategy at a time: "
                                       + ", ".join("--" + f[0].name for _, _, f in chosen))
            return fn(*args, strategy=on[0] if on else None, **kw)
        for name, cls, flags in reversed(chosen):
            for f in reversed(flags):
                help_ = cls.HELP[use] if f is flags[0] else f.metadata["help"]
                command = _click_option(f if f is not flags[0] else _with_help(f, help_),
                                        defaults.get(f.name, f.default))(command)
        return command
    return wrap


def _with_help(f, text: str):
    """The Flag ``f`` with another help text."""
    return dataclasses.replace(f, metadata={**f.metadata, "help": text})


def strategy_name(strategy) -> str:
    """The name a decoding strategy is registered under ("sparse" for a sparse rule)."""
    return next(name for name, cls in registry.STRATEGY.items() if isinstance(strategy, cls))


def strategy_record(strategy) -> dict:
    """Each registered strategy's JSON record for a command's --json output: the one in use as
    its ``record()``, the others None."""
    return {name: strategy.record() if isinstance(strategy, cls) else None for name, cls in registry.STRATEGY.items()}


def check_strategy(cfg: ModelConfig, strategy) -> None:
    """Usage errors of a strategy for this model: a variant that refuses it (its ``use``), or
    what its own ``check`` refuses (a selection layer past the model's)."""
    flag = "--" + strategy_name(strategy).replace("_", "-")
    why = build.refusal(cfg, strategy.use)
    if why is not None:
        raise click.UsageError(f"{flag}: {why}")
    try:
        strategy.check(cfg)
    except ValueError as e:
        raise click.UsageError(f"{flag}: {e}") from None
