"""tbp: train and understand GPT-style transformers on a CPU, every gradient written by hand."""
from .version import __version__

from .nn import GPT, ModelConfig  # noqa: E402
from .checkpoint import load_model  # noqa: E402


def load(run, dtype=None, best: bool = False) -> GPT:
    """The model saved in a run directory (base + adapter for a LoRA run).

    dtype: None keeps the stored dtype; best=True takes the best-validation weights.
    """
    return load_model(run, dtype=dtype, best=best)[0]


# ``GPT.load(run)``: the same loader under the class, as the README has always spelled it; the
# engine itself never reads a file, so the method is attached here, above it
GPT.load = staticmethod(load)

__all__ = ["GPT", "ModelConfig", "load", "__version__"]
