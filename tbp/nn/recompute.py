"""Activation recomputation (activation checkpointing; Chen et al., arXiv 1604.06174): the
forward keeps each block's input and nothing else of the block; the backward runs each block's
forward again from that input, just before the block's backward reads what it keeps.

Memory: the activations of one block at a time, plus L inputs (B, T, C), instead of all L
blocks'. Time: one more forward of the blocks, a quarter to a third more per step. At GPT-2
124M's B 4 x T 1024 a full fine-tuning step peaks at 3.3 GiB instead of 7.1, 24 % slower
(benchmarks/speed/recompute_memory.py). The gradients are the same numbers: the recomputed forward is
the same calls on the same inputs, and dropout's masks are drawn again from each row's
generator where the first forward drew them (``Noise.state``/``restore``).

Only the residual sum keeps a block's input as one array; Attention Residuals' blocks read every
earlier block, and the encoder-decoder has two stacks: both refuse it.
"""
from __future__ import annotations

from . import registry
from .variant import Variant

# memory.step_activation_bytes counts it: one block's share of the stack's activations, plus L inputs (B, T, C)


VARIANT = registry.declare(Variant(
    key="recompute", name="activation recomputation", active=lambda cfg: cfg.recompute, axis="recompute",
    describe=lambda cfg: ("recompute", "each block's forward run again in the backward: one block's activations "
                                       "kept at a time"),
    model_cases=(("gpt [recompute]", dict(n_layer=2, recompute=True)),
                 ("gpt [recompute, dropout 0.1]", dict(n_layer=2, recompute=True, dropout=0.1))),
), rank=1)
