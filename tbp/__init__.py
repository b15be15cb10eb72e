"""tbp: train and understand GPT-style transformers on a CPU, every gradient written by hand."""
__version__ = "0.1.0"

from .model import GPT  # noqa: E402
from .nn import ModelConfig  # noqa: E402

__all__ = ["GPT", "ModelConfig", "__version__"]
