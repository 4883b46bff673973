"""The reference semantics of the MoE layer (BF16 path), in plain torch.

This is the function every backend computes; ``docs/numerics.md`` states it in prose. Per (token t,
slot k) with expert ``e = topk_ids[t, k]``::

    h   = x[t] @ w13[e].T                 accumulated in ``compute_dtype`` (fp32 by default)
    a   = bf16(act(h))                    FC2 input, rounded to bf16
    y   = bf16(a @ w2[e].T)               expert output (the combine wire format), rounded to bf16
    out = bf16(sum_k w[t, k] * y_k)       fp32, k = 0 .. K-1 in that order (deterministic)

Expert parallelism only moves rows between ranks; it does not change any rounding point, so the same
two pieces (:func:`expert_outputs`, :func:`combine_topk`) serve the single-process and the EP oracle.
The quantized layers (MXFP8, NVFP4) are in :mod:`core.reference_quant`, which reuses :func:`combine_topk`.
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
    fc2_abs: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert's MLP on ``x_rows`` [n, H]; returns the bf16 expert output [n, H].

    ``fc2_abs`` (optional, [n, H] fp32): receives ``|a| @ |w2|^T``, the magnitude of FC2's terms.
    """
    with exact_fp32_matmul():
        h = x_rows.to(compute_dtype) @ w13_e.to(compute_dtype).T
        a = apply_activation(h, activation.name, activation.limit).to(torch.bfloat16)
        y = a.to(compute_dtype) @ w2_e.to(compute_dtype).T
        if fc2_abs is not None:
            fc2_abs.copy_(a.float().abs() @ w2_e.float().abs().T)
    return y.to(torch.bfloat16)


def expert_outputs(
    x_rows: torch.Tensor,
    local_expert_of_row: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: ActivationSpec,
    compute_dtype: torch.dtype = torch.float32,
    fc2_abs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run each row of ``x_rows`` [n, H] through its (local) expert; returns bf16 [n, H] in row order.

    ``fc2_abs`` (optional, [n, H] fp32) receives each row's ``|a| @ |w2|^T`` (see :func:`expert_mlp`).
    """
    out = torch.empty(x_rows.shape[0], w2.shape[1], dtype=torch.bfloat16, device=x_rows.device)
    if x_rows.shape[0] == 0:
        return out
    for e in torch.unique(local_expert_of_row).tolist():
        rows = (local_expert_of_row == e).nonzero(as_tuple=True)[0]
        part = None if fc2_abs is None else torch.empty(rows.numel(), w2.shape[1], device=x_rows.device)
        out[rows] = expert_mlp(x_rows[rows], w13[e], w2[e], activation, compute_dtype, part)
        if fc2_abs is not None:
            fc2_abs[rows] = part
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


#: formats of the expert outputs ``y`` on their way back to the token's rank (the EP combine wire)
COMBINE_DTYPES = ("bf16", "mxfp8")


def combine_wire(y: torch.Tensor, combine_dtype: str) -> torch.Tensor:
    """bf16 expert outputs ``y [..., H]`` as the combine receives them: unchanged (``"bf16"``), or
    quantized to MXFP8 along H (blocks of 32, ``core.quant.quantize_mxfp8``) and dequantized, exactly
    representable in bf16 again (``"mxfp8"``: 1 + 1/32 bytes per element on the wire instead of 2)."""
    if combine_dtype == "bf16":
        return y
    if combine_dtype != "mxfp8":
        raise ValueError(f"combine_dtype must be one of {COMBINE_DTYPES}, got {combine_dtype!r}")
    from .quant import dequantize_mxfp8, quantize_mxfp8

    return dequantize_mxfp8(*quantize_mxfp8(y)).to(torch.bfloat16)


def moe_reference(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: ActivationSpec | str = "swiglu",
    activation_limit: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    *,
    return_term_scale: bool = False,
    combine_dtype: str = "bf16",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The whole layer on one process holding every expert: [T, H] bf16.

    ``compute_dtype=torch.float64`` gives an fp64-accumulated oracle with the same rounding points.
    ``return_term_scale``: also return ``S = sum_k |w[t,k]| (|y_(t,k)| + (|a_(t,k)| @ |w2|^T))`` (fp32
    [T, H]): the magnitude of the terms of the combine and of FC2, which bounds, to first order, what a
    one-ulp difference in any bf16 intermediate (``a`` or ``y``) can do to an output element (see
    ``core.inputs.rounding_ulps``). ``combine_dtype``: the wire format of ``y`` (``combine_wire``).
    """
    spec = activation if isinstance(activation, ActivationSpec) else ActivationSpec(activation, activation_limit)
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    x_rows = hidden_states.repeat_interleave(k, dim=0) if t else hidden_states[:0]
    fc2_abs = torch.empty(t * k, w2.shape[1], device=hidden_states.device) if return_term_scale else None
    y = expert_outputs(x_rows, flat_ids, w13, w2, spec, compute_dtype, fc2_abs).view(t, k, w2.shape[1])
    y = combine_wire(y, combine_dtype)
    out = combine_topk(y, topk_weights)
    if fc2_abs is None:
        return out
    terms = y.float().abs() + fc2_abs.view(t, k, w2.shape[1])
    scale = (topk_weights.float().abs()[:, :, None] * terms).sum(dim=1)
    return out, scale


__all__ = [
    "COMBINE_DTYPES",
    "combine_topk",
    "combine_wire",
    "exact_fp32_matmul",
    "expert_mlp",
    "expert_outputs",
    "moe_reference",
]
