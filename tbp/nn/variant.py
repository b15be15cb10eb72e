"""Variant: what a model variant declares about itself, so that the rest of tbp asks it instead
of testing config strings.

A variant is one choice on one of the model's axes -- an attention kind (Multi-Token Attention,
grouped-query attention), a residual scheme (Attention Residuals), positions (rotary), an
architecture (the encoder-decoder), a kernel (flash), a training option (dropout). Its module
declares one ``VARIANT`` into the registry (``registry.declare``; the core's training options
first), and ``build.VARIANTS`` is that list. From those declarations:

- ``ModelConfig`` refuses an option of a variant that is not switched on, any pair of variants
  one of which ``refuses`` the other (one message, written once, by the variant that knows
  why), and whatever the variant's own ``check`` refuses;
- ``build.refusal(cfg, use)`` answers the uses outside the model (``registry.USES``: sparse decoding,
  LoRA, chat, tbp bench) for the CLI, the runs and the decoder alike; the GPT-2 export
  (hf.py) gives every active variant's "export" reason, the GGUF export (gguf.py) its "gguf" one;
- ``tbp info`` shows each active variant's ``describe`` row; ``tbp.machine.memory`` adds its
  ``activations`` and ``step_work``; ``tbp gradcheck`` runs its ``layer_cases``,
  ``memory_cases`` and ``model_cases``.

So a new design is its folder in ``tbp/nn/designs/`` -- its layer or positions object, its
backward, its ``VARIANT`` (``registry.declare``), its registration on its axis
(``@registry.attention("name")``, ``@registry.positions("name")``, ...: the config's choices
and the command line's read the registry), its plain twin -- one import line in
``designs/__init__.py``, and its tests (tests/test_designs.py runs every registered positions
scheme and declaration through the same checks; ALiBi is the example).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Chart:
    """One heat map of a design's section of ``tbp view``: ``maps`` one 2-D grid, or one per
    head (the chart's menu picks the head); ``x``/``y`` the columns' and rows' labels (None:
    their indices); ``signed``: values of either sign, coloured red-blue about 0."""
    key: str
    title: str
    maps: list
    xlabel: str
    ylabel: str
    x: list | None = None
    y: list | None = None
    signed: bool = False


@dataclass(frozen=True)
class Section:
    """What a design draws of itself on ``tbp view``'s page: a heading, a line under it, its
    charts and what to look for in them."""
    title: str
    caption: str
    look_for: str
    charts: tuple[Chart, ...]


@dataclass(frozen=True)
class Variant:
    """One variant's declaration.

    key: the name other variants refuse it by ("mta", "rope", "flash", ...).
    name: how a reader calls it ("Multi-Token Attention").
    active: whether a config has it switched on.
    axis: the config field whose value switches it on ("attention"), if one does.
    summary: what choosing it on that axis means, one sentence that ends the axis's help
        ("mta: Multi-Token Attention, ...").
    options: its own options, an ``Options`` dataclass (config.py) in its folder: a config
        holds one (``cfg.designs[key]``), which must keep its defaults unless the variant is
        active (``switch`` says how to turn it on, "--attention mta").
    refuses: other variants' keys, or uses (registry.USES), mapped to the reason: "rope": "Multi-Token
        Attention uses learned positions here (...)".
    check: more validation of an active variant's config (raise ConfigError).
    describe: the ``tbp info`` row (label, text) of an active variant, or None.
    activations: numbers the training backward keeps per token beyond standard dense
        attention's (negative where it keeps fewer), for the memory estimate.
    step_work: (cfg, batch) -> (multiply-adds of one training step, what makes them, what to
        change), for work that can take minutes; refused above memory.STEP_WORK_LIMIT.
    layer_cases: gradcheck cases of the layer, (label, make(C, H, rng, dtype) -> module), or a
        function giving them (:meth:`cases`).
    part_cases: gradcheck cases of a part with an interface of its own, (label, make(rng,
        dtype) -> (module, f, backward)): f() the scalar, backward() runs the module's backward
        and gives [(name, input, its gradient)]; the module's parameters are probed too.
    memory_cases: gradcheck cases of a layer that also reads a memory m (B, S, C) with a
        padding key mask, ``forward(x, m, key_mask)`` (cross-attention), as layer_cases.
    model_cases: gradcheck cases of a small model, (label, config fields); an architecture
        that reads only pairs is checked on random pairs its collation lays out.
    inspect: (model, prompt ids) -> what ``tbp view`` shows of the design beyond the attention
        maps: {section: arrays, or dicts of them}, each section a part of the page's data.
    draw: (that data, as JSON lists) -> the :class:`Section` s that ``tbp view`` draws of it.
    convert: (base config, config) -> (trained model -> model of ``config``): how a trained
        model without the variant (or with other values of its options) becomes one with it,
        for a fine-tune that switches it on (``tbp train --init-from RUN`` with the variant's
        switch); raises ConfigError for a base it cannot convert. None: it cannot.
    """
    key: str
    name: str
    active: Callable
    axis: str = ""
    summary: str = ""
    options: type | None = None
    switch: str = ""
    refuses: dict[str, str] = field(default_factory=dict)
    check: Callable | None = None
    describe: Callable | None = None
    activations: Callable | None = None
    step_work: Callable | None = None
    layer_cases: tuple | Callable = ()
    memory_cases: tuple | Callable = ()
    part_cases: tuple | Callable = ()
    model_cases: tuple | Callable = ()
    inspect: Callable | None = None
    draw: Callable | None = None
    convert: Callable | None = None

    def __post_init__(self) -> None:
        if self.key in self.refuses:
            raise ValueError(f"variant {self.key!r} refuses itself")

    def cases(self, which: str) -> tuple:
        """Its ``layer_cases``, ``memory_cases``, ``part_cases`` or ``model_cases``. Either may be a function, asked
        here, once every design has registered: a case that combines another design lists it
        only where that design is there (``registry.has``), so removing one design leaves the
        others' cases whole."""
        found = getattr(self, which)
        return tuple(found() if callable(found) else found)
