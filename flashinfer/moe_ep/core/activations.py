"""Expert activations, computed in fp32.

Gated activations take the gate and up halves of FC1 (``w13`` rows ``[0, I)`` are gate, ``[I, 2I)`` up);
``relu2`` is non-gated and takes the whole FC1 output. Every backend must compute exactly these
functions; the kernels' epilogues are checked against them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import MoEEpConfigError
from .validation import is_positive_finite

#: gpt-oss constants for ``swiglu_oai``.
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0

GATED_ACTIVATIONS = ("swiglu", "swiglu_oai", "geglu", "reglu")
ACTIVATIONS = (*GATED_ACTIVATIONS, "relu2")


@dataclass(frozen=True)
class ActivationSpec:
    """An activation by name plus its optional clamp ``limit`` (only ``swiglu`` and ``swiglu_oai`` take one)."""

    name: str = "swiglu"
    limit: float | None = None

    def __post_init__(self) -> None:
        validate_activation(self.name, self.limit)

    @property
    def gated(self) -> bool:
        return self.name in GATED_ACTIVATIONS

    @property
    def effective_limit(self) -> float | None:
        if self.name == "swiglu_oai":
            return SWIGLU_OAI_LIMIT if self.limit is None else self.limit
        return self.limit


def validate_activation(name: str, limit: float | None) -> None:
    if name not in ACTIVATIONS:
        raise MoEEpConfigError(f"unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}")
    if limit is not None:
        if name not in ("swiglu", "swiglu_oai"):
            raise MoEEpConfigError(f"activation {name!r} takes no clamp limit (got limit={limit})")
        if not is_positive_finite(limit):
            raise MoEEpConfigError(f"activation limit must be a finite positive number, got {limit!r}")


def fc1_rows(name: str, intermediate_size: int) -> int:
    """Rows of ``w13`` per expert: ``2I`` for gated activations, ``I`` for ``relu2``."""
    validate_activation(name, None)
    return 2 * intermediate_size if name in GATED_ACTIVATIONS else intermediate_size


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def apply_activation(h: torch.Tensor, name: str, limit: float | None = None) -> torch.Tensor:
    """Apply activation ``name`` to the FC1 output ``h`` [..., 2I] (gated) or [..., I] (relu2), in fp32.

    Returns [..., I] in fp32 (fp64 for fp64 input; callers round to the FC2 input format).
    """
    spec = ActivationSpec(name, limit)
    h = h if h.dtype == torch.float64 else h.float()  # fp64 only for the fp64 oracle
    if not spec.gated:
        return torch.relu(h).square()
    i = h.shape[-1] // 2
    gate, up = h[..., :i], h[..., i:]
    lim = spec.effective_limit
    if lim is not None:
        gate = gate.clamp(max=lim)
        up = up.clamp(min=-lim, max=lim)
    if name == "swiglu":
        return torch.nn.functional.silu(gate) * up
    if name == "swiglu_oai":
        return (up + 1.0) * gate * torch.sigmoid(SWIGLU_OAI_ALPHA * gate)
    if name == "geglu":
        return gelu_tanh(gate) * up
    return torch.relu(gate) * up  # reglu


__all__ = [
    "ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "SWIGLU_OAI_ALPHA",
    "SWIGLU_OAI_LIMIT",
    "ActivationSpec",
    "apply_activation",
    "fc1_rows",
    "gelu_tanh",
    "validate_activation",
]
