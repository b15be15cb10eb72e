"""ModelConfig: the shape and options of a GPT (validated, JSON-friendly)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

ACTIVATIONS = ("gelu", "relu")


class DictConfig:
    """JSON round trip for a config dataclass; unknown keys are an error, never ignored."""
    KIND = "config"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown {cls.KIND} keys: {', '.join(sorted(unknown))}")
        return cls(**d)


@dataclass
class ModelConfig(DictConfig):
    vocab_size: int = 65          # V: tokens the model reads and predicts
    n_ctx: int = 128              # longest sequence (number of learned positions)
    n_layer: int = 4              # L: transformer blocks
    n_head: int = 4               # H: attention heads per block
    d_model: int = 128            # C: width of the residual stream
    d_qk: int | None = None       # Dk: query/key width per head (paper's d_rho); None -> C // H
    bias: bool = True             # biases on every linear layer and layer norm
    activation: str = "gelu"      # MLP nonlinearity: "gelu" (tanh approximation, GPT-2) or "relu"
    ln_eps: float = 1e-5          # layer norm epsilon (the paper's checks use 0)
    tie_head: bool = True         # logits = ln_f(x) @ wte.T; False: an untied lm_head (+ bias)
    causal: bool = True           # causal mask; False gives permutation-equivariant attention
    KIND = "model config"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_ctx", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.d_qk is not None and (not isinstance(self.d_qk, int) or self.d_qk < 1):
            raise ValueError(f"d_qk must be a positive integer or None, got {self.d_qk!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if not self.ln_eps >= 0:
            raise ValueError(f"ln_eps must be >= 0, got {self.ln_eps!r}")

    @property
    def d_head(self) -> int:
        """Dv: value width per head, C // H, so heads concatenate back to C."""
        return self.d_model // self.n_head

    @property
    def d_key(self) -> int:
        """Dk: query/key width per head."""
        return self.d_qk if self.d_qk is not None else self.d_head
