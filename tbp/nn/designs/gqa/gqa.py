"""Grouped-query attention: key and value heads shared by groups of query heads.
[Ainslie et al., arXiv 2305.13245; multi-query attention: Shazeer, arXiv 1911.02150]

Multi-head attention gives each of the H query heads its own keys and values. Grouped-query
attention keeps H query heads but only Hkv = ``n_kv_head`` key/value heads, Hkv dividing H:
query head h reads key/value head h // G, G = H / Hkv (Hkv = 1 is multi-query attention).
The model computes fewer keys and values, and -- what matters when decoding -- caches
Hkv (Dk + Dv) numbers per position and layer instead of H (Dk + Dv): G times less memory and
memory traffic per generated token. Llama 2 70B uses H = 64, Hkv = 8.

Per group of query heads sharing k_j, v_j (j = h // G):

    y_h = softmax(q_h k_j^T / sqrt(Dk)) v_j

Forward: the kernel reads each shared head repeated G times, k' = repeat(k, G), so it is
standard attention's kernel unchanged. Backward: a repeat's transpose is a sum, so each
shared head's gradient is the sum of its G readers' [derived]:

    dk_j = sum_{h: h // G = j} dk'_h,    dv_j = sum_{h: h // G = j} dv'_h

Decoding reads the cache as it is: the G query rows of a group are one product against their
head's cached keys, (G Tn, Dk) x (Dk, t). Sparse decoding (LessIsMore) chooses per key/value
group, the group's query heads together, since a kept position is a cached row of that group.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import registry
from ...attention import CausalSelfAttention
from ...config import ConfigError, Options, option
from ...positions import LEARNED, Positions
from ...variant import Variant


@dataclass(frozen=True)
class GQAOptions(Options):
    """Grouped-query attention's own option (``cfg.designs["gqa"]``)."""
    n_kv_head: int | None = option(None, "Grouped-query attention: key/value heads, dividing n_head (1: multi-query "
                                         "attention); the KV cache is n_head / n_kv_head times smaller.",
                                   min=1, max=128)


def kv_heads_of(cfg) -> int:
    """Hkv of a model of ``cfg``: its grouped-query key/value heads, or one per query head."""
    return cfg.designs["gqa"].n_kv_head or cfg.n_head


@registry.attention("gqa")
class GroupedQueryAttention(CausalSelfAttention):
    """CausalSelfAttention with ``n_kv_head`` key/value heads; c_attn.weight: (C, H Dk + Hkv (Dk + Dv)),
    columns [all queries | the Hkv keys | the Hkv values]."""

    def __init__(self, d_model: int, n_head: int, d_qk: int, d_v: int, rng: np.random.Generator,
                 dtype=np.float32, n_kv_head: int = 1, **kw):
        if n_kv_head < 1 or n_head % n_kv_head:
            raise ValueError(f"n_kv_head ({n_kv_head}) must divide n_head ({n_head})")
        self.n_kv_head = n_kv_head                                         # before the base sizes c_attn by it
        super().__init__(d_model, n_head, d_qk, d_v, rng, dtype, **kw)
        self.group = n_head // n_kv_head                                   # G: query heads per key head

    @property
    def kv_heads(self) -> int:
        """Hkv: ``n_kv_head``, shared by groups of G query heads."""
        return self.n_kv_head

    @classmethod
    def from_config(cls, cfg, rng: np.random.Generator, dtype, layer: int, proj_std: float,
                    positions: Positions = LEARNED):
        return cls(cfg.d_model, cfg.n_head, cfg.d_qk, cfg.d_v, rng, dtype, kv_heads_of(cfg), bias=cfg.bias,
                   causal=cfg.causal, proj_std=proj_std, impl=cfg.attn_kernel,
                   positions=positions, window=positions.window(cfg.n_ctx))

    def _expand(self, k: np.ndarray, v: np.ndarray):
        """k (B, Hkv, T, Dk), v (B, Hkv, T, Dv) -> one copy per query head, (B, H, T, .)."""
        return np.repeat(k, self.group, axis=1), np.repeat(v, self.group, axis=1)

    def _reduce(self, dk_heads: np.ndarray, dv_heads: np.ndarray, dk: np.ndarray, dv: np.ndarray) -> None:
        """dk_j, dv_j = the sum over the G query heads that read head j."""
        B, _, T, _ = dk_heads.shape
        G, Hkv = self.group, self.n_kv_head
        np.add.reduce(dk_heads.reshape(B, Hkv, G, T, -1), axis=2, out=dk)
        np.add.reduce(dv_heads.reshape(B, Hkv, G, T, -1), axis=2, out=dv)

    # --- inference (decode.py) --------------------------------------------------------------
    @classmethod
    def key_value_heads(cls, cfg) -> int:
        return kv_heads_of(cfg)

    def _scratch(self, B: int, Tn: int, n_ctx: int, dtype):
        """The shared scratch, with the query-side arrays grouped (B, Hkv, G, Tn, .): one
        product per cache head reads its group's queries together."""
        s = super()._scratch(B, Tn, n_ctx, dtype)
        H, Hkv, G, Dk, Dv = self.n_head, self.n_kv_head, self.group, self.d_qk, self.d_v
        s.q = s.qkv[:, :H * Dk].reshape(B, Tn, Hkv, G, Dk).transpose(0, 2, 3, 1, 4)
        s.att = s.att.reshape(B, Hkv, G, Tn, n_ctx)
        s.rowmax = s.rowmax.reshape(B, Hkv, G, Tn, 1)
        s.ysum = s.ysum.reshape(B, Hkv, G, Tn, Dv + 1)
        s.ysum_v, s.ysum_p = s.ysum[..., :-1], s.ysum[..., -1:]
        s.y = s.ya.reshape(B, Tn, Hkv, G, Dv).transpose(0, 2, 3, 1, 4)
        return s

    def _by_cache_head(self, cached: np.ndarray) -> np.ndarray:
        """(B, Hkv, ., .) -> (B, Hkv, 1, ., .): broadcast over the group's query heads."""
        return cached[:, :, None]


def pool_kv_heads(model, n_kv_head: int):
    """A grouped-query copy of ``model`` (standard or grouped-query attention, Hs key/value
    heads) with ``n_kv_head`` = Hkv of them, each the mean of the R = Hs / Hkv heads it replaces:
    Ainslie et al.'s conversion of a multi-head checkpoint, which is then trained on for a few
    per cent of its steps ("uptraining"; §2.1-2.2: mean pooling kept more than one chosen head
    or fresh heads). In every layer's c_attn, columns [H queries | Hs keys | Hs values] become

        key_j = mean_{i = jR .. jR+R-1} key_i,   value_j likewise,   j = 0 .. Hkv-1

    (weight columns and biases; every other parameter is copied). Query head h read key head
    i = h // (H/Hs), and now reads h // (H/Hkv) = i // R: the mean over its own head's group.
    A projection is linear, so the pooled head's keys are the mean of the heads' keys -- before
    any rotary rotation, which is the same for every head. Hkv = Hs copies the model exactly.
    """
    cfg = model.config
    why = _unpoolable(cfg, n_kv_head)
    if why:
        raise ValueError(why)
    H, Hs, Dk, Dv = cfg.n_head, kv_heads_of(cfg), cfg.d_qk, cfg.d_v
    R = Hs // n_kv_head
    first = next(iter(model.params.values()))
    pooled = type(model)(cfg.replace(attention="gqa", n_kv_head=n_kv_head), dtype=first.dtype)
    if set(pooled.params) != set(model.params):
        raise ValueError("pooling key/value heads needs plain weights (merge a LoRA run first)")
    for name, p in pooled.params.items():
        src = model.params[name]
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
            q, k, v = np.split(src, [H * Dk, (H + Hs) * Dk], axis=-1)
            k = k.reshape(*k.shape[:-1], n_kv_head, R, Dk).mean(axis=-2).reshape(*k.shape[:-1], -1)
            v = v.reshape(*v.shape[:-1], n_kv_head, R, Dv).mean(axis=-2).reshape(*v.shape[:-1], -1)
            src = np.concatenate([q, k, v], axis=-1)
        np.copyto(p, src)
    return pooled


def _unpoolable(cfg, n_kv_head: int) -> str | None:
    """Why a model of ``cfg`` cannot have its key/value heads pooled into ``n_kv_head``, or None."""
    if cfg.arch != "gpt" or cfg.attention not in ("standard", "gqa"):
        return (f"pooling key/value heads needs a GPT with standard or grouped-query attention, "
                f"not {cfg.arch} with {cfg.attention} attention")
    heads = kv_heads_of(cfg)
    if n_kv_head < 1 or heads % n_kv_head:
        return f"n_kv_head ({n_kv_head}) must divide the model's {heads} key/value heads"
    return None


def _pooling(base, cfg):
    """A fine-tune into grouped-query attention (``--init-from RUN --attention gqa --n-kv-head
    K``): the base's key/value heads mean-pooled, K dividing them; refused before any weight
    is read."""
    want = kv_heads_of(cfg)
    why = _unpoolable(base, want)
    if why:
        raise ConfigError(f"--init-from with --n-kv-head {want}: the base run's key/value heads are "
                          f"mean-pooled, and {why}")
    return lambda model: pool_kv_heads(model, want)


def _check(cfg) -> None:
    n_kv_head = cfg.designs["gqa"].n_kv_head
    if n_kv_head is None:
        raise ConfigError("grouped-query attention needs --n-kv-head, the key/value heads (1: multi-query)")
    if cfg.n_head % n_kv_head:
        raise ConfigError(f"n_kv_head ({n_kv_head}) must divide n_head ({cfg.n_head})")


VARIANT = registry.declare(Variant(
    key="gqa", name="grouped-query attention", active=lambda cfg: cfg.attention == "gqa", axis="attention",
    summary="gqa: grouped-query attention, --n-kv-head key/value heads shared by the query heads.",
    options=GQAOptions, switch="--attention gqa",
    refuses={"encoder-decoder": "grouped-query attention is built for the GPT here (the encoder-decoder's "
                                "cross-attention has no grouped form)",
             "export": "GPT-2 has a key and a value head for every query head"},
    check=_check,
    convert=_pooling,
    describe=lambda cfg: ("grouped-query", f"{kv_heads_of(cfg)} key/value head{'s' * (kv_heads_of(cfg) != 1)} for "
                                           f"{cfg.n_head} query heads · KV cache {cfg.n_head // kv_heads_of(cfg)}× "
                                           f"smaller"),
    layer_cases=lambda: (
        ("attention [gqa: 4 heads, 2 key/value heads]",
         lambda C, H, rng, dtype: GroupedQueryAttention(C, 4, 3, C // 4, rng, dtype, 2)),
        ("attention [gqa: 2 key/value heads, causal query blocks]",
         lambda C, H, rng, dtype: GroupedQueryAttention(C, 4, 2, C // 4, rng, dtype, 2, split_rows=2)),
        # with the flash kernel and rotary positions where those designs are there
        *((("attention [gqa: multi-query, flash in tiles]",
            lambda C, H, rng, dtype: GroupedQueryAttention(C, 4, 2, C // 4, rng, dtype, 1, impl="flash",
                                                           tiles=(2, 3))),) * registry.has("kernel", "flash"))),
    model_cases=lambda: (
        ("gpt [gqa: 2 key/value heads for 4]", dict(attention="gqa", n_head=4, n_kv_head=2)),
        *((("gpt [gqa: multi-query, rope, untied head]",
            dict(attention="gqa", n_head=4, n_kv_head=1, positions="rope", tie_head=False)),)
          * registry.has("positions", "rope"))),
))
