"""The reference semantics against an independent per-token brute force, and its invariants."""

import pytest
import torch

from flashinfer.moe_ep.core.activations import apply_activation
from flashinfer.moe_ep.core.inputs import make_expert_weights, make_hidden_states, make_topk
from flashinfer.moe_ep.core.reference import combine_topk, moe_reference


def _brute_force(x, ids, w, w13, w2, act, limit):
    """Token by token, pair by pair, with the same rounding points, in fp64."""
    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.bfloat16)
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float32)
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e].double() @ x[t].double()
            a = apply_activation(h[None], act, limit)[0].to(torch.bfloat16)
            y = (w2[e].double() @ a.double()).to(torch.bfloat16)
            acc += w[t, k] * y.float()
        out[t] = acc.to(torch.bfloat16)
    return out


@pytest.mark.parametrize("act,limit", [("swiglu", None), ("swiglu", 2.0), ("swiglu_oai", None), ("relu2", None)])
@pytest.mark.parametrize("routing", ["uniform", "skewed", "empty"])
def test_matches_brute_force(act, limit, routing, gen) -> None:
    e, h, i, k, t = 6, 32, 16, 3, 9
    w13, w2 = make_expert_weights(e, h, i, act, generator=gen)
    x = make_hidden_states(t, h, generator=gen)
    ids, w = make_topk(t, e, k, routing=routing, generator=gen)
    got = moe_reference(x, ids, w, w13, w2, act, limit, compute_dtype=torch.float64)
    want = _brute_force(x, ids, w, w13, w2, act, limit)
    assert torch.equal(got, want)


def test_zero_tokens() -> None:
    w13, w2 = make_expert_weights(4, 16, 8)
    out = moe_reference(
        torch.empty(0, 16, dtype=torch.bfloat16), torch.empty(0, 2, dtype=torch.int32), torch.empty(0, 2), w13, w2
    )
    assert out.shape == (0, 16) and out.dtype == torch.bfloat16


def test_combine_is_in_k_order_fp32() -> None:
    y = torch.tensor([[[1.0], [2.0**-9], [2.0**-9]]], dtype=torch.bfloat16)  # [T=1, K=3, H=1]
    w = torch.ones(1, 3)
    # fp32 sum in order: 1 + 2^-9 + 2^-9 = 1 + 2^-8 (exact in fp32) -> bf16 rounds to 1 + 2^-7? no: ties to even -> 1.0
    out = combine_topk(y, w)
    assert out.item() == torch.tensor(1.0 + 2.0**-8).to(torch.bfloat16).item()


@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_rounding_units_separate_rounding_noise_from_a_routing_bug(act, gen) -> None:
    from flashinfer.moe_ep.core.inputs import rounding_ulps

    e, h, i, k, t = 16, 256, 128, 4, 600
    w13, w2 = make_expert_weights(e, h, i, act, generator=gen)
    x = make_hidden_states(t, h, generator=gen)
    ids, w = make_topk(t, e, k, generator=gen)
    w[3] = torch.tensor([0.7, 0.1, 0.1, 0.1])  # the pair misrouted below carries most of token 3
    ref64, scale = moe_reference(x, ids, w, w13, w2, act, compute_dtype=torch.float64, return_term_scale=True)
    ref32 = moe_reference(x, ids, w, w13, w2, act)
    assert rounding_ulps(ref32, ref64, scale) <= 4.0  # same semantics, other accumulation: noise
    wrong = ids.clone()
    wrong[3, 0] = next(j for j in range(e) if j not in ids[3].tolist())  # one pair misrouted
    bug = moe_reference(x, wrong, w, w13, w2, act)
    assert rounding_ulps(bug, ref64, scale) > 20.0
    assert rounding_ulps(torch.full_like(ref32, float("nan")), ref64, scale) == float("inf")
    empty = moe_reference(x[:0], ids[:0], w[:0], w13, w2, act, return_term_scale=True)
    assert empty[0].shape == (0, h) and rounding_ulps(empty[0], empty[0], empty[1]) == 0.0
