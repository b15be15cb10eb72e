"""tbp: train and understand GPT-style transformers on a CPU, every gradient written by hand.

The documented Python API: ``tbp.GPT``, ``tbp.ModelConfig`` and ``tbp.load``. They are
imported when first asked for (PEP 562), so ``import tbp`` and its data layer
(``tbp.data``) load no engine. Everything else has one home, its module; the packages by role
are ``nn`` (the engine), ``data``, ``train``, ``runs``, ``generate``, ``look``, ``interop``,
``check``, ``machine``, ``files`` and ``cli``, each captioned in its ``__init__``.
"""
from .version import __version__

__all__ = ["GPT", "ModelConfig", "load", "__version__"]


def load(run, dtype=None, best: bool = False):
    """The model saved in a run directory (base + adapter for a LoRA run).

    dtype: None keeps the stored dtype; best=True takes the best-validation weights.
    """
    from .runs.disk import load_model
    return load_model(run, dtype=dtype, best=best)[0]


def __getattr__(name: str):
    if name == "GPT":
        from .nn.gpt import GPT
        # ``GPT.load(run)``: the loader under the class, as the README spells it; the engine
        # itself never reads a file, so the method is attached here, above it
        GPT.load = staticmethod(load)
        return GPT
    if name == "ModelConfig":
        from .nn.config import ModelConfig
        return ModelConfig
    raise AttributeError(f"module 'tbp' has no attribute {name!r}")
