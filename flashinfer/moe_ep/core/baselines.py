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
    y = _expert_mlp(x[token_of_row], counts, w13_t, w2_t, activation, activation_limit)
    y = y.float() * topk_weights.reshape(-1)[order, None]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of_row, y)
    return out.to(torch.bfloat16)


def _expert_mlp(
    rows: torch.Tensor,
    counts: torch.Tensor,
    w13_t: torch.Tensor,
    w2_t: torch.Tensor,
    activation: str,
    activation_limit: float | None,
) -> torch.Tensor:
    """FC1 -> activation -> FC2 of rows already grouped by expert (``counts[e]`` rows of expert e)."""
    if rows.shape[0] == 0:
        return rows.new_empty(0, w2_t.shape[2])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(rows, w13_t, offs=offs)
    a = apply_activation(h, activation, activation_limit).to(torch.bfloat16)
    return torch._grouped_mm(a, w2_t, offs=offs)


def split_ep_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_t: torch.Tensor,
    w2_t: torch.Tensor,
    group: object = None,
    activation: str = "swiglu",
    activation_limit: float | None = None,
) -> torch.Tensor:
    """Expert parallelism as an engine builds it without a fused kernel (the EP benchmark baseline):
    ``all_to_all_single`` dispatch of every (token, k) pair's row to the rank owning its expert, the
    grouped_mm pipeline on that rank's experts, ``all_to_all_single`` of the results back, and the
    weighted sum per token at the source. Collective: every rank of ``group`` calls it (zero tokens
    allowed). ``w13_t`` / ``w2_t``: this rank's experts, transposed as for ``grouped_mm_moe``; rank r
    owns global experts [r * E_local, (r + 1) * E_local). The split sizes go through the host (a sync),
    as in engines that use ``all_to_all_single`` with variable splits."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    e_local = w13_t.shape[0]
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    dest = flat // e_local
    order = torch.argsort(flat, stable=True)  # by expert, so by owner rank, then local expert
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
    local_ids = (flat % e_local)[order].to(torch.int32)
    recv_rows = x.new_empty(sum(recv_split), x.shape[1])
    dist.all_to_all_single(recv_rows, x[order // k].contiguous(), recv_split, send_split, group=group)
    recv_ids = local_ids.new_empty(sum(recv_split))
    dist.all_to_all_single(recv_ids, local_ids, recv_split, send_split, group=group)
    by_expert = torch.argsort(recv_ids, stable=True)  # rows from every source, grouped by local expert
    counts = torch.bincount(recv_ids.long(), minlength=e_local)
    y_sorted = _expert_mlp(recv_rows[by_expert], counts, w13_t, w2_t, activation, activation_limit)
    y = torch.empty_like(y_sorted)
    y[by_expert] = y_sorted
    back = x.new_empty(t * k, x.shape[1])
    dist.all_to_all_single(back, y, send_split, recv_split, group=group)
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, order // k, back.float() * topk_weights.reshape(-1)[order, None])
    return out.to(torch.bfloat16)


__all__ = ["grouped_mm_moe", "split_ep_moe"]
