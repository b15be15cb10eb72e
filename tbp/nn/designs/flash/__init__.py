"""FlashAttention (Dao et al. 2022; Dao 2023): exact attention in tiles, O(T) memory.

Its parts: ``flash.py`` (the tiled forward and backward, and the kernel object registered as
``--attn-impl flash``, which ``auto`` picks from the context it declares) and the declaration
below. Its plain twin is the dense kernel: the same numbers, every score kept."""
from ... import registry
from ...attention import CausalSelfAttention
from ...variant import Variant
from .flash import BLOCK_K, BLOCK_Q, FLASH_FROM_T, Flash, flash_backward, flash_forward

__all__ = ["BLOCK_K", "BLOCK_Q", "FLASH_FROM_T", "Flash", "flash_backward", "flash_forward", "VARIANT"]


def _tiled(C: int, H: int, causal: bool, rng, dtype):
    """An attention layer on the flash kernel in tiles of 2 query x 3 key rows (a gradcheck case)."""
    return CausalSelfAttention(C, H, 4, C // H, rng, dtype, True, causal, impl="flash", tiles=(2, 3))


VARIANT = registry.declare(Variant(
    key="flash", name="the flash kernel", active=lambda cfg: cfg.attn_kernel == "flash", axis="attn_impl",
    # one log-sum-exp per head and row instead of a T-long row of probabilities, and one
    # tile of scores and probabilities at a time
    activations=lambda cfg: cfg.n_layer * 2 * cfg.n_head * (1 - cfg.n_ctx) + 2 * cfg.n_head * BLOCK_K,
    # tiles of 2 query x 3 key rows over T = 5: several tiles, a partial one, the diagonal
    layer_cases=(("attention [flash]", lambda C, H, rng, dtype: _tiled(C, H, True, rng, dtype)),
                 ("attention [flash, non-causal]", lambda C, H, rng, dtype: _tiled(C, H, False, rng, dtype))),
    model_cases=(("gpt [flash]", {"attn_impl": "flash"}),),
))
