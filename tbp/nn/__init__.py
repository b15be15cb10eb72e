"""The engine: a GPT in NumPy with every gradient written by hand.

Shape glossary, used in every docstring and shape comment below:

    B  batch            T  time (tokens in a sequence)     C  channels (d_model)
    H  attention heads  Dk query/key width per head        Dv value width per head
    V  vocabulary       L  layers                          R  LoRA rank
    N  B * T, the number of predicted positions

Contract: each layer holds ``params`` and ``grads`` dicts with the same keys (a frozen
parameter has no gradient); ``forward`` keeps what ``backward`` needs; ``backward(dout)``
*adds* into ``grads`` and returns the gradient of its input. A layer that decoding uses also
has its inference form beside them (``fold``: weights prepared once; ``decode_state`` and
``decode``: one step on preallocated buffers, decode.py). A variant -- an attention kind, a
residual scheme, positions, an architecture, a kernel -- declares what the rest of tbp asks of
it in its own module (variant.py); build.py is the registry of them all. ``reference`` states
every layer's equations plainly, and the tests hold the fast layers to it. Nothing here
imports anything but numpy.
"""
from .config import ConfigError, ModelConfig
from .module import Module, Stack
from .layout import Layout
from .embedding import Embedding
from .linear import Linear, LoRA
from .layernorm import LayerNorm
from .attention import CausalSelfAttention
from .cross import CrossAttention
from .mta import MultiTokenAttention
from .mlp import MLP
from .loss import cross_entropy, CrossEntropy
from .build import build_model, model_class
from .gpt import Block, GPT, LanguageModel, LORA_TARGETS, add_lora, merge_lora
from .seq2seq import DecoderBlock, Encoder, EncoderDecoder
from .decode import Inference

__all__ = [
    "ConfigError", "ModelConfig", "Module", "Stack", "Layout", "Embedding", "Linear", "LoRA", "LayerNorm",
    "CausalSelfAttention", "CrossAttention", "MultiTokenAttention", "Inference",
    "DecoderBlock", "Encoder", "EncoderDecoder", "LanguageModel", "build_model", "model_class", "MLP",
    "cross_entropy", "CrossEntropy", "Block", "GPT", "LORA_TARGETS", "add_lora", "merge_lora",
]
