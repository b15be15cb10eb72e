"""RMSNorm: y = x r g, r = (mean(x^2) + eps)^(-1/2) over the C channels of a row.

Zhang & Sennrich, "Root Mean Square Layer Normalization" (NeurIPS 2019, arXiv 1910.07467):
a layer norm re-centres and re-scales; they found the re-centring can go, and the model trains
as well for fewer passes over the row. Llama kept it, and with it every small open model since.

With xhat = x r the normalised row (the gain g (C,) is the one parameter; no shift), the
backward over a row, from dy:

    dxhat = dy g
    dx    = r (dxhat - xhat mean(dxhat xhat))                                        (1)
    dg   += sum over rows of dy xhat

(1) because dr/dx_j = -r^3 x_j / C, so d(x_i r)/dx_j = r delta_ij - r xhat_i xhat_j / C and
dx_j = r dxhat_j - r xhat_j (sum_i dxhat_i xhat_i) / C. It is the layer norm's backward
(paper §5) without the term the mean brought, mean(dxhat).

Decoding folds the gain into the matrix that reads the norm exactly as a layer norm's
(layernorm.fold with no shift); a step's rows need four calls: square, mean plus eps (one
product with a column [1/C ... 1/C, eps] that reads the rows' constant 1), square root, divide.
"""
from __future__ import annotations

import numpy as np

from ... import gemm, init, registry
from ...layernorm import fold
from ...module import Module
from ...variant import Variant


@registry.norm("rms")
class RMSNorm(Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over channels.  x, y: (..., C); weight: (C,).

    A gain only, whatever the model's ``bias`` (RMSNorm has no shift). eps = 0 is allowed; then
    a row of zeros divides by zero, as the layer norm's constant row does.
    """

    def __init__(self, d: int, eps: float = 1e-5, dtype=np.float32):
        super().__init__()
        self.eps = eps
        self.param("weight", init.ones(d, dtype))
        self._avg = None

    @classmethod
    def from_config(cls, cfg, dtype) -> "RMSNorm":
        return cls(cfg.d_model, cfg.ln_eps, dtype)

    def _mean_eps_vector(self, dtype) -> np.ndarray:
        """(C + 1, 1) column [1/C, ..., 1/C, eps]: [x^2, 1] @ it = mean(x^2) + eps in one product."""
        avg = self._avg
        if avg is None or avg.dtype != dtype:
            C = self.params["weight"].shape[0]
            avg = self._avg = np.append(np.full(C, 1.0 / C), self.eps).astype(dtype)[:, None]
        return avg

    def forward(self, x: np.ndarray) -> np.ndarray:
        x2 = x.reshape(-1, x.shape[-1])                                    # (N, C)
        r = np.einsum("ij,ij->i", x2, x2)[:, None]                         # (N, 1) sum of x^2, no squared copy
        r *= x.dtype.type(1.0 / x2.shape[1])
        r += x.dtype.type(self.eps)
        np.sqrt(r, out=r)
        np.reciprocal(r, out=r)                                            # r = 1 / sqrt(mean(x^2) + eps)
        xhat = x2 * r                                                      # (N, C)
        self.cache = xhat, r
        return (xhat * self.params["weight"]).reshape(x.shape)

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """(1): dx = r (dy g - xhat mean(dy g xhat));  dweight += sum over rows of dy xhat."""
        xhat, r = self.cache                                               # (N, C), (N, 1)
        dy = dout.reshape(xhat.shape)
        w = self.params["weight"]
        dy_xhat = dy * xhat                                                # (N, C)
        if "weight" in self.grads:
            gemm.column_sums_add(self.grads["weight"], dy_xhat)
        # mean(dxhat xhat) with dxhat = dy g: a product of dy xhat with the column g / C
        mean_dxhat_xhat = np.dot(dy_xhat, (w * w.dtype.type(1.0 / w.shape[0])).reshape(-1, 1))   # (N, 1)
        dx = dy * w                                                        # dxhat
        dx -= np.multiply(xhat, mean_dxhat_xhat, out=dy_xhat)
        dx *= r
        self.cache = None
        return dx.reshape(dout.shape)

    # --- inference (decode.py) --------------------------------------------------------------
    def fold(self, W: np.ndarray, b: np.ndarray | None = None, col_scale=None) -> np.ndarray:
        """[xhat, 1] @ M == (rmsnorm(x) @ W + b) * col_scale: the gain scales W's rows (layernorm.fold)."""
        return fold(self.params["weight"], None, W, b, col_scale)

    def decode_vectors(self, dtype) -> tuple[np.ndarray]:
        return (self._mean_eps_vector(dtype),)

    @staticmethod
    def decode(rows, vectors) -> None:
        """rows.xa[:, :C] = rows.x / sqrt(mean(rows.x^2) + eps): four calls, whatever the rows
        (rows.sq's last column of ones brings in eps)."""
        (avg_eps,) = vectors
        np.multiply(rows.x, rows.x, out=rows.sq_c)
        np.dot(rows.sq, avg_eps, out=rows.std)                               # mean(x^2) + eps
        np.sqrt(rows.std, out=rows.std)
        np.divide(rows.x, rows.std, out=rows.xa_c)


VARIANT = registry.declare(Variant(
    key="rmsnorm", name="RMSNorm", active=lambda cfg: cfg.norm == "rms", axis="norm",
    summary="rms: RMSNorm, each row over its root mean square times a gain, no centring and no shift "
            "(Llama's).",
    switch="--norm rms",
    refuses={"export": "a GPT-2 folder's blocks are layer norms; it has no RMSNorm",
             "gguf": "llama.cpp's gpt2 and gptneox graphs normalise with a layer norm (a model of Llama "
                     "blocks exports as llama)"},
    describe=lambda cfg: ("norm", f"RMSNorm before each sublayer and the head · eps {cfg.ln_eps:g} · a gain, no shift"),
    layer_cases=(
        ("rmsnorm [eps 1e-5]", lambda C, H, rng, dtype: RMSNorm(C, 1e-5, dtype)),
        ("rmsnorm [eps 0.5]", lambda C, H, rng, dtype: RMSNorm(C, 0.5, dtype)),
    ),
    model_cases=lambda: (
        ("gpt [rmsnorm]", {"norm": "rms"}),
        ("gpt [rmsnorm, no biases, untied head]", {"norm": "rms", "bias": False, "tie_head": False}),
    ),
))
