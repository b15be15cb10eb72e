"""ALiBi positions (Press et al. 2022): a linear bias on the scores, no position embedding.

Its parts: ``alibi.py`` (the positions object, registered as ``--positions alibi``), ``twin.py``
(the plain loop the layer must equal) and the declaration below (what tbp asks of it)."""
from ... import registry
from ...attention import CausalSelfAttention
from ..gqa import GroupedQueryAttention
from ...variant import Variant
from .alibi import Alibi, slopes

__all__ = ["Alibi", "slopes", "VARIANT"]

VARIANT = registry.declare(Variant(
    key="alibi", name="ALiBi positions", active=lambda cfg: cfg.positions == "alibi", axis="positions",
    switch="--positions alibi",
    describe=lambda cfg: ("alibi", f"linear biases, slopes {slopes(cfg.n_head)[0]:g} .. {slopes(cfg.n_head)[-1]:g} "
                                   f"· past the context of {cfg.n_ctx}, a sliding window"),
    refuses={"mta": "Multi-Token Attention uses learned positions here (ALiBi's bias is not wired into its "
                    "convolved scores)",
             "encoder-decoder": "an encoder-decoder uses learned positions (ALiBi is for the decoder-only GPT)",
             "sparse": "sparse decoding gathers kept positions without their ALiBi bias: use dense decoding",
             "export": "GPT-2 learns a vector per position; it has no linear bias on the scores",
             "gguf": "tbp writes llama.cpp's gpt2 and gptneox graphs, neither of which has ALiBi's bias"},
    layer_cases=(
        ("attention [alibi]", lambda C, H, rng, dtype: CausalSelfAttention(C, H, 4, C // H, rng, dtype,
                                                                           positions=Alibi(H))),
        ("attention [alibi, flash in tiles, window 3]",
         lambda C, H, rng, dtype: CausalSelfAttention(C, H, 4, C // H, rng, dtype, impl="flash", tiles=(2, 3),
                                                      positions=Alibi(H), window=3)),
        ("attention [alibi, causal query blocks, 3 heads]",
         lambda C, H, rng, dtype: CausalSelfAttention(C, 3, 2, 2, rng, dtype, split_rows=2, positions=Alibi(3))),
        ("attention [gqa + alibi]",
         lambda C, H, rng, dtype: GroupedQueryAttention(C, 4, 2, C // 4, rng, dtype, 2, positions=Alibi(4)))),
    model_cases=(("gpt [alibi]", dict(positions="alibi")),
                 ("gpt [alibi, gqa, untied head]", dict(positions="alibi", attention="gqa", n_head=4, n_kv_head=2,
                                                        tie_head=False))),
))
