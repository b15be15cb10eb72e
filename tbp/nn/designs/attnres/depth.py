"""The depth attention of Attention Residuals: one operation's softmax over the sources.
[Kimi Team, arXiv 2603.15031; the scheme that places these operations is attnres.py]

A pre-LN stack adds every sublayer's output into one running sum, so sublayer l reads
``v_0 + v_1 + ... + v_{l-1}`` (v_0 the embedding, v_i the i-th sublayer's output; attention and
MLP are separate sublayers). Attention Residuals replace the fixed sum by a per-token softmax
over the sources, with one learned pseudo-query w_l per operation:

    h_l = sum_i alpha_i v_i,   alpha = softmax_i(w_l . RMSNorm_g(v_i)),   RMSNorm_g(v) = g * v / r(v),
    r(v) = sqrt(mean_c v^2 + eps)

(no 1/sqrt(C); the softmax runs over depth, separately at every position). The query does not
depend on the input; the keys are the RMS-normalised sources, the values the raw ones. With
w = 0 (the initialisation) every input is the plain mean of its sources.

``residual_query_scale`` c (default 1, the paper's) multiplies the logits, q = c g w: under
Adam, whose step does not depend on the gradient's scale, a pseudo-query starting at zero then
learns at c times the shared rate -- the depth softmax's own rate; c = 0 freezes it at zero,
every input the mean of its sources: the sum's function up to LayerNorm's epsilon.

Backward [derived; ``u_i = v_i / r_i``, ``q = g * w``, so ``z_i = q . u_i``]:

    dalpha_i = dh . v_i                          dz_i = alpha_i (dalpha_i - sum_j alpha_j dalpha_j)
    dq = sum_i dz_i u_i                          dw += c dq * g,  dg += c dq * w
    dv_i += alpha_i dh + dz_i (q - z_i u_i / C) / r_i

Each source feeds every later operation, so its gradient is a sum over consumers: ``backward``
adds into the caller's arrays. The terms that depend on the source alone wait until every
reader is done (:class:`Reads`): summed over all its readers they are two matrix products, not
a pass per reader.
"""
from __future__ import annotations

import numpy as np

from ... import init
from ...module import Module


def rms_inverse(v: np.ndarray, eps: float) -> np.ndarray:
    """1 / sqrt(mean_c v^2 + eps) of each row of v (N, C): (N,)."""
    ms = np.einsum("nc,nc->n", v, v)
    ms /= v.shape[1]
    ms += v.dtype.type(eps)
    return np.reciprocal(np.sqrt(ms, out=ms), out=ms)


class Sources:
    """What the next operation reads, as (value (N, C), 1 / RMS (N,)) pairs: the embedding, the
    finished blocks' sums, then the current block's partial sum (if the block has begun).

    ``add(v)`` records a sublayer's output. Each source's RMS is computed once, when it is made,
    however many later operations read it.
    """

    def __init__(self, x0: np.ndarray, block_size: int, eps: float):
        self.block_size, self.eps = block_size, eps
        self.blocks = [(x0, rms_inverse(x0, eps))]
        self.partial = None
        self.count = 0

    def current(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return list(self.blocks) if self.partial is None else self.blocks + [self.partial]

    def add(self, v: np.ndarray) -> None:
        total = v if self.partial is None else self.partial[0] + v
        self.partial = (total, rms_inverse(total, self.eps))
        self.count += 1
        if self.count % self.block_size == 0:
            self.blocks.append(self.partial)
            self.partial = None


class StackedSources:
    """The sources for decoding, side by side in one buffer (slots, N, C): slot 0 the embedding,
    slots 1 .. n-1 the finished blocks, slot n the partial sum of block n while it is open (it
    becomes the block when it closes). No backward reads them, so the partial sum is updated
    in place, and an operation is a few calls over the slots it reads, whatever the depth: the
    cost of a decoding step is the number of calls. The sources' RMS is recomputed by each
    operation, one product over every slot (K x C numbers a token), rather than kept per source
    (five calls each)."""

    def __init__(self, x0: np.ndarray, n_sublayers: int, block_size: int, eps: float):
        N, C = x0.shape
        slots = n_sublayers // block_size + 1
        self.v = np.empty((slots, N, C), x0.dtype)
        self.v[0] = x0
        self.block_size = block_size
        self.eps, self.inv_c = x0.dtype.type(eps), x0.dtype.type(1 / C)
        self.n, self.count, self.open = 1, 0, False

    def add(self, out: np.ndarray) -> None:
        if self.open:
            self.v[self.n] += out
        else:
            self.v[self.n] = out
        self.count += 1
        self.open = self.count % self.block_size != 0
        if not self.open:
            self.n += 1

    def mix(self, q: np.ndarray, out: np.ndarray) -> None:
        """out (N, C) = the softmax over depth, with query q = g * w (C,), of the sources read now."""
        v = self.v[:self.n + self.open]                               # (K, N, C)
        z = np.dot(v, q)                                              # (K, N)
        ms = np.einsum("knc,knc->kn", v, v)
        ms *= self.inv_c
        ms += self.eps
        z /= np.sqrt(ms, out=ms)                                      # q . v_i / r_i
        z -= z.max(axis=0)
        e = np.exp(z, out=z)
        if e.shape[1] == 1:                                           # one row: a vector-matrix product
            np.dot(e[:, 0], v[:, 0], out=out[0])
        else:
            np.einsum("kn,knc->nc", e, v, out=out)
        out /= e.sum(axis=0)[:, None]


class DepthAttention(Module):
    """One AttnRes operation: h (N, C) = sum_i alpha_i v_i over K sources v_i (N, C).

    Parameters: ``query`` w (C,), zero at initialisation; ``gain`` g (C,) of the keys' RMSNorm.
    ``scale`` c: the logits' factor, q = c g w (1: the paper's).
    """

    def __init__(self, d: int, eps: float = 1e-5, dtype=np.float32, scale: float = 1.0):
        super().__init__()
        self.eps, self.scale = eps, scale
        self.param("query", init.zeros(d, dtype))
        self.param("gain", init.ones(d, dtype))

    def mix(self, sources) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(h, z, alpha, q) for sources [(v_i, 1/r_i)]: z, alpha (K, N); q = g * w (C,).

        h is accumulated unnormalised and divided once, so that with w = 0 (every weight
        exp(0) = 1) it is (v_0 + ... + v_{K-1}) / K, the mean, exactly."""
        q = self.decode_query()
        v0 = sources[0][0]
        z = np.empty((len(sources), v0.shape[0]), v0.dtype)
        for i, (v, rinv) in enumerate(sources):
            np.dot(v, q, out=z[i])
            z[i] *= rinv
        e = z - z.max(axis=0)
        np.exp(e, out=e)
        h = _scale_rows(v0, e[0])
        scratch = np.empty_like(h)
        for i in range(1, len(sources)):
            h += _scale_rows(sources[i][0], e[i], scratch)
        s = e.sum(axis=0)
        h /= s[:, None]
        e /= s
        return h, z, e, q

    def forward(self, sources) -> np.ndarray:
        h, z, alpha, q = self.mix(sources)
        self.cache = sources, z, alpha, q
        return h

    def weights(self) -> np.ndarray:
        """alpha (K, N) of the last forward: what each position read from each source."""
        return self.cache[2]

    def backward(self, dh: np.ndarray, dsources: list[np.ndarray]) -> None:
        """Add each source's gradient into dsources[i] (N, C), and dw, dg into ``grads``."""
        reads = [Reads() for _ in dsources]
        self.backward_deferred(dh, dsources, reads)
        for (v, _), d, r in zip(self.cache[0], dsources, reads):
            r.apply(v, d)

    def backward_deferred(self, dh: np.ndarray, dsources: list[np.ndarray], reads: list["Reads"]) -> None:
        """The backward with the parts that depend on the source alone left in ``reads[i]``:
        alpha_i dh is added into dsources[i] now; dz_i (q - z_i u_i / C) / r_i and this
        operation's share of dq wait for :meth:`Reads.apply`, which does them for every reader
        of a source at once."""
        sources, z, alpha, q = self.cache
        C = dh.shape[1]
        dalpha = np.empty_like(z)
        for i, (v, _) in enumerate(sources):
            np.einsum("nc,nc->n", dh, v, out=dalpha[i])
        dz = dalpha
        dz -= (alpha * dalpha).sum(axis=0)
        dz *= alpha                                                  # (K, N)
        scratch = np.empty_like(dh)
        for i, ((v, rinv), d, r) in enumerate(zip(sources, dsources, reads)):
            d += _scale_rows(dh, alpha[i], scratch)
            a = dz[i] * rinv                                         # dz_i / r_i
            r.add(self, a, a * z[i] * rinv / z.dtype.type(C))      # dz_i z_i / (C r_i^2)

    def decode_query(self) -> np.ndarray:
        """q = c g w (C,), for a decoder built on the current weights."""
        q = self.params["query"] * self.params["gain"]
        if self.scale != 1.0:
            q *= q.dtype.type(self.scale)
        return q

    def add_query_gradient(self, dq: np.ndarray) -> None:
        """dq (C,), the gradient of q = c g w: dw += c dq * g, dg += c dq * w."""
        grads, params = self.grads, self.params
        if self.scale != 1.0:
            dq = dq * dq.dtype.type(self.scale)
        if "query" in grads:
            grads["query"] += dq * params["gain"]
        if "gain" in grads:
            grads["gain"] += dq * params["query"]


class Reads:
    """The operations that read one source v (N, C), and what each owes its gradient beyond
    alpha dh: for reader r, a_r = dz_r / r(v) and c_r = dz_r z_r / (C r(v)^2), both (N,).

    ``apply`` adds sum_r a_r q_r - (sum_r c_r) v into dv, two products and one pass however
    many operations read v, and gives each reader its dq = sum over rows of a_r v."""

    def __init__(self):
        self.ops, self.a, self.c = [], [], None

    def add(self, op: DepthAttention, a: np.ndarray, c: np.ndarray) -> None:
        self.ops.append(op)
        self.a.append(a)
        self.c = c if self.c is None else self.c + c

    def apply(self, v: np.ndarray, dv: np.ndarray) -> None:
        if not self.ops:
            return
        A = np.stack(self.a, axis=1)                                 # (N, R)
        dv += np.dot(A, np.stack([op.cache[3] for op in self.ops]))  # sum_r a_r q_r
        dv -= _scale_rows(v, self.c)
        for op, dq in zip(self.ops, np.dot(A.T, v)):                 # (R, C)
            op.add_query_gradient(dq)


def _scale_rows(x: np.ndarray, s: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x (N, C) with row n times s[n]: one pass (einsum beats broadcasting a column here)."""
    return np.einsum("nc,n->nc", x, s, out=out)
