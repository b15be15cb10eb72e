"""Multi-Token Attention: convolutions over the attention map.   [Golovneva et al. 2025, arXiv 2504.00927]

Standard attention weighs key j for query i by q_i . k_j alone. Multi-Token Attention lets the
weight depend on neighbouring queries and keys too, so that a head can find "the place where
these two letters occur together": a learned (cq x ck) convolution over the score map, per head,
before the softmax; optionally a mixing of the heads' scores, a second convolution after the
softmax, a mixing of the heads' weights within groups, and a per-head RMS norm and gate on the
output. With identity kernels (the initialisation) and no norm, it is standard attention.

Per head, with C the causal mask, following the authors' code (facebookresearch/RAM, projects/mta):

    S   = q k^T / sqrt(Dk)                        the scores                        (T, T)
    S0  = C * S                                   future scores set to 0: no future key can
                                                  enter the kernel's window
    Z   = conv(S0, theta)                         Z[i,j] = sum_{a<cq, b<ck} theta[a,b] S0[i-(cq-1)+a, j-p+b],
                                                  p = (ck-1)/2: past and current query rows, keys
                                                  centred on j; zero outside the map
    Z'  = W_mix Z                                 across heads (optional), an H x H matrix
    A   = softmax(Z' - inf (1 - C))               the future masked
    A'  = C * conv(A, theta')                     (optional) rows no longer sum to 1
    A'' = K_g A'                                  (optional) within each group of c_h heads
    O   = A'' V;  then (optional) RMSNorm over Dv with a gain shared by the heads, and a gate
          o * sigmoid(o . w + b), (optional) times 1 - lambda(l) (map.py, depth_scale).

Nothing here reads a future token: S0 rows up to i hold keys up to i only, and every later
step mixes rows up to i, or heads, at the same position (tests/test_mta.py perturbs tokens).
The flash kernel is refused: the post-softmax steps need whole normalised rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import registry
from ...attention import CausalSelfAttention
from ...config import ConfigError, Options, option
from ...module import DecodeState
from ...variant import Chart, Section, Variant
from .map import MTAParams, depth_scale


@registry.attention("mta")
class MultiTokenAttention(CausalSelfAttention):
    """Causal self-attention with Multi-Token Attention's steps (module docstring), dense only.

    ``conv``: (cq, ck) of this layer's key-query convolutions, or None (the layer has none);
    ``post``: a post-softmax convolution too; ``mix``: pre-softmax head mixing; ``group``: the
    post-softmax head-group size c_h (0: none; it divides H); ``norm``: RMS norm and gate;
    ``scale``: that output's factor (``map.depth_scale`` of the layer, or 1).
    Parameters (all trainable, identity at initialisation): ``theta`` (H, cq, ck),
    ``theta_post`` (H, cq, ck), ``mix`` (H, H), ``group_mix`` (H/c_h, c_h, c_h), ``norm_gain``
    (Dv,), ``gate_weight`` (Dv,), ``gate_bias`` (1,).
    """

    def __init__(self, d_model: int, n_head: int, d_qk: int, d_v: int, rng: np.random.Generator,
                 dtype=np.float32, bias: bool = True, proj_std: float = 0.02, conv: tuple | None = (2, 9),
                 post: bool = False, mix: bool = False, group: int = 0, norm: bool = False, eps: float = 1e-5,
                 scale: float = 1.0):
        super().__init__(d_model, n_head, d_qk, d_v, rng, dtype, bias, True, proj_std, "dense")
        self.mta = MTAParams(n_head, d_v, dtype, conv, post, mix, group, norm, eps, scale)
        self.key_bias_inert = conv is None       # a convolution mixes scores of different keys

    @classmethod
    def from_config(cls, cfg, rng: np.random.Generator, dtype, layer: int, proj_std: float, positions=None):
        """(``positions``: learned ones, the only kind Multi-Token Attention takes here.)"""
        o = cfg.designs["mta"]
        conv = (o.cq, o.ck) if layer in conv_layers(cfg) else None
        return cls(cfg.d_model, cfg.n_head, cfg.d_qk, cfg.d_v, rng, dtype, cfg.bias, proj_std, conv,
                   o.post, o.mix, o.group, o.norm, scale=depth_scale(layer) if o.depth_scale else 1.0)

    # --- training path ----------------------------------------------------------------------
    def forward(self, x: np.ndarray, key_mask: np.ndarray | None = None, noise=None) -> np.ndarray:
        if noise is not None:
            raise ValueError("dropout is not wired into Multi-Token Attention")
        if key_mask is not None:
            raise ValueError("Multi-Token Attention is causal self-attention: it takes no padding mask")
        q, k, v = self._heads(self.c_attn.forward(x))
        qs = q * self.scale
        B, H, T, _ = qs.shape
        S = qs @ k.transpose(0, 1, 3, 2)                                    # (B, H, T, T)
        out, saved = self.mta.scores_to_output(S, v, 0)
        merged = np.ascontiguousarray(out.transpose(0, 2, 1, 3)).reshape(B, T, H * self.d_v)
        self.cache = qs, k, v, saved
        return self.c_proj.forward(merged)

    def backward(self, dout: np.ndarray) -> np.ndarray:
        qs, k, v, saved = self.cache
        B, H, T, _ = qs.shape
        Dk, Dv = self.d_qk, self.d_v
        dout_h = self._heads_view(self.c_proj.backward(dout), Dv)         # (B, H, T, Dv)
        dS, dv_ = self.mta.backward(dout_h, v, saved)
        dqkv = np.empty((B, T, H * (2 * Dk + Dv)), dtype=dout.dtype)
        dq, dk, dv = self._heads(dqkv)
        np.matmul(dS, k, out=dq)
        dq *= self.scale
        np.matmul(dS.transpose(0, 1, 3, 2), qs, out=dk)
        dv[...] = dv_
        return self.c_attn.backward(dqkv)

    def weights(self) -> np.ndarray:
        """A'' (B, H, T, T), the weights the values were averaged with (rows need not sum to 1
        after a post-softmax convolution)."""
        return self.cache[3]["A2"].copy()

    # --- inference (decode.py) --------------------------------------------------------------
    def decode_state(self, ln, batch: int, n_ctx: int, dtype) -> DecodeState:
        """The KV cache, and the rows of S0 and of A that the next rows' convolutions read: the
        last cq - 1 (zeros before position 0)."""
        state = super().decode_state(ln, batch, n_ctx, dtype)
        rows = self.mta.conv[0] - 1 if self.mta.conv else 0
        state.rows = {"S0": np.zeros((batch, self.n_head, rows, n_ctx), dtype),
                      "A": np.zeros((batch, self.n_head, rows, n_ctx), dtype)}
        return state

    def decode(self, rows, state: DecodeState, step) -> None:
        """rows.out = c_proj(MTA of new rows t0 .. t1-1 over the cached keys and values), within
        the context. The convolutions read the new rows' scores after the last cq - 1 rows'
        (``state.rows``), and leave the new last cq - 1 rows there. Dense: the variant refuses
        sparse decoding."""
        t0, t1 = step.t0, step.t1
        s = state.scratch(t1 - t0)
        qkv, proj, proj_b = state.folded
        keys, values = state.keys, state.values
        np.dot(rows.xa, qkv, out=s.qkv)                             # [q * scale | k | v], (N, .)
        keys[:, :, t0:t1] = s.k
        values[:, :, t0:t1, :-1] = s.v
        if t0 == 0:                                                 # a new sequence: no rows before it
            for prev in state.rows.values():
                prev.fill(0)
        S = s.q @ keys[:, :, :t1].swapaxes(-1, -2)                  # (B, H, Tn, t1)
        s.y[...] = self.mta.scores_to_output(S, values[:, :, :t1, :-1], t0, state.rows)[0]
        np.dot(s.ya, proj, out=rows.out)
        if proj_b is not None:
            rows.out += proj_b


# --- the variant's declaration (variant.py) --------------------------------------------------
@dataclass(frozen=True)
class MTAOptions(Options):
    """Multi-Token Attention's own options (``cfg.designs["mta"]``), flags ``--mta-*``."""
    PREFIX = "mta_"
    cq: int = option(2, "MTA: query rows of the key-query kernel (the current and cq - 1 past).", min=1, max=64)
    ck: int = option(9, "MTA: key columns of the key-query kernel, centred on the key (odd).", min=1, max=255)
    layers: str = option("all", "MTA: the layers with the key-query convolution, all or e.g. 0,2 (every layer "
                                "gets the other MTA steps switched on).")
    post: bool = option(False, "MTA: a second key-query convolution after the softmax.",
                        flag="--mta-post/--no-mta-post")
    mix: bool = option(False, "MTA: mix the heads' scores before the softmax (an H x H matrix).",
                       flag="--mta-mix/--no-mta-mix")
    group: int = option(0, "MTA: mix the heads' weights after the softmax in groups of this many (0: off).",
                        min=0, max=128)
    norm: bool = option(False, "MTA: RMS-normalise each head's output, then gate it.",
                        flag="--mta-norm/--no-mta-norm")
    depth_scale: bool = option(False, "MTA: scale the normed output by 1 - lambda(l), lambda(l) = 0.8 - 0.6 "
                                      "exp(-0.3 l) for layer l (the paper's, off in its released configs; needs "
                                      "--mta-norm).", flag="--mta-depth-scale/--no-mta-depth-scale")


def conv_layers(cfg) -> tuple[int, ...]:
    """The layers that carry the key-query convolution (``mta_layers`` parsed and checked)."""
    spec = cfg.designs["mta"].layers
    if spec.strip() == "all":
        return tuple(range(cfg.n_layer))
    try:
        layers = tuple(sorted({int(x) for x in spec.split(",") if x.strip()}))
    except ValueError:
        raise ConfigError(f"mta_layers must be all or comma-separated layer numbers, got {spec!r}") from None
    if not layers or min(layers) < 0 or max(layers) >= cfg.n_layer:
        raise ConfigError(f"mta_layers {spec!r}: the model has layers 0 .. {cfg.n_layer - 1}")
    return layers


def _check(cfg) -> None:
    o = cfg.designs["mta"]
    if o.ck % 2 == 0:
        raise ConfigError(f"mta_ck must be odd (the kernel is centred on the key), got {o.ck}")
    # taps past these reach only the zero padding around a T x T map: work for nothing
    if o.cq > cfg.n_ctx or o.ck > 2 * cfg.n_ctx - 1:
        raise ConfigError(f"an MTA kernel of {o.cq} x {o.ck} is wider than a {cfg.n_ctx} x "
                          f"{cfg.n_ctx} score map can use (mta_cq <= n_ctx, mta_ck <= 2 n_ctx - 1)")
    if o.depth_scale and not o.norm:
        raise ConfigError("mta_depth_scale scales the output of the group norm: it needs mta_norm")
    if o.group and cfg.n_head % o.group:
        raise ConfigError(f"mta_group ({o.group}) must divide n_head ({cfg.n_head})")
    conv_layers(cfg)


def _describe(cfg) -> tuple[str, str]:
    o = cfg.designs["mta"]
    steps = [f"{o.cq}×{o.ck} key-query convolution in layers " + ", ".join(map(str, conv_layers(cfg)))]
    steps += [what for on, what in ((o.post, "post-softmax convolution"), (o.mix, "head mixing"),
                                    (o.group, f"head groups of {o.group}"),
                                    (o.norm, "norm + gate" + (", scaled by depth" if o.depth_scale else ""))) if on]
    return "multi-token", " · ".join(steps)


def step_work(cfg, batch_size: int) -> tuple[int, str, str]:
    """Multiply-adds of the key-query convolutions in one training step: each of cq x ck taps
    passes over every B x H x T x T score map once forward and twice backward (dX and the
    kernel's gradient), in each convolution layer (twice with mta_post). Returns (work, what
    makes it, what to change)."""
    o = cfg.designs["mta"]
    maps = batch_size * cfg.n_head * cfg.n_ctx ** 2 * len(conv_layers(cfg)) * (2 if o.post else 1)
    return (3 * o.cq * o.ck * maps,
            f"an MTA kernel of {o.cq} x {o.ck} over {cfg.n_ctx} x {cfg.n_ctx} maps",
            "use a smaller kernel (the paper's is 6 x 11), context or batch")


def kernels(model) -> dict[int, dict[str, np.ndarray]]:
    """The learned kernels by layer: ``theta`` (H, cq, ck), the key-query convolution before
    the softmax, and ``theta_post`` where there is one after it."""
    out = {}
    for i, block in enumerate(model.blocks):
        mta = getattr(block.attn, "mta", None)
        if mta is not None and "theta" in mta.params:
            out[i] = {k: mta.params[k] for k in ("theta", "theta_post") if k in mta.params}
    return out


def _draw(shown: dict) -> list[Section]:
    """tbp view's section: each layer's kernels, a chart per kernel, a head per menu entry."""
    charts = tuple(Chart(f"mta-{layer}-{name}", f"MTA layer {layer}: {name} (query rows × key columns)", theta,
                         "key offset", "query row (last: current)", signed=True)
                   for layer, ks in shown["mta"].items() for name, theta in ks.items())
    return [Section("Multi-Token Attention kernels",
                    "Each layer's learned key-query convolution; the menu of each chart chooses the head.",
                    "What to look for: weight away from a kernel's centre mixes neighbouring queries' or keys' "
                    "scores, so a position's attention depends on several tokens matching at once, not one.",
                    charts)]


VARIANT = registry.declare(Variant(
    key="mta", name="Multi-Token Attention", active=lambda cfg: cfg.attention == "mta", axis="attention",
    options=MTAOptions, switch="--attention mta",
    summary="mta: Multi-Token Attention, a learned convolution over each head's score map (identity at "
            "initialisation).",
    refuses={"encoder-decoder": "Multi-Token Attention is for the GPT (its encoder-decoder is not built)",
             "dropout": "dropout is not wired into Multi-Token Attention's steps",
             "flash": "Multi-Token Attention cannot use the flash kernel: its post-softmax steps need whole "
                      "normalised rows (attn_impl auto or dense)",
             "rope": "Multi-Token Attention uses learned positions here (rope is not wired into it)",
             "thin": "sparse decoding thins standard attention; Multi-Token Attention's convolutions read "
                       "every score",
             "export": "GPT-2's attention has no convolution over its score maps",
             "gguf": "no llama.cpp architecture convolves its score maps (Multi-Token Attention)",
             "rewind": "Multi-Token Attention's cache keeps only the last rows of scores its convolutions "
                       "read; rewinding would need rows it has overwritten",
             "rows": "Multi-Token Attention's decoding keeps rows of scores at one shared position; sequences "
                     "at their own positions are decoded one at a time",
             "speculate": "speculative decoding rolls the cache back past rejected drafts; Multi-Token "
                          "Attention's cache keeps only the last rows of scores its convolutions read"},
    check=_check, describe=_describe, inspect=lambda model, ids: {"mta": kernels(model)}, draw=_draw,
    # S0, Z, A, A', A'' per head beside the scores: 4 more T-long rows than standard attention
    activations=lambda cfg: cfg.n_layer * 4 * cfg.n_head * cfg.n_ctx,
    step_work=step_work,
    layer_cases=(
        ("attention [mta: 2x5 key-query conv]",
         lambda C, H, rng, dtype: MultiTokenAttention(C, H, 4, C // H, rng, dtype, conv=(2, 5))),
        ("attention [mta: 3x3 pre + post conv, head mix, groups of 2, norm + gate]",
         lambda C, H, rng, dtype: MultiTokenAttention(C, H, 4, C // H, rng, dtype, conv=(3, 3), post=True,
                                                      mix=True, group=2, norm=True)),
        ("attention [mta: no conv, head mix, norm + gate]",
         lambda C, H, rng, dtype: MultiTokenAttention(C, H, 4, C // H, rng, dtype, conv=None, mix=True,
                                                      norm=True))),
    model_cases=(("gpt [mta: conv in layer 1 only, post, mix, norm scaled by depth]",
                  dict(attention="mta", mta_ck=3, mta_layers="1", mta_post=True, mta_mix=True, mta_norm=True,
                       mta_depth_scale=True)),),
))
