"""Attention Residuals: each sublayer reads a softmax over depth.   [Kimi Team, arXiv 2603.15031]

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

Block AttnRes groups the sublayers into blocks: inside a block outputs are summed, and each
operation reads the embedding, the finished blocks' sums and the current block's partial sum.
One sublayer per block is the full form. The first sublayer has no operation: it reads the
embedding alone. The final state before ``ln_f`` is one more such operation (``res_f``) over
every finished block: a plain sum would bring back the growth with depth the mixing is there
to avoid, and with w = 0 it is the mean of all sources.

Backward [derived; ``u_i = v_i / r_i``, ``q = g * w``, so ``z_i = q . u_i``]:

    dalpha_i = dh . v_i                          dz_i = alpha_i (dalpha_i - sum_j alpha_j dalpha_j)
    dq = sum_i dz_i u_i                          dw += c dq * g,  dg += c dq * w
    dv_i += alpha_i dh + dz_i (q - z_i u_i / C) / r_i

Each source feeds every later operation, so its gradient is a sum over consumers: ``backward``
adds into the caller's arrays, and :class:`DepthGrad` walks the operations in reverse so
that a source's gradient is complete before the sublayer that made it is differentiated. The
terms that depend on the source alone wait for that moment (:class:`Reads`): summed over all
its readers they are two matrix products, not a pass per reader.
"""
from __future__ import annotations

import numpy as np

from ... import init, registry
from ...config import ConfigError
from ...module import Module
from ...variant import Variant


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


@registry.residual("attention")
class DepthResidual(Module):
    """Attention Residuals as the model's residual scheme (residual.py): each sublayer's input,
    and the final state before ``ln_f``, is a DepthAttention over the sources so far.

    Each block owns the operations that form its sublayers' inputs (:meth:`block_ops`:
    ``attn_res``, absent in block 0, and ``mlp_res``); the scheme owns the final one,
    ``res_f``, and the bookkeeping of the sources (:class:`Sources`) in all three lives.
    ``block_size``: sublayers per block (1: full AttnRes).
    """

    def __init__(self, d: int, eps: float, dtype, block_size: int, scale: float = 1.0):
        super().__init__()
        self.block_size, self.d, self.eps, self.dtype, self.scale = block_size, d, eps, dtype, scale
        self.res_f = DepthAttention(d, eps, dtype, scale)

    @classmethod
    def from_config(cls, cfg, dtype) -> "DepthResidual":
        return cls(cfg.d_model, cfg.ln_eps, dtype, block_size(cfg), cfg.residual_query_scale)

    def block_ops(self, layer: int) -> tuple["DepthAttention | None", "DepthAttention"]:
        """The first sublayer reads the embedding alone (a softmax over one source is 1 whatever
        its query, so that query could never learn): block 0 has no ``attn_res``."""
        attn = DepthAttention(self.d, self.eps, self.dtype, self.scale) if layer else None
        return attn, DepthAttention(self.d, self.eps, self.dtype, self.scale)

    def ops(self, blocks) -> list["DepthAttention"]:
        """Every operation in order: the MLP of block 0, attn and mlp of each later block, res_f."""
        return [op for b in blocks for op in (b.attn_res, b.mlp_res) if op is not None] + [self.res_f]

    def stream(self, x0: np.ndarray, outputs: list | None = None) -> "DepthStream":
        return DepthStream(x0, self, outputs)

    def grad(self, dxf: np.ndarray) -> "DepthGrad":
        return DepthGrad(dxf, self)

    def decode_state(self) -> np.ndarray:
        """What decoding keeps across steps: res_f's query g * w, on the current weights."""
        return self.res_f.decode_query()

    def decode(self, layers: list, rows, step, final_query: np.ndarray) -> None:
        """One decoding forward (decode.py): the sources side by side (:class:`StackedSources`),
        each sublayer's input mixed from them row by row (no cache: the mixing never looks
        across positions), each output added to them; the final state mixed into rows.x."""
        n_sublayers = sum(len(layer) for layer in layers)
        sources = StackedSources(rows.x, n_sublayers, self.block_size, self.eps)
        for i, layer in enumerate(layers):
            step.layer = i
            for query, norm, vectors, sublayer, sublayer_state in layer:
                if query is not None:                                # block 0's attention reads the embedding
                    sources.mix(query, rows.x)
                norm.decode(rows, vectors)
                sublayer.decode(rows, sublayer_state, step)
                sources.add(rows.out)
        sources.mix(final_query, rows.x)

    @staticmethod
    def decode_query(op: "DepthAttention | None") -> np.ndarray | None:
        """q = g * w of a block's ``op`` for decoding on the current weights."""
        return None if op is None else op.decode_query()


class DepthStream:
    """The forward: sublayer j reads h_j = its operation over the sources; its output
    f(norm(h_j)) becomes a source (or joins its block's partial sum). ``outputs``, if given,
    collects each sublayer's output (N, C), for looking inside."""

    def __init__(self, x0: np.ndarray, scheme: DepthResidual, outputs: list | None):
        self.x0, self.shape, self.final, self.outputs = x0, x0.shape, scheme.res_f, outputs
        self.sources = Sources(x0.reshape(-1, x0.shape[-1]), scheme.block_size, scheme.eps)

    def read(self, op: DepthAttention | None) -> np.ndarray:
        return self.x0 if op is None else op.forward(self.sources.current()).reshape(self.shape)

    def write(self, v: np.ndarray) -> None:
        v = v.reshape(-1, self.shape[-1])
        if self.outputs is not None:
            self.outputs.append(v)
        self.sources.add(v)

    def finish(self) -> np.ndarray:
        return self.final.forward(self.sources.current()).reshape(self.shape)


class DepthGrad:
    """The backward. dblock[n] collects the gradient of block n's sum (block 0: the embedding)
    from every operation that read it; what depends on the source alone waits in reads[n]
    until the block's gradient is needed. Walking the sublayers in reverse, sublayer j of block
    n has output gradient dblock[n] plus what the later sublayers of its block sent to the
    partial sums it is part of (``carry``); its operation then adds into dblock[0 .. n-1] and
    ``carry``.

    The blocks call ``output()`` then ``input(op, dh)`` per sublayer, in turn and in reverse
    (Block.backward_stream); the sources are those the forward's final operation read."""

    def __init__(self, dxf: np.ndarray, scheme: DepthResidual):
        self.shape, C = dxf.shape, dxf.shape[-1]
        self.final, self.block_size = scheme.res_f, scheme.block_size
        N = dxf.size // C
        n_sources = len(self.final.cache[0])                  # the embedding and every finished block
        self.j = (n_sources - 1) * self.block_size
        self.dblock = [np.zeros((N, C), dxf.dtype) for _ in range(n_sources)]
        self.reads = [Reads() for _ in range(n_sources)]
        self.final.backward_deferred(dxf.reshape(-1, C), self.dblock, self.reads)
        self.carry = None

    def output(self) -> np.ndarray:
        self.j -= 1
        n, k = divmod(self.j, self.block_size)
        n += 1                                                       # block 0 is the embedding
        self.n, self.k = n, k
        if k == self.block_size - 1:                                 # the last sublayer of block n:
            self.reads[n].apply(self.final.cache[0][n][0], self.dblock[n])   # every reader of it is done
            self.carry = None
        dv = self.dblock[n] if self.carry is None else self.dblock[n] + self.carry
        return dv.reshape(self.shape)

    def input(self, op: DepthAttention | None, dh: np.ndarray) -> None:
        n, k = self.n, self.k
        dh = dh.reshape(-1, self.shape[-1])
        if op is None:                                               # read the embedding as it is
            self.dblock[0] += dh
        elif k:                                                      # it read its block's partial sum
            if self.carry is None:
                self.carry = np.zeros_like(self.dblock[0])
            partial = Reads()
            op.backward_deferred(dh, self.dblock[:n] + [self.carry], self.reads[:n] + [partial])
            partial.apply(op.cache[0][n][0], self.carry)
        else:
            op.backward_deferred(dh, self.dblock[:n], self.reads[:n])

    def finish(self) -> np.ndarray:
        self.reads[0].apply(self.final.cache[0][0][0], self.dblock[0])
        return self.dblock[0].reshape(self.shape)


# --- the variant's declaration (variant.py) --------------------------------------------------
def block_size(cfg) -> int:
    """Sublayers per block (1: full AttnRes)."""
    return 2 * cfg.n_layer // cfg.residual_blocks if cfg.residual_blocks else 1


def _check(cfg) -> None:
    if cfg.residual_blocks and (2 * cfg.n_layer) % cfg.residual_blocks:
        raise ConfigError(f"residual_blocks ({cfg.residual_blocks}) must divide the {2 * cfg.n_layer} "
                          f"sublayers (2 x n_layer)")


def _describe(cfg) -> tuple[str, str]:
    form = f"blocks: {cfg.residual_blocks} blocks of {block_size(cfg)} sublayers" if block_size(cfg) > 1 else \
        f"full: each of the {2 * cfg.n_layer} sublayers reads the embedding and every earlier output"
    return "residual", f"attention over depth · {form} · final state mixed too"


def depth_map(model, ids: list[int]) -> dict:
    """Attention Residuals: one row per operation (the input of a sublayer, then the final
    state), one column per source (the embedding, then each block of sublayers: with full
    AttnRes each sublayer's output, a0 the attention of block 0, m0 its MLP). An operation inside
    a block reads that block's partial sum so far in the block's column. ``mean`` (ops, sources)
    averages the prompt's tokens; ``per_token`` holds each operation's (K, T) weights."""
    per_op = [w[:, 0] for w in model.depth_weights(np.array([ids]))]       # (K, T) each
    size = model.residual.block_size
    n_sub = 2 * model.config.n_layer
    name = lambda j: f"{'am'[j % 2]}{j // 2}"                              # sublayer j
    sources = ["emb"] + [name(b * size) if size == 1 else f"{name(b * size)}–{name(b * size + size - 1)}"
                         for b in range(n_sub // size)]
    ops = [name(j) for j in range(1, n_sub)] + ["final"]
    grid = np.zeros((len(ops), len(sources)))
    for r, w in enumerate(per_op):
        grid[r, :len(w)] = w.mean(axis=1)
    return {"operations": ops, "sources": sources, "mean": grid, "per_token": per_op}


def _inspect(model, ids: list[int]) -> dict:
    """What tbp view shows of it: the depth map's mean over the prompt's tokens."""
    d = depth_map(model, ids)
    return {"depth": {"operations": d["operations"], "sources": d["sources"], "mean": d["mean"]}}


VARIANT = registry.declare(Variant(
    key="attnres", name="Attention Residuals", active=lambda cfg: cfg.residual == "attention", axis="residual",
    options=("residual_blocks", "residual_query_scale"), switch="--residual attention",
    refuses={"encoder-decoder": "Attention Residuals are built for the GPT (not the encoder-decoder)",
             "recompute": "Attention Residuals' blocks read every earlier block's output, so no block's input "
                          "alone recomputes it (drop --recompute)",
             "export": "GPT-2 adds every sublayer into one residual sum; it has no softmax over depth",
             "gguf": "llama.cpp's GPT-style graphs add every sublayer into one residual sum; none has a softmax "
                     "over depth (Attention Residuals)"},
    check=_check, describe=_describe, inspect=_inspect,
    activations=lambda cfg: 2 * (2 * cfg.n_layer + 1) * cfg.d_model,    # partial sums, each source's gradient
    model_cases=(("gpt [attention residuals: full]", dict(n_layer=3, residual="attention")),
                 ("gpt [attention residuals: 2 blocks of 3 sublayers]", dict(n_layer=3, residual="attention",
                                                                             residual_blocks=2)),
                 ("gpt [attention residuals: 3 blocks, untied head, no biases]",
                  dict(n_layer=3, residual="attention", residual_blocks=3, tie_head=False, bias=False)),
                 ("gpt [attention residuals: full, logits scaled by 0.3]",
                  dict(n_layer=2, residual="attention", residual_query_scale=0.3))),
))
