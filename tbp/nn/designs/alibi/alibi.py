"""ALiBi: attention with linear biases (Press, Smith & Lewis, ICLR 2022, arXiv 2108.12409).

No vector per position is added to the input. Instead each head h adds to its scaled scores a
penalty proportional to the distance between query i and key j:

    S[h, i, j] = q_i . k_j / sqrt(Dk) - m_h (i - j),      j <= i,

with a fixed slope m_h per head, a geometric sequence: for H a power of two,
m_h = 2^(-8h/H), h = 1 .. H (1/2, 1/4, ... 1/256 for 8 heads); for other H, the slopes of the
power of two below H, then every other slope of the one above, as the paper does. Near keys
weigh more, and the slopes differ, so heads look at different ranges.

The bias is a constant of the positions: it has no parameter, and since it enters S additively
the backward of attention is the same closed form (dS does not see it). The kernels add it
where they add the mask (positions.py, kernels.py, designs/flash); decoding adds it against the
positions its cache slots hold. As with rotary positions, a sequence longer than the context
is read as a sliding window of n_ctx positions, and generation slides past the context.
"""
from __future__ import annotations

import math

import numpy as np

from ... import registry
from ...attention import CausalSelfAttention
from ...positions import Positions
from ...variant import Variant


def slopes(n_head: int) -> np.ndarray:
    """m (H,): the heads' slopes, 2^(-8h/H) for H a power of two (the paper's rule otherwise)."""
    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]
    p = 2 ** int(math.floor(math.log2(n_head)))
    m = geometric(p)
    if p < n_head:
        m += geometric(2 * p)[0::2][:n_head - p]
    return np.array(m, dtype=np.float64)


class Alibi(Positions):
    """Linear biases for ``n_head`` heads: bias(rows, keys) = -m_h (rows_i - keys_j)."""

    embeds = False
    rotates = False

    def __init__(self, n_head: int):
        self.n_head = n_head
        self.slopes = slopes(n_head)
        self._cast: dict = {}

    def bias(self, rows: np.ndarray, keys: np.ndarray, dtype) -> np.ndarray:
        """(..., H, Tq, Tk) = -m_h (rows[..., i] - keys[j]) for queries at ``rows`` (..., Tq)
        and keys at ``keys`` (Tk,). The distances are integers and the slopes powers of two
        (for H a power of two), so the products are exact in float32. Past the query (j > i)
        the term is positive; the causal mask hides those keys."""
        m = self._cast.get(np.dtype(dtype))
        if m is None:
            m = self._cast[np.dtype(dtype)] = self.slopes.astype(dtype)[:, None, None]    # (H, 1, 1)
        distance = (np.asarray(rows)[..., None, :, None] - np.asarray(keys)).astype(dtype)   # (..., 1, Tq, Tk)
        return -m * distance


@registry.positions("alibi")
def _alibi(cfg) -> Alibi:
    return Alibi(cfg.n_head)


VARIANT = registry.declare(Variant(
    key="alibi", name="ALiBi positions", active=lambda cfg: cfg.positions == "alibi", axis="positions",
    switch="--positions alibi",
    summary="alibi: a linear bias on the scores by distance, slopes per head (no vector per position).",
    describe=lambda cfg: ("alibi", f"linear biases, slopes {slopes(cfg.n_head)[0]:g} .. {slopes(cfg.n_head)[-1]:g} "
                                   f"· past the context of {cfg.n_ctx}, a sliding window"),
    refuses={"mta": "Multi-Token Attention uses learned positions here (ALiBi's bias is not wired into its "
                    "convolved scores)",
             "encoder-decoder": "an encoder-decoder uses learned positions (ALiBi is for the decoder-only GPT)",
             "thin": "sparse decoding gathers kept positions without their ALiBi bias: use dense decoding",
             "export": "GPT-2 learns a vector per position; it has no linear bias on the scores",
             "gguf": "tbp writes llama.cpp's gpt2 and gptneox graphs, neither of which has ALiBi's bias"},
    layer_cases=lambda: (
        ("attention [alibi]", lambda C, H, rng, dtype: CausalSelfAttention(C, H, 4, C // H, rng, dtype,
                                                                           positions=Alibi(H))),
        ("attention [alibi, causal query blocks, 3 heads]",
         lambda C, H, rng, dtype: CausalSelfAttention(C, 3, 2, 2, rng, dtype, split_rows=2, positions=Alibi(3))),
        # with the flash kernel and grouped-query attention, where those designs are there
        *((("attention [alibi, flash in tiles, window 3]",
            lambda C, H, rng, dtype: CausalSelfAttention(C, H, 4, C // H, rng, dtype, impl="flash", tiles=(2, 3),
                                                         positions=Alibi(H), window=3)),)
          * registry.has("kernel", "flash")),
        *((("attention [gqa + alibi]",
            lambda C, H, rng, dtype: registry.ATTENTION["gqa"](C, 4, 2, C // 4, rng, dtype, 2, positions=Alibi(4))),)
          * registry.has("attention", "gqa"))),
    model_cases=lambda: (("gpt [alibi]", dict(positions="alibi")),
                         *((("gpt [alibi, gqa, untied head]", dict(positions="alibi", attention="gqa", n_head=4,
                                                                   n_kv_head=2, tie_head=False)),)
                           * registry.has("attention", "gqa"))),
))
