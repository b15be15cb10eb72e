"""The engine: a GPT in NumPy with every gradient written by hand.

Shape glossary, used in every docstring and shape comment below:

    B  batch            T  time (tokens in a sequence)     C  channels (d_model)
    H  attention heads  Dk query/key width per head        Dv value width per head
    V  vocabulary       L  layers                          R  LoRA rank
    N  B * T, the number of predicted positions
    Hkv  key/value heads (H, or fewer when groups of query heads share them)
    G    query heads per key/value head, H / Hkv

Contract: each layer holds ``params`` and ``grads`` dicts with the same keys (a frozen
parameter has no gradient); ``forward`` keeps what ``backward`` needs; ``backward(dout)``
*adds* into ``grads`` and returns the gradient of its input. A layer that decoding uses also
has its inference form beside them (``fold``: weights prepared once; ``decode_state`` and
``decode``: one step on preallocated buffers, decode.py). A variant -- an attention kind, a
residual scheme, positions, an architecture, a kernel -- declares what the rest of tbp asks of
it in its own module (variant.py); the choices of each axis are in the registry (registry.py,
a leaf that the designs of ``designs/`` register into), and build.py turns a config into parts.
``reference`` states every layer's equations plainly, and the tests hold the fast layers to it.
Nothing here imports anything but numpy.

This face is lazy (PEP 562): ``import tbp.nn.config`` loads the config and the registry only;
a name below is imported when first asked for.
"""
from importlib import import_module

_HOMES = {
    "ConfigError": "config", "ModelConfig": "config", "Module": "module", "Stack": "module", "Layout": "layout",
    "Embedding": "embedding", "Linear": "linear", "LoRA": "linear", "LayerNorm": "layernorm",
    "CausalSelfAttention": "attention", "CrossAttention": "designs.encdec", "MultiTokenAttention": "designs.mta", "MLP": "mlp",
    "cross_entropy": "loss", "CrossEntropy": "loss", "build_model": "build", "model_class": "build",
    "Block": "gpt", "GPT": "gpt", "LanguageModel": "gpt", "LORA_TARGETS": "lora", "add_lora": "lora",
    "merge_lora": "lora", "DecoderBlock": "designs.encdec", "Encoder": "designs.encdec",
    "EncoderDecoder": "designs.encdec", "pool_kv_heads": "designs.gqa",
    "Inference": "decode",
}
__all__ = list(_HOMES)


def _engine() -> None:
    """The builder (it installs the config's checks and imports the designs wing, the
    encoder-decoder among them) and the GPT, which register with it."""
    for home in ("build", "gpt"):
        import_module(f".{home}", __name__)


def __getattr__(name: str):
    if name == "build":                          # ``from tbp.nn import build``: with its architectures
        _engine()
        return import_module(".build", __name__)
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tbp.nn' has no attribute {name!r}")
    if home != "config" or name == "ModelConfig":
        _engine()
    value = getattr(import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value
