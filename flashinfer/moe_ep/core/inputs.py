"""Synthetic MoE inputs and weights for the demo, the tests and the benchmarks (never zeros).

Routings: ``uniform`` (K distinct experts per token, uniformly), ``skewed`` (every token picks the hot
expert 0, the rest uniformly), ``empty`` (only the first half of the experts is ever picked),
``one_expert`` (every token's slot 0 is expert 0; with K = 1 all tokens go to one expert).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import MoEEpConfigError
from .activations import fc1_rows

if TYPE_CHECKING:
    from .contracts import ModelContract

ROUTINGS = ("uniform", "skewed", "empty", "one_expert")


def make_topk(
    tokens: int,
    num_experts: int,
    top_k: int,
    *,
    routing: str = "uniform",
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    expert_range: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``topk_ids`` [T, K] int32 (distinct per token) and ``topk_weights`` [T, K] fp32 (sum 1).

    ``expert_range=(lo, hi)`` restricts picks to experts ``[lo, hi)`` (e.g. one rank's experts).
    """
    lo, hi = expert_range if expert_range is not None else (0, num_experts)
    if routing == "empty":
        hi = lo + max(top_k, (hi - lo) // 2)
    if routing not in ROUTINGS:
        raise MoEEpConfigError(f"unknown routing {routing!r}; expected one of {', '.join(ROUTINGS)}")
    if hi - lo < top_k:
        raise MoEEpConfigError(f"cannot pick {top_k} distinct experts out of [{lo}, {hi})")
    scores = torch.rand(tokens, hi - lo, generator=generator)
    if routing in ("skewed", "one_expert"):
        scores[:, 0] = 2.0  # the hot expert sorts first
    ids = scores.argsort(dim=1, descending=True)[:, :top_k] + lo
    if routing == "skewed" and top_k > 1:
        # keep the hot expert but not always in slot 0
        perm = torch.rand(tokens, top_k, generator=generator).argsort(dim=1)
        ids = ids.gather(1, perm)
    logits = torch.randn(tokens, top_k, generator=generator)
    weights = torch.softmax(logits, dim=1)
    return ids.to(torch.int32).to(device), weights.to(torch.float32).to(device)


def make_token_inputs(
    tokens: int,
    hidden_size: int,
    num_experts: int,
    top_k: int,
    sets: int,
    *,
    seed: int,
    device: torch.device | str = "cpu",
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``sets`` rotating input sets ``(hidden_states, topk_ids, topk_weights)`` for ``tokens`` tokens, drawn from a
    generator of their own (``seed`` and ``tokens``): a T gets the same inputs whatever other T a run also times
    (where the routing's busy-expert count decides a kernel's waves, runs with other token lists then compare)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + tokens)
    out = []
    for _ in range(sets):
        x = make_hidden_states(tokens, hidden_size, generator=gen, device=device)
        ids, w = make_topk(tokens, num_experts, top_k, generator=gen, device=device)
        out.append((x, ids, w))
    return out


def make_hidden_states(
    tokens: int, hidden_size: int, *, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    return torch.randn(tokens, hidden_size, generator=generator).to(torch.bfloat16).to(device)


def make_expert_weights(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    activation: str = "swiglu",
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13`` [E, FC1 rows, H] and ``w2`` [E, H, I], scaled so activations stay O(1).

    Drawn on the generator's device (a CUDA generator makes large weights on the GPU directly), one
    expert at a time so no fp32 copy of the whole tensor is ever held.
    """
    rows = fc1_rows(activation, intermediate_size)
    where = generator.device if generator is not None else torch.device("cpu")
    w13 = torch.empty(num_experts, rows, hidden_size, dtype=dtype, device=device)
    w2 = torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device)
    for e in range(num_experts):
        a = torch.randn(rows, hidden_size, generator=generator, device=where) * hidden_size**-0.5
        w13[e] = a.to(dtype)
        b = torch.randn(hidden_size, intermediate_size, generator=generator, device=where) * intermediate_size**-0.5
        w2[e] = b.to(dtype)
    return w13, w2


def make_contract_weights(
    contract: ModelContract, *, seed: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_expert_weights`` of a model contract, drawn on ``device`` by a generator seeded ``seed``
    (so the same seed gives the same weights to every script and backend)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    c = contract
    return make_expert_weights(
        c.num_experts, c.hidden_size, c.intermediate_size, c.activation, generator=gen, device=device
    )


def relative_errors(out: torch.Tensor, ref: torch.Tensor, floor: float = 1e-2) -> tuple[float, float]:
    """(mean, max) elementwise relative error over entries with |ref| > floor * max|ref|.

    NaN anywhere in ``out`` gives (inf, inf); an empty tensor gives (0, 0).
    """
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(out.shape)} vs {tuple(ref.shape)}")
    if out.numel() == 0:
        return 0.0, 0.0
    o, r = out.double(), ref.double()
    if not bool(torch.isfinite(o).all()):
        return float("inf"), float("inf")
    amax = r.abs().max()
    if amax == 0:
        err = (o - r).abs().max().item()
        return err, err
    mask = r.abs() > floor * amax
    rel = ((o - r).abs() / r.abs())[mask]
    return rel.mean().item(), rel.max().item()


def rounding_ulps(out: torch.Tensor, ref: torch.Tensor, term_scale: torch.Tensor) -> float:
    """Largest error in units of the bf16 rounding the semantics allow: ``max |out - ref| / (2^-8 (|ref| + S))``
    with ``S`` from ``moe_reference(..., return_term_scale=True)`` (magnitudes of the combine's and
    FC2's terms).

    Both sides round the activation ``a`` and every expert output ``y`` to bf16 after fp32 sums whose
    order is unspecified, so a correct result may differ from the reference by an ulp in any of those
    intermediates. Where terms cancel (``|ref| << S``) that is a large *relative* error of a small
    element but only a unit or two here; a wrong result is hundreds. NaN anywhere gives inf.
    """
    if out.numel() == 0:
        return 0.0
    o, r, sc = out.double(), ref.double(), term_scale.double()
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return ((o - r).abs() / (2.0**-8 * (r.abs() + sc)).clamp_min(1e-30)).max().item()


__all__ = ["ROUTINGS", "rounding_ulps", "make_expert_weights", "make_hidden_states", "make_topk", "relative_errors"]
