"""The drop's own torch reference for the BF16 MoE expert computation (any device, fp32 math).

Semantics (the kernel matches these): for each pair (t, k) with e = topk_ids[t, k],
g = x[t] @ w13[e, :I].T, u = x[t] @ w13[e, I:].T (fp32), a = bf16(act(g, u)),
y = bf16(a @ w2[e].T), out[t] = bf16(sum_k (in order, fp32) topk_weights[t, k] * y_(t,k)).
``w13`` is in the natural (not interleaved) layout here.
"""

from __future__ import annotations

import math

import torch

from ..common import constants


def activation_fp32(act: str, g: torch.Tensor, u: torch.Tensor | None, limit: float | None = None) -> torch.Tensor:
    """act(g, u) in fp32 (``u`` is None for relu2, where ``g`` is the FC1 output)."""
    g = g.float()
    if act == constants.ACT_RELU2:
        r = torch.relu(g)
        return r * r
    assert u is not None
    u = u.float()
    if act == constants.ACT_SWIGLU:
        if limit is not None:
            g = torch.clamp(g, max=limit)
            u = torch.clamp(u, min=-limit, max=limit)
        return torch.nn.functional.silu(g) * u
    if act == constants.ACT_SWIGLU_OAI:
        lim = constants.SWIGLU_OAI_LIMIT if limit is None else limit
        g = torch.clamp(g, max=lim)
        u = torch.clamp(u, min=-lim, max=lim)
        return (u + 1.0) * (g * torch.sigmoid(constants.SWIGLU_OAI_ALPHA * g))
    if act == constants.ACT_GEGLU:
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * g * (1.0 + torch.tanh(c * (g + 0.044715 * g * g * g))) * u
    if act == constants.ACT_REGLU:
        return torch.relu(g) * u
    raise ValueError(f"unknown activation {act}")


def moe_bf16_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str = constants.ACT_SWIGLU,
    limit: float | None = None,
) -> torch.Tensor:
    """Reference MoE forward; returns out [T, H] bf16."""
    t_count, hidden = x.shape
    top_k = topk_ids.shape[1]
    gated = activation in constants.GATED_ACTIVATIONS
    inter = w2.shape[2]
    y_all = torch.zeros(t_count, top_k, hidden, dtype=torch.bfloat16, device=x.device)
    xf = x.float()
    for e in torch.unique(topk_ids).tolist():
        tok, kk = torch.nonzero(topk_ids == e, as_tuple=True)
        h = xf[tok] @ w13[e].float().T
        if gated:
            a = activation_fp32(activation, h[:, :inter], h[:, inter:], limit)
        else:
            a = activation_fp32(activation, h, None, limit)
        a = a.to(torch.bfloat16)
        y_all[tok, kk] = (a.float() @ w2[e].float().T).to(torch.bfloat16)
    acc = torch.zeros(t_count, hidden, dtype=torch.float32, device=x.device)
    for k in range(top_k):
        acc = acc + topk_weights[:, k : k + 1].float() * y_all[:, k].float()
    return acc.to(torch.bfloat16)
