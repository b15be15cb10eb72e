"""tbp: train and understand GPT-style transformers on a CPU, every gradient written by hand."""
from .nn import GPT, ModelConfig

__version__ = "0.1.0"
__all__ = ["GPT", "ModelConfig", "__version__"]
