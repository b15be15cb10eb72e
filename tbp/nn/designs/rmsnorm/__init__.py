"""RMSNorm (Zhang & Sennrich 2019): each row divided by its root mean square and scaled by a
learned gain -- a layer norm without the centring and without the shift. The normalisation of
the Llama family (Llama, SmolLM2, Qwen2.5, TinyLlama, Mistral).

Its parts: ``rmsnorm.py`` (the layer, registered as ``--norm rms``, and its declaration) and
``twin.py`` (the same equations written the plain way, which the layer must equal)."""
from . import rmsnorm  # noqa: F401  (registers --norm rms and its declaration)
