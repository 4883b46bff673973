"""The reference backend with MXFP8 / NVFP4 weight packs: world 1 equals ``moe_reference_quantized``, EP over
gloo (world 2) equals the single-process result, bad packs and configs raise."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.core.inputs import make_expert_weights, make_hidden_states, make_topk, rounding_ulps
from flashinfer.moe_ep.core.reference import moe_reference
from flashinfer.moe_ep.core.reference_quant import (
    QuantizedExpertWeights,
    moe_reference_quantized,
    quantize_expert_weights,
)
from flashinfer.moe_ep.core.runtime.local_ranks import run_on_local_ranks

E, H, I, K, TMAX = 8, 64, 32, 3, 16


def _pack(q: QuantizedExpertWeights, experts: slice = slice(None)) -> moe.MoEWeightPack:
    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[experts].contiguous()

    return moe.MoEWeightPack(
        part(q.w13), part(q.w2), part(q.w13_scale), part(q.w2_scale), part(q.w13_global_scale), part(q.w2_global_scale)
    )


def _config(fmt: str, act: str = "swiglu", **kw: object) -> moe.ReferenceMegaMoeConfig:
    return moe.ReferenceMegaMoeConfig(H, I, E, K, act, weight_format=fmt, **kw)


def _layer(pack: moe.MoEWeightPack, config: moe.ReferenceMegaMoeConfig, world: int = 1, rank: int = 0):
    return moe.MoEEpLayer(
        moe.BootstrapConfig(world_size=world, rank=rank, device="cpu"),
        moe.FleetParams(E, TMAX, H),
        pack,
        backend=moe.MegaConfig(config),
    )


def _inputs(seed: int, t: int, act: str = "swiglu"):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = make_expert_weights(E, H, I, act, generator=g)
    return w13, w2, make_hidden_states(t, H, generator=g), *make_topk(t, E, K, generator=g)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("act", ["swiglu", "relu2"])
@pytest.mark.parametrize("t", [0, 1, 7])
def test_world1_equals_reference(fmt: str, act: str, t: int) -> None:
    w13, w2, x, ids, w = _inputs(10 + t, t, act)
    q = quantize_expert_weights(w13, w2, fmt)
    layer = _layer(_pack(q), _config(fmt, act))
    got = layer.forward(moe.MoEEpTensors(x, ids, w))
    assert torch.equal(got, moe_reference_quantized(x, ids, w, q, act, fmt=fmt))
    layer.destroy()


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "nvfp4"])
def test_mxfp8_combine_wire_rounds_the_expert_outputs(fmt: str) -> None:
    """``combine_dtype="mxfp8"``: every expert output row is quantized to MXFP8 along H before the combine
    (world 1 too), which changes the result against the bf16 wire and equals the reference with it."""
    w13, w2, x, ids, w = _inputs(21, 9)
    if fmt == "bf16":
        pack, want = moe.MoEWeightPack(w13, w2), moe_reference(x, ids, w, w13, w2, combine_dtype="mxfp8")
        plain = moe_reference(x, ids, w, w13, w2)
    else:
        q = quantize_expert_weights(w13, w2, fmt)
        pack, want = _pack(q), moe_reference_quantized(x, ids, w, q, fmt=fmt, combine_dtype="mxfp8")
        plain = moe_reference_quantized(x, ids, w, q, fmt=fmt)
    layer = _layer(pack, _config(fmt, combine_dtype="mxfp8"))
    got = layer.forward(moe.MoEEpTensors(x, ids, w))
    assert torch.equal(got, want) and not torch.equal(got, plain)
    layer.destroy()


def test_nvfp4_static_activation_scales() -> None:
    w13, w2, x, ids, w = _inputs(3, 7)
    q = quantize_expert_weights(w13, w2, "nvfp4")
    layer = _layer(_pack(q), _config("nvfp4", input_global_scale=2e-3, fc2_input_global_scale=5e-4))
    got = layer.forward(moe.MoEEpTensors(x, ids, w))
    want = moe_reference_quantized(x, ids, w, q, fmt="nvfp4", input_global_scale=2e-3, fc2_input_global_scale=5e-4)
    assert torch.equal(got, want)
    assert not torch.equal(got, moe_reference_quantized(x, ids, w, q, fmt="nvfp4"))


def test_bf16_unchanged() -> None:
    cfg = moe.ReferenceMegaMoeConfig(H, I, E, K)
    assert cfg.weight_format == "bf16" and moe.MegaKernelConfig.weight_format == "bf16"
    assert [f.name for f in dataclasses.fields(cfg)][1:5] == [
        "hidden_size",
        "intermediate_size",
        "num_experts",
        "top_k",
    ]


# ----------------------------------------------------------------------------------------------------------
# EP over gloo
# ----------------------------------------------------------------------------------------------------------


def _global(seed: int, tokens_per_rank: list[int], fmt: str, act: str):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = make_expert_weights(E, H, I, act, generator=g)
    t = sum(tokens_per_rank)
    x = make_hidden_states(t, H, generator=g)
    ids, w = make_topk(t, E, K, generator=g)
    return quantize_expert_weights(w13, w2, fmt), x, ids, w


def _rank(rank: int, world: int, seed: int, tokens_per_rank: list[int], fmt: str, act: str, kw: dict):
    q, x, ids, w = _global(seed, tokens_per_rank, fmt, act)
    lo = sum(tokens_per_rank[:rank])
    mine = slice(lo, lo + tokens_per_rank[rank])
    e_local = E // world
    layer = _layer(_pack(q, slice(rank * e_local, (rank + 1) * e_local)), _config(fmt, act, **kw), world, rank)
    outs = [layer.forward(moe.MoEEpTensors(x[mine], ids[mine], w[mine])) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    layer.destroy()
    return outs[0]


@pytest.mark.parametrize(
    "fmt,act,tokens_per_rank,kw",
    [
        ("mxfp8", "swiglu", [7, 3], {}),
        ("nvfp4", "swiglu", [5, 0], {}),  # dynamic scales: all-reduced amax
        ("nvfp4", "relu2", [4, 9], {"input_global_scale": 2e-3, "fc2_input_global_scale": 1e-3}),
        ("mxfp8", "swiglu", [6, 4], {"combine_dtype": "mxfp8"}),
    ],
)
def test_ep_world2_equals_single_process(fmt: str, act: str, tokens_per_rank: list[int], kw: dict) -> None:
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    outs = run_on_local_ranks(_rank, 2, seed, tokens_per_rank, fmt, act, kw)
    q, x, ids, w = _global(seed, tokens_per_rank, fmt, act)
    want, scale = moe_reference_quantized(x, ids, w, q, act, fmt=fmt, return_term_scale=True, **kw)
    got = torch.cat(outs)
    assert [o.shape[0] for o in outs] == tokens_per_rank
    # Same rounding points; only the fp32 accumulation order may differ (usually bit-equal on the CPU).
    assert rounding_ulps(got, want, scale) <= 4, (got - want).abs().max()


# ----------------------------------------------------------------------------------------------------------
# bad packs and configs
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_unquantized_pack_is_quantized_at_preprocessing(fmt: str) -> None:
    """BF16 weights without scales: the layer quantizes them once (``quantize_expert_weights``), so it
    computes exactly what the explicitly quantized pack computes."""
    w13, w2, x, ids, w = _inputs(3, 7)
    q = quantize_expert_weights(w13, w2, fmt)
    inp = moe.MoEEpTensors(x, ids, w)
    got = _layer(moe.MoEWeightPack(w13, w2), _config(fmt)).forward(inp)
    want = _layer(_pack(q), _config(fmt)).forward(inp)
    assert torch.equal(got, want)


def test_bad_packs_raise() -> None:
    w13, w2, x, ids, w = _inputs(1, 4)
    m = quantize_expert_weights(w13, w2, "mxfp8")
    n = quantize_expert_weights(w13, w2, "nvfp4")
    cases = [
        ("mxfp8", moe.MoEWeightPack(m.w13, m.w2), "missing: weights.w13_scale, weights.w2_scale"),
        ("mxfp8", moe.MoEWeightPack(w13, w2, w13_scale=m.w13_scale), "missing: weights.w2_scale"),
        ("nvfp4", dataclasses.replace(_pack(n), w2_global_scale=None), "missing: weights.w2_global_scale"),
        ("mxfp8", _pack(n), "weights.w13 must have shape"),
        ("nvfp4", _pack(m), "missing: weights.w13_global_scale"),
        ("mxfp8", dataclasses.replace(_pack(m), w13_scale=m.w13_scale.float()), "w13_scale must have dtype"),
        ("mxfp8", dataclasses.replace(_pack(m), w2_scale=m.w2_scale[:4].contiguous()), "w2_scale must have shape"),
        ("mxfp8", dataclasses.replace(_pack(m), w13=m.w13[:4].contiguous()), "weights.w13 must have shape"),
        ("mxfp8", dataclasses.replace(_pack(m), w13_global_scale=torch.ones(E)), "no global scale"),
        ("nvfp4", dataclasses.replace(_pack(n), w13_global_scale=-n.w13_global_scale), "finite and > 0"),
        ("nvfp4", dataclasses.replace(_pack(n), w2_global_scale=n.w2_global_scale.double()), "must have dtype"),
        ("bf16", _pack(m), "takes unquantized weights"),
    ]
    nan_scale = m.w13_scale.clone()
    nan_scale[0, 0, 0] = 255
    cases.append(("mxfp8", dataclasses.replace(_pack(m), w13_scale=nan_scale), "UE8M0 NaN"))
    for fmt, pack, match in cases:
        with pytest.raises(moe.MoEEpInputError, match=match):
            _layer(pack, _config(fmt))
    # relu2 takes I rows in w13
    with pytest.raises(moe.MoEEpInputError, match="weights.w13 must have shape"):
        _layer(_pack(m), _config("mxfp8", "relu2"))
    # the reference takes bf16 activations only (pre-quantized ones: the SM90 block-scaled configs)
    layer = _layer(_pack(m), _config("mxfp8"))
    with pytest.raises(moe.MoEEpInputError, match="pre-quantized"):
        layer.forward(moe.MoEEpTensors(x, ids, w, scales=torch.ones(4, H // 32)))
    assert layer.forward(moe.MoEEpTensors(x, ids, w)).shape == (4, H)  # still usable


def test_bad_configs_raise() -> None:
    with pytest.raises(moe.MoEEpConfigError, match="weight_format must be one of"):
        _config("fp8")
    with pytest.raises(moe.MoEEpConfigError, match="combine_dtype must be one of"):
        _config("mxfp8", combine_dtype="fp8")
    with pytest.raises(moe.MoEEpConfigError, match="combine_dtype='mxfp8' needs hidden_size"):
        moe.ReferenceMegaMoeConfig(48, I, E, K, combine_dtype="mxfp8")
    with pytest.raises(moe.MoEEpConfigError, match="multiple of 32"):
        moe.ReferenceMegaMoeConfig(48, I, E, K, weight_format="mxfp8")
    with pytest.raises(moe.MoEEpConfigError, match="intermediate_size to be a multiple of 16"):
        moe.ReferenceMegaMoeConfig(H, 24, E, K, weight_format="nvfp4")
    with pytest.raises(moe.MoEEpConfigError, match="nvfp4' only"):
        _config("mxfp8", input_global_scale=1.0)
    with pytest.raises(moe.MoEEpConfigError, match="finite float > 0"):
        _config("nvfp4", fc2_input_global_scale=0.0)
