"""tbp: train and understand GPT-style transformers on a CPU, every gradient written by hand.

The package's face is lazy (PEP 562): ``import tbp`` and its data layer (``tbp.tokenizer``,
``tbp.data``) load no engine; ``tbp.GPT``, ``tbp.ModelConfig`` and ``tbp.load`` import it when
first asked for.
"""
from .version import __version__

__all__ = ["GPT", "ModelConfig", "load", "__version__"]


def load(run, dtype=None, best: bool = False):
    """The model saved in a run directory (base + adapter for a LoRA run).

    dtype: None keeps the stored dtype; best=True takes the best-validation weights.
    """
    from .runfiles import load_model
    return load_model(run, dtype=dtype, best=best)[0]


def __getattr__(name: str):
    if name in ("GPT", "ModelConfig"):
        from . import nn
        if name == "GPT":
            # ``GPT.load(run)``: the loader under the class, as the README spells it; the engine
            # itself never reads a file, so the method is attached here, above it
            nn.GPT.load = staticmethod(load)
        return getattr(nn, name)
    raise AttributeError(f"module 'tbp' has no attribute {name!r}")
