"""ReLU²: y = c_proj(relu(u)^2), u = c_fc(x).

So et al., "Primer: Searching for Efficient Transformers" (arXiv 2109.08668), found squaring
the ReLU the single change that most cut a language model's training cost in their search;
Keller Jordan's modded-nanogpt speedruns adopted it in place of GELU. It is the standard MLP's
two matrices (4 C wide) with another nonlinearity, so the parameters and the products are the
standard MLP's; what changes is the element-wise work (two passes instead of GELU's nine) and
what the backward keeps (u only: relu(u) is recomputed from it).

With r = relu(u) and g = r^2, given dg from c_proj's backward:

    du = dg * 2 r                    (d(r^2)/du = 2 r, and r' = [u > 0] is already in r)

The derivative is continuous (it is 2 relu(u)), so centred differences check it everywhere
but exactly at 0, where no random input lands.
"""
from __future__ import annotations

import numpy as np

from ... import registry
from ...linear import dot_contraction
from ...mlp import MLP, own_nonlinearity
from ...module import DecodeState
from ...variant import Variant


def relu2(u: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = relu(u)^2, in two calls (``out`` may be ``u``)."""
    np.maximum(u, 0, out=out)
    out *= out
    return out


@registry.mlp("relu2")
class ReLU2MLP(MLP):
    """y = c_proj(relu(c_fc(x))^2).  x, y: (B, T, C); c_fc.weight: (C, 4C); c_proj.weight: (4C, C).
    The standard MLP's weights, folding and decode scratch; its nonlinearity is ReLU²."""

    @classmethod
    def from_config(cls, cfg, rng: np.random.Generator, dtype, proj_std: float) -> "ReLU2MLP":
        return cls(cfg.d_model, rng, dtype, cfg.bias, "relu2", proj_std)

    def forward(self, x: np.ndarray) -> np.ndarray:
        u = self.c_fc.forward(x)                                           # (B, T, 4C)
        self.cache = u
        return self.c_proj.forward(relu2(u, np.empty_like(u)))

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """du = dg * 2 relu(u), built in u's memory (u is not needed again)."""
        dg = self.c_proj.backward(dout)                                    # (B, T, 4C)
        u = self.cache
        np.maximum(u, 0, out=u)
        u *= u.dtype.type(2)
        dg *= u
        self.cache = None
        return self.c_fc.backward(dg)

    def decode(self, rows, state: DecodeState, step) -> None:
        """rows.out = c_proj(relu(u)^2), u = rows.xa @ the folded c_fc."""
        fc, proj_t, proj_b = state.folded
        u, g = state.scratch(step.t1 - step.t0)
        np.dot(rows.xa, fc, out=u)                                         # (N, 4C)
        dot_contraction(relu2(u, g), proj_t, rows.out)                     # (N, C)
        if proj_b is not None:
            rows.out += proj_b


VARIANT = registry.declare(Variant(
    key="relu2", name="ReLU²", active=lambda cfg: cfg.mlp == "relu2", axis="mlp",
    summary="relu2: the standard MLP with relu(u)^2 in place of GELU (Primer's; the speedruns').",
    switch="--mlp relu2", check=own_nonlinearity("--mlp relu2", "ReLU² is relu(u) squared"),
    refuses={"export": "a GPT-2 folder's MLP activation is GELU; transformers has no relu(u)^2 for GPT-2",
             "gguf": "llama.cpp's gpt2 and gptneox MLPs use GELU"},
    describe=lambda cfg: ("mlp", "ReLU², c_proj(relu(c_fc(x))^2) · 4 C wide"),
    # per token and layer the backward keeps u and c_proj's input (4 C each), where the standard
    # MLP also keeps GELU's gate (4 C more)
    activations=lambda cfg: -4 * cfg.n_layer * cfg.d_model,
    layer_cases=(
        ("mlp [relu2]", lambda C, H, rng, dtype: ReLU2MLP(C, rng, dtype)),
        ("mlp [relu2, no biases]", lambda C, H, rng, dtype: ReLU2MLP(C, rng, dtype, bias=False)),
    ),
    model_cases=(
        ("gpt [relu2]", {"mlp": "relu2"}),
        ("gpt [relu2, no biases, untied head]", {"mlp": "relu2", "bias": False, "tie_head": False}),
    ),
))
