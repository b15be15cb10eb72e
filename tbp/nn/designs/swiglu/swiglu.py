"""SwiGLU: y = c_proj(silu(x W_gate) * (x W_up)), silu(a) = a sigmoid(a).

Shazeer, "GLU Variants Improve Transformer" (arXiv 2002.05202): of the gated variants of the
feed-forward sublayer, the one gated by Swish (SiLU) gave the best perplexity at equal
parameters and compute; PaLM and Llama adopted it. Its width F is usually 8 C / 3, so that its
three matrices hold the 8 C^2 parameters of the 4 C-wide GELU MLP.

Here the gate's and the value's matrices are one Linear, ``c_fc`` (C, 2F) = [W_gate | W_up]:
one product forward and one backward read x once (a Hugging Face Llama's gate_proj and up_proj
are its two halves). With u = c_fc(x) = [a | b], s = sigmoid(a) and h = a s b:

    dh from c_proj's backward
    db = dh a s                                         (the value's half)
    da = dh b silu'(a),  silu'(a) = s (1 + a (1 - s))   (the gate's half)

(d(a s)/da = s + a s (1 - s), as sigmoid' = s (1 - s)). The sigmoid is (1 + tanh(a/2)) / 2,
which no input overflows. Decoding folds the norm into c_fc as the standard MLP does
(``fold``), then four element-wise calls and c_proj.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import registry
from ...config import Options, option
from ...linear import Linear, contraction, dot_contraction, weight_of
from ...mlp import own_nonlinearity
from ...module import DecodeState, Module
from ...variant import Variant

ROUND = 32           # the default width rounded up to a multiple of this: whole SIMD rows, 8 C / 3 kept


@dataclass(frozen=True)
class SwiGLUOptions(Options):
    """SwiGLU's own option (``cfg.designs["swiglu"]``), flag ``--swiglu-hidden``."""
    PREFIX = "swiglu_"
    hidden: int = option(0, "SwiGLU: F, the width of its gate and its value (0: 8 C / 3 rounded up to a multiple "
                            "of 32, the standard MLP's parameters).", min=0, max=65536)


def hidden_width(cfg) -> int:
    """F: the option's, or 8 C / 3 rounded up to a multiple of ROUND."""
    return cfg.designs["swiglu"].hidden or -(-8 * cfg.d_model // (3 * ROUND)) * ROUND


def sigmoid(a: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = sigmoid(a) = (1 + tanh(a / 2)) / 2, in four calls and without overflow."""
    half = a.dtype.type(0.5)
    np.multiply(a, half, out=out)
    np.tanh(out, out=out)
    out *= half
    out += half
    return out


@registry.mlp("swiglu")
class SwiGLU(Module):
    """y = c_proj(silu(a) * b), [a | b] = c_fc(x).  x, y: (B, T, C); c_fc.weight: (C, 2F) (the
    gate's F columns, then the value's); c_proj.weight: (F, C)."""

    def __init__(self, d_model: int, hidden: int, rng: np.random.Generator, dtype=np.float32, bias: bool = True,
                 proj_std: float = 0.02):
        super().__init__()
        self.hidden = hidden
        self.c_fc = Linear(d_model, 2 * hidden, rng, dtype, bias)
        self.c_proj = Linear(hidden, d_model, rng, dtype, bias, std=proj_std)

    @classmethod
    def from_config(cls, cfg, rng: np.random.Generator, dtype, proj_std: float) -> "SwiGLU":
        return cls(cfg.d_model, hidden_width(cfg), rng, dtype, cfg.bias, proj_std)

    def forward(self, x: np.ndarray) -> np.ndarray:
        F = self.hidden
        u = self.c_fc.forward(x)                                           # (B, T, 2F)
        u2 = u.reshape(-1, 2 * F)
        a, b = u2[:, :F], u2[:, F:]
        s = sigmoid(a, np.empty_like(a))                                   # (N, F)
        h = a * s
        h *= b                                                             # silu(a) b
        self.cache = u2, s
        return self.c_proj.forward(h.reshape(*x.shape[:-1], F))

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """db = dh silu(a);  da = dh b s (1 + a (1 - s))."""
        F = self.hidden
        u2, s = self.cache
        a, b = u2[:, :F], u2[:, F:]
        dh = self.c_proj.backward(dout).reshape(-1, F)                     # (N, F)
        du = np.empty_like(u2)
        silu = np.multiply(a, s, out=du[:, F:])                            # silu(a)
        np.multiply(silu, s, out=du[:, :F])                                # scratch: silu(a) s
        dsilu = s                                                          # s is not needed again:
        dsilu += silu
        dsilu -= du[:, :F]                                                 # s + a s (1 - s)
        silu *= dh                                                         # db = dh silu(a)
        np.multiply(dh, b, out=du[:, :F])
        du[:, :F] *= dsilu                                                 # da
        self.cache = None
        return self.c_fc.backward(du.reshape(*dout.shape[:-1], 2 * F))

    # --- inference (decode.py) --------------------------------------------------------------
    def fold(self, ln) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(c_fc with ``ln`` folded in (C+1, 2F), c_proj's weight transposed (C, F) as decoding
        reads it (linear.contraction), its bias or None)."""
        fc = ln.fold(weight_of(self.c_fc), self.c_fc.params.get("bias"))
        return fc, contraction(self.c_proj), self.c_proj.params.get("bias")

    def decode_state(self, ln, batch: int, n_ctx: int, dtype) -> DecodeState:
        """The folded weights, and the rows of u = [a | b] (N, 2F), the sigmoid and h (N, F)."""
        F = self.hidden
        return DecodeState(lambda: self.fold(ln), lambda Tn: (np.empty((batch * Tn, 2 * F), dtype),
                                                              np.empty((batch * Tn, F), dtype),
                                                              np.empty((batch * Tn, F), dtype)))

    def decode(self, rows, state: DecodeState, step) -> None:
        """rows.out = c_proj(silu(a) b), [a | b] = rows.xa @ the folded c_fc."""
        fc, proj_t, proj_b = state.folded
        u, s, h = state.scratch(step.t1 - step.t0)
        F = self.hidden
        np.dot(rows.xa, fc, out=u)                                         # (N, 2F)
        a = u[:, :F]
        np.multiply(a, sigmoid(a, s), out=h)
        h *= u[:, F:]
        dot_contraction(h, proj_t, rows.out)                               # (N, C)
        if proj_b is not None:
            rows.out += proj_b


def _llama_block() -> tuple:
    """The Llama family's block, where its designs are there: RMSNorm, SwiGLU, rotary positions,
    grouped-query attention, no biases, an untied head without one."""
    fields = {"mlp": "swiglu", "bias": False, "tie_head": False, "head_bias": False}
    for axis, name, extra in (("norm", "rms", {"norm": "rms"}), ("positions", "rope", {"positions": "rope"}),
                              ("attention", "gqa", {"attention": "gqa", "n_kv_head": 1})):
        if registry.has(axis, name):
            fields.update(extra)
    return (("gpt [swiglu in a Llama-family block]", fields),)


VARIANT = registry.declare(Variant(
    key="swiglu", name="SwiGLU", active=lambda cfg: cfg.mlp == "swiglu", axis="mlp",
    summary="swiglu: a gated MLP, c_proj(silu(x W_gate) * x W_up), F wide (--swiglu-hidden; Llama's).",
    options=SwiGLUOptions, switch="--mlp swiglu", check=own_nonlinearity("--mlp swiglu", "SwiGLU's gate is SiLU"),
    refuses={"export": "a GPT-2 folder's MLP is c_fc, GELU, c_proj; it has no gate",
             "gguf": "llama.cpp's gpt2 and gptneox graphs have an ungated MLP (a model of Llama blocks exports "
                     "as llama)"},
    describe=lambda cfg: ("mlp", f"SwiGLU, c_proj(silu(a) * b) · F = {hidden_width(cfg)}"),
    # per token and layer: u (2F), the sigmoid (F) and c_proj's input (F), where the standard
    # MLP keeps u, its gate and c_proj's input, 4 C each
    activations=lambda cfg: cfg.n_layer * (4 * hidden_width(cfg) - 12 * cfg.d_model),
    layer_cases=(
        ("mlp [swiglu, F 12]", lambda C, H, rng, dtype: SwiGLU(C, 12, rng, dtype)),
        ("mlp [swiglu, F 5, no biases]", lambda C, H, rng, dtype: SwiGLU(C, 5, rng, dtype, bias=False)),
    ),
    model_cases=lambda: (
        ("gpt [swiglu]", {"mlp": "swiglu"}),
        ("gpt [swiglu, F 12, no biases]", {"mlp": "swiglu", "swiglu_hidden": 12, "bias": False}),
        *_llama_block(),
    ),
))
