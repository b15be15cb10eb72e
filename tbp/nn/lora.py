"""LoRA on a built model: which layers can take an adapter, wrapping them, and folding the
adapters back in.   [paper §6]

The adapter itself (``y = x W + b + (alpha/r) x D U`` and its backward) is ``linear.LoRA``; this
module only walks a model's blocks to put adapters in place and take them out again.
"""
from __future__ import annotations

import numpy as np

from .gpt import GPT
from .linear import LoRA

LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "lm_head")


def add_lora(model: GPT, rank: int, alpha: float, targets=LORA_TARGETS[:4],
             seed: int = 0) -> list[str]:
    """Freeze the whole model, then wrap each targeted Linear in a LoRA adapter.   [paper §6]

    targets: names from LORA_TARGETS; "lm_head" needs an untied head. Returns the dotted names
    of the adapted layers. Only ``lora_down``/``lora_up`` remain in ``model.grads``.
    """
    rng = np.random.default_rng(seed)
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"unknown LoRA target {unknown[0]!r}; choose from {', '.join(LORA_TARGETS)}")
    if not targets:
        raise ValueError("LoRA needs at least one target layer")
    if "lm_head" in targets and model.lm_head is None:
        raise ValueError("LoRA target 'lm_head' needs an untied head; this model's head is wte (tied)")
    model.freeze()
    adapted = []
    for i, block in enumerate(model.blocks):
        for target in targets:
            if target == "lm_head":
                continue
            sub, name = target.split(".")
            parent = getattr(block, sub)
            setattr(parent, name, LoRA(getattr(parent, name), rank, alpha, rng))
            adapted.append(f"h.{i}.{target}")
    if "lm_head" in targets:
        model.lm_head = LoRA(model.lm_head, rank, alpha, rng)
        adapted.append("lm_head")
    model.pack()
    return adapted


def merge_lora(model: GPT) -> GPT:
    """Fold every adapter into its base weight, in place of the LoRA layer: a plain GPT again,
    with every parameter trainable."""
    for _, module in list(model.modules()):
        for attr, child in list(vars(module).items()):
            if isinstance(child, LoRA):
                setattr(module, attr, child.merged_linear())
    for _, m in model.modules():
        for k, p in m._params.items():
            m._grads[k] = np.zeros_like(p)
    model.pack()
    return model


