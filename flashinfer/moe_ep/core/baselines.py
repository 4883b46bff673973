"""What a user would run without us: the ``torch._grouped_mm`` MoE pipeline (the benchmark baseline).

argsort permute -> grouped_mm FC1 -> activation -> grouped_mm FC2 -> weighted index_add. Same
semantics as ``core.reference`` up to where it rounds (it keeps FC1 in bf16 and accumulates the
combine with index_add), so it is a speed baseline, not an oracle.
"""

from __future__ import annotations

import torch

from .activations import apply_activation


def grouped_mm_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_t: torch.Tensor,
    w2_t: torch.Tensor,
    activation: str = "swiglu",
    activation_limit: float | None = None,
) -> torch.Tensor:
    """``w13_t`` [E, H, FC1 rows] and ``w2_t`` [E, I, H] are the transposed (column-major) views that
    ``torch._grouped_mm`` takes: pass ``w13.transpose(1, 2)`` and ``w2.transpose(1, 2)``."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of_row = order // k
    counts = torch.bincount(flat, minlength=w13_t.shape[0])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[token_of_row]
    h = torch._grouped_mm(xs, w13_t, offs=offs)
    a = apply_activation(h, activation, activation_limit).to(torch.bfloat16)
    y = torch._grouped_mm(a, w2_t, offs=offs)
    y = y.float() * topk_weights.reshape(-1)[order, None]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of_row, y)
    return out.to(torch.bfloat16)


__all__ = ["grouped_mm_moe"]
