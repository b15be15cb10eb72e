"""Attention Residuals: each sublayer reads a softmax over depth.   [Kimi Team, arXiv 2603.15031]

The scheme registered as ``--residual attention``: where a pre-LN stack adds every sublayer's
output into one running sum, here each sublayer's input is a depth attention (depth.py, which
states the equations and their backward) over the sources so far.

Block AttnRes groups the sublayers into blocks: inside a block outputs are summed, and each
operation reads the embedding, the finished blocks' sums and the current block's partial sum.
One sublayer per block is the full form. The first sublayer has no operation: it reads the
embedding alone. The final state before ``ln_f`` is one more such operation (``res_f``) over
every finished block: a plain sum would bring back the growth with depth the mixing is there
to avoid, and with w = 0 it is the mean of all sources.

Each source feeds every later operation, so its gradient is a sum over consumers:
:class:`DepthGrad` walks the operations in reverse so that a source's gradient is complete
before the sublayer that made it is differentiated.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import registry
from ...config import ConfigError, Options, option
from ...module import Module
from ...variant import Chart, Section, Variant
from .depth import DepthAttention, Reads, Sources, StackedSources, rms_inverse


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
        return cls(cfg.d_model, cfg.ln_eps, dtype, block_size(cfg), cfg.designs["attnres"].query_scale)

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
@dataclass(frozen=True)
class AttnResOptions(Options):
    """Attention Residuals' own options (``cfg.designs["attnres"]``), flags ``--residual-*``."""
    PREFIX = "residual_"
    blocks: int = option(0, "Attention Residuals over blocks: the 2 x n_layer sublayers summed in this many "
                            "blocks, each a source (0: every sublayer its own source, full AttnRes).",
                         min=0, max=192)
    query_scale: float = option(1.0, "Attention Residuals: a factor c on the depth logits, q = c g w. Under Adam "
                                     "it sets the pseudo-queries' own learning rate (c times the shared one); 0 "
                                     "freezes them at zero, each input the mean of its sources (1: the paper's).",
                                min=0.0)


def block_size(cfg) -> int:
    """Sublayers per block (1: full AttnRes)."""
    blocks = cfg.designs["attnres"].blocks
    return 2 * cfg.n_layer // blocks if blocks else 1


def _check(cfg) -> None:
    blocks = cfg.designs["attnres"].blocks
    if blocks and (2 * cfg.n_layer) % blocks:
        raise ConfigError(f"residual_blocks ({blocks}) must divide the {2 * cfg.n_layer} sublayers (2 x n_layer)")


def _describe(cfg) -> tuple[str, str]:
    blocks = cfg.designs["attnres"].blocks
    form = f"blocks: {blocks} blocks of {block_size(cfg)} sublayers" if block_size(cfg) > 1 else \
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


def _depth_part(rng, dtype, K: int = 4):
    """One depth operation over K sources of different scales (an RMS-normalised key is
    scale-free; the value is not): f = sum(h * w), with the query and gain random (a gradcheck
    case: Variant.part_cases)."""
    op = DepthAttention(16, 1e-5, dtype)
    for p in op.params.values():
        p[...] = rng.standard_normal(p.shape) * 0.3
    op.params["gain"] += 1
    vs = [rng.standard_normal((10, 16)) * s for s in rng.uniform(0.3, 3.0, K)]
    w = rng.standard_normal((10, 16))

    def f():
        return float(np.sum(op.forward([(v, rms_inverse(v, op.eps)) for v in vs]) * w))

    def backward():
        dvs = [np.zeros_like(v) for v in vs]
        op.backward(w.copy(), dvs)
        return [(f"v_{i} (source)", v, dv) for i, (v, dv) in enumerate(zip(vs, dvs))]
    return op, f, backward


def _inspect(model, ids: list[int]) -> dict:
    """What tbp view and tbp attention --depth show of it: the depth map (depth_map)."""
    return {"depth": depth_map(model, ids)}


def _draw(shown: dict) -> list[Section]:
    """tbp view's section: the mean depth weights over the prompt."""
    dep = shown["depth"]
    return [Section("Attention Residuals over depth",
                    "What each sublayer's input takes from the embedding and each earlier output, averaged over "
                    "the prompt.",
                    "What to look for: a plain residual gives every source the same weight; an operation that puts "
                    "most of its weight on the embedding or on one earlier output has learned to skip the rest.",
                    (Chart("depth", "Attention Residuals: mean depth weights over the prompt", [dep["mean"]],
                           "source", "operation: a sublayer's input", dep["sources"], dep["operations"]),))]


VARIANT = registry.declare(Variant(
    key="attnres", name="Attention Residuals", active=lambda cfg: cfg.residual == "attention", axis="residual",
    options=AttnResOptions, switch="--residual attention",
    summary="attention: Attention Residuals, a learned per-token softmax over the embedding and every earlier "
            "sublayer's output (the mean of them at initialisation).",
    refuses={"encoder-decoder": "Attention Residuals are built for the GPT (not the encoder-decoder)",
             "recompute": "Attention Residuals' blocks read every earlier block's output, so no block's input "
                          "alone recomputes it (drop --recompute)",
             "export": "GPT-2 adds every sublayer into one residual sum; it has no softmax over depth",
             "gguf": "llama.cpp's GPT-style graphs add every sublayer into one residual sum; none has a softmax "
                     "over depth (Attention Residuals)"},
    check=_check, describe=_describe, inspect=_inspect, draw=_draw,
    part_cases=(("depth-attention [4 sources]", _depth_part),),
    activations=lambda cfg: 2 * (2 * cfg.n_layer + 1) * cfg.d_model,    # partial sums, each source's gradient
    model_cases=(("gpt [attention residuals: full]", dict(n_layer=3, residual="attention")),
                 ("gpt [attention residuals: 2 blocks of 3 sublayers]", dict(n_layer=3, residual="attention",
                                                                             residual_blocks=2)),
                 ("gpt [attention residuals: 3 blocks, untied head, no biases]",
                  dict(n_layer=3, residual="attention", residual_blocks=3, tie_head=False, bias=False)),
                 ("gpt [attention residuals: full, logits scaled by 0.3]",
                  dict(n_layer=2, residual="attention", residual_query_scale=0.3))),
))
