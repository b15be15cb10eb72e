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

Each name has one home, its module (``tbp.nn.gpt.GPT``, ``tbp.nn.config.ModelConfig``): this
face is a caption and gives no names.
"""
