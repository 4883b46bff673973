"""The reference semantics of the MoE layer (BF16 path), in plain torch.

This is the function every backend computes; ``docs/numerics.md`` states it in prose. Per (token t,
slot k) with expert ``e = topk_ids[t, k]``::

    h   = x[t] @ w13[e].T                 accumulated in ``compute_dtype`` (fp32 by default)
    a   = bf16(act(h))                    FC2 input, rounded to bf16
    y   = bf16(a @ w2[e].T)               expert output (the combine wire format), rounded to bf16
    out = bf16(sum_k w[t, k] * y_k)       fp32, k = 0 .. K-1 in that order (deterministic)

Expert parallelism only moves rows between ranks; it does not change any rounding point, so the same
two pieces (:func:`expert_outputs`, :func:`combine_topk`) serve the single-process and the EP oracle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .activations import ActivationSpec, apply_activation


@contextlib.contextmanager
def exact_fp32_matmul() -> Iterator[None]:
    """Disable TF32 for matmuls inside the block (a reference must accumulate in true fp32)."""
    cuda_flag = torch.backends.cuda.matmul.allow_tf32
    cudnn_flag = torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = cuda_flag
        torch.backends.cudnn.allow_tf32 = cudnn_flag


def expert_mlp(
    x_rows: torch.Tensor,
    w13_e: torch.Tensor,
    w2_e: torch.Tensor,
    activation: ActivationSpec,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One expert's MLP on ``x_rows`` [n, H]; returns the bf16 expert output [n, H]."""
    with exact_fp32_matmul():
        h = x_rows.to(compute_dtype) @ w13_e.to(compute_dtype).T
        a = apply_activation(h, activation.name, activation.limit).to(torch.bfloat16)
        y = a.to(compute_dtype) @ w2_e.to(compute_dtype).T
    return y.to(torch.bfloat16)


def expert_outputs(
    x_rows: torch.Tensor,
    local_expert_of_row: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: ActivationSpec,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Run each row of ``x_rows`` [n, H] through its (local) expert; returns bf16 [n, H] in row order."""
    out = torch.empty(x_rows.shape[0], w2.shape[1], dtype=torch.bfloat16, device=x_rows.device)
    if x_rows.shape[0] == 0:
        return out
    for e in torch.unique(local_expert_of_row).tolist():
        rows = (local_expert_of_row == e).nonzero(as_tuple=True)[0]
        out[rows] = expert_mlp(x_rows[rows], w13[e], w2[e], activation, compute_dtype)
    return out


def combine_topk(y_pairs: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Weighted top-k reduce: ``y_pairs`` [T, K, H] bf16, weights [T, K] -> bf16 [T, H].

    Accumulates in fp32 over k = 0 .. K-1 in order, so the result is deterministic.
    """
    t, k, h = y_pairs.shape
    acc = torch.zeros(t, h, dtype=torch.float32, device=y_pairs.device)
    w = topk_weights.float()
    for j in range(k):
        acc += w[:, j, None] * y_pairs[:, j].float()
    return acc.to(torch.bfloat16)


def moe_reference(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: ActivationSpec | str = "swiglu",
    activation_limit: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The whole layer on one process holding every expert: [T, H] bf16.

    ``compute_dtype=torch.float64`` gives an fp64-accumulated oracle with the same rounding points.
    """
    spec = activation if isinstance(activation, ActivationSpec) else ActivationSpec(activation, activation_limit)
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    x_rows = hidden_states.repeat_interleave(k, dim=0) if t else hidden_states[:0]
    y = expert_outputs(x_rows, flat_ids, w13, w2, spec, compute_dtype)
    return combine_topk(y.view(t, k, w2.shape[1]), topk_weights)


__all__ = ["combine_topk", "exact_fp32_matmul", "expert_mlp", "expert_outputs", "moe_reference"]
