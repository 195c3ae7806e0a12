"""What the model will be asked to do: the workload the cost model prices."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Workload"]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A generation run: one prefill of ``prompt_len`` tokens, then ``new_tokens`` decode steps.

    ``new_tokens=0`` is a single forward over the prompt. The context grows by one token per
    decode step, so the KV cache must hold ``batch_size x (prompt_len + new_tokens)`` tokens.

    Example::

        Workload(batch_size=16, prompt_len=2048, new_tokens=256)
    """

    batch_size: int = 1
    """Sequences generated together."""
    prompt_len: int = 512
    """Tokens in each prompt (prefill length)."""
    new_tokens: int = 128
    """Tokens generated per sequence after the prefill (decode steps)."""
    training: bool = False
    """Price a training step instead of generation (gradients, optimizer states, saved activations)."""
    optimizer: str = "adam"
    """Optimizer whose states a training step keeps: ``"adam"`` (two fp32 moments + fp32 master
    weights), ``"sgd"`` (momentum) or ``"none"``."""
    activation_checkpointing: bool = False
    """Training only: keep only unit inputs and recompute the rest in the backward."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "prompt_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Workload.{name} is {value!r}: it must be an int >= 1")
        if not isinstance(self.new_tokens, int) or isinstance(self.new_tokens, bool) or self.new_tokens < 0:
            raise ValueError(f"Workload.new_tokens is {self.new_tokens!r}: it must be an int >= 0 "
                             f"(0 means a single forward)")
        if self.optimizer not in ("adam", "sgd", "none"):
            raise ValueError(f"Workload.optimizer is {self.optimizer!r}: accepted are 'adam', 'sgd', 'none'")

    @property
    def context_len(self) -> int:
        """Tokens per sequence once generation ends: what the KV cache must hold."""
        return self.prompt_len + self.new_tokens

    @property
    def decode_steps(self) -> int:
        return 0 if self.training else self.new_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        return cls(**data)
