"""The encoder-decoder (Vaswani et al. 2017; paper §7): an encoder over the source, and a GPT
whose blocks also cross-attend to the encoder's output.

Its parts: ``seq2seq.py`` (the Encoder, the DecoderBlock, the EncoderDecoder registered as
``--arch encoder-decoder``, its collation of pairs and its declaration), ``cross.py`` (the
cross-attention layer) and ``twin.py`` (the whole model written the plain way)."""
from . import seq2seq  # noqa: F401  (registers --arch encoder-decoder and its declaration)
