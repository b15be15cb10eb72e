"""The expand-and-contract sublayer: c_fc -> GELU or ReLU -> c_proj.   [paper §7]"""
from __future__ import annotations

import numpy as np

from . import registry
from .config import ConfigError
from .linear import Linear, contraction, dot_contraction, weight_of
from .module import DecodeState, Module

GELU_K = np.sqrt(2.0 / np.pi)
GELU_A = 0.044715
BLOCK_ELEMENTS = 1 << 16            # 256 KiB of float32: a row block's arrays stay in L2 together
_CONSTANTS: dict = {}


def _constants(dtype) -> dict:
    """GELU's constants as scalars of ``dtype``, made once (not per call: decoding is per call)."""
    c = _CONSTANTS.get(dtype)
    if c is None:
        f, k, a = np.dtype(dtype).type, GELU_K, GELU_A
        c = _CONSTANTS[dtype] = {"ka": f(k * a), "k": f(k), "1/2": f(0.5), "2k": f(2 * k), "6ka": f(6 * k * a)}
    return c


def gelu_gate(u: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = (1 + tanh z) / 2, z = k (u + a u^3), so that gelu(u) = u * out (GPT-2's tanh GELU).

    The one GELU formula of the code base: training and decoding both call it, and the
    backward needs only u and this gate. Built in place in ``out``: seven calls, no temporary,
    and no overflow anywhere (tanh saturates).
    """
    c = _constants(u.dtype)
    np.multiply(u, u, out=out)
    out *= c["ka"]
    out += c["k"]
    out *= u                                                               # z = k (u + a u^3)
    np.tanh(out, out=out)
    out *= c["1/2"]
    out += c["1/2"]
    return out


def row_blocks(rows: int, width: int):
    """Slices of ``rows`` in blocks of about BLOCK_ELEMENTS elements (at least one row each).

    GELU is 8-9 element-wise passes over a (N, 4C) array; on a wide model that array is
    megabytes, so pass after pass would stream it from memory. Done a block of rows at a
    time, every pass after the first reads the block from cache. The result is the same bit
    for bit: each element sees the same operations in the same order.
    """
    if rows * width <= 4 * BLOCK_ELEMENTS:        # small enough already: blocks would only add calls
        yield slice(0, rows)
        return
    step = max(1, BLOCK_ELEMENTS // max(1, width))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def gelu_forward(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gelu(u), gate s) for u (N, W), gelu(u) = u s, one row block at a time."""
    s, g = np.empty_like(u), np.empty_like(u)
    for rows in row_blocks(*u.shape):
        np.multiply(u[rows], gelu_gate(u[rows], s[rows]), out=g[rows])
    return g, s


def gelu_backward(u: np.ndarray, s: np.ndarray, dg: np.ndarray) -> None:
    """dg *= dgelu/du in place, from u and the gate s (N, W) of ``gelu_forward``; u is overwritten.

    g = u s with s = (1 + tanh z)/2, z = k (u + a u^3), so, as 1 - tanh^2 z = 4 s (1 - s):
    dg/du = s + u s (1 - s) 2k (1 + 3a u^2)   (= (1 + tanh z)/2 + u/2 (1 - tanh^2 z) dz/du).
    """
    c = _constants(u.dtype)
    blocks = list(row_blocks(*u.shape))
    dz = np.empty_like(u[blocks[0]])                                       # one block's scratch
    for rows in blocks:
        ub, dzb = u[rows], dz[:rows.stop - rows.start]
        np.multiply(ub, ub, out=dzb)
        dzb *= c["6ka"]
        dzb += c["2k"]
        dzb *= ub                                                          # u dz/du 2 = 2k u (1 + 3a u^2)
        # dg/du = s (1 + dz (1 - s)), in u's memory: u is not needed again
        dg_du = np.subtract(1, s[rows], out=ub)
        dg_du *= dzb
        dg_du += 1
        dg_du *= s[rows]
        dg[rows] *= dg_du


@registry.mlp("standard")
class MLP(Module):
    """y = c_proj(g(c_fc(x))).  x, y: (B, T, C); c_fc.weight: (C, 4C); c_proj.weight: (4C, C).

    g is GPT-2's tanh-approximated GELU, g(u) = u/2 (1 + tanh(k (u + a u^3))), or ReLU.
    """

    def __init__(self, d_model: int, rng: np.random.Generator, dtype=np.float32, bias: bool = True,
                 activation: str = "gelu", proj_std: float = 0.02):
        super().__init__()
        self.activation = activation
        self.c_fc = Linear(d_model, 4 * d_model, rng, dtype, bias)
        self.c_proj = Linear(4 * d_model, d_model, rng, dtype, bias, std=proj_std)

    @classmethod
    def from_config(cls, cfg, rng: np.random.Generator, dtype, proj_std: float) -> "MLP":
        return cls(cfg.d_model, rng, dtype, cfg.bias, cfg.activation, proj_std)

    def forward(self, x: np.ndarray) -> np.ndarray:
        u = self.c_fc.forward(x)                                           # (B, T, 4C)
        if self.activation == "relu":
            self.cache = u
            return self.c_proj.forward(np.maximum(u, 0))
        u2 = u.reshape(-1, u.shape[-1])                                    # (N, 4C)
        g, s = gelu_forward(u2)
        self.cache = u2, s
        return self.c_proj.forward(g.reshape(u.shape))

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """[paper §7, FC_expand > g > FC_contract]  GELU: see ``gelu_backward``.
        ReLU: dg/du = [u > 0].
        """
        dg = self.c_proj.backward(dout)                                    # (B, T, 4C)
        if self.activation == "relu":
            u = self.cache
            dg *= u > 0
            return self.c_fc.backward(dg)
        u2, s = self.cache                                                 # (N, 4C) each
        dg2 = dg.reshape(u2.shape)                       # what the in-place update writes is what goes on
        gelu_backward(u2, s, dg2)
        self.cache = None
        return self.c_fc.backward(dg2)

    # --- inference (decode.py) --------------------------------------------------------------
    def fold(self, ln) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(c_fc with ``ln`` folded in (C+1, 4C), c_proj's weight transposed (C, 4C) as
        decoding reads it (linear.contraction), its bias or None)."""
        fc = ln.fold(weight_of(self.c_fc), self.c_fc.params.get("bias"))
        return fc, contraction(self.c_proj), self.c_proj.params.get("bias")

    def decode_state(self, ln, batch: int, n_ctx: int, dtype) -> DecodeState:
        """The folded weights, and the (N, 4C) rows of c_fc's output u and the activation g."""
        d = self.c_fc.d_out
        return DecodeState(lambda: self.fold(ln), lambda Tn: (np.empty((batch * Tn, d), dtype),
                                                              np.empty((batch * Tn, d), dtype)))

    def decode(self, rows, state: DecodeState, step) -> None:
        """rows.out = c_proj(g(c_fc(rows.xa))), with rows.xa = [xhat, 1] from the layer norm."""
        fc, proj_t, proj_b = state.folded
        u, g = state.scratch(step.t1 - step.t0)
        np.dot(rows.xa, fc, out=u)                                         # (N, 4C)
        if self.activation == "relu":
            np.maximum(u, 0, out=g)
        else:
            np.multiply(u, gelu_gate(u, g), out=g)
        dot_contraction(g, proj_t, rows.out)                               # (N, C)
        if proj_b is not None:
            rows.out += proj_b


def own_nonlinearity(switch: str, nonlinearity: str):
    """The check of an MLP design whose nonlinearity is its own (``switch`` names the design,
    ``nonlinearity`` says what it is): --activation chooses the standard MLP's, and must stay
    at its default beside it."""
    def check(cfg) -> None:
        if cfg.activation != "gelu":
            raise ConfigError(f"--activation {cfg.activation} chooses the standard MLP's nonlinearity; {nonlinearity} "
                              f"(leave --activation at its default with {switch})")
    return check
