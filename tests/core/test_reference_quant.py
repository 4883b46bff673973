"""The quantized-layer reference (core.reference_quant) against an independent per-token brute force."""

from __future__ import annotations

import math

import pytest
import torch

from flashinfer.moe_ep.core.activations import ActivationSpec, apply_activation
from flashinfer.moe_ep.core.inputs import make_expert_weights, make_hidden_states, make_topk, relative_errors
from flashinfer.moe_ep.core.quant import quantize_mxfp8, quantize_nvfp4
from flashinfer.moe_ep.core.reference import moe_reference
from flashinfer.moe_ep.core.reference_quant import (
    QuantizedExpertWeights,
    fake_quantize_activation,
    moe_reference_quantized,
    nvfp4_global_scale_of_amax,
    quantize_expert_weights,
)
from flashinfer.moe_ep.errors import MoEEpInputError

E, H, I, K = 6, 64, 32, 3

# ----------------------------------------------------------------------------------------------------------
# an independent decoder and brute force (per token, per slot, fp64, Python-level formats)
# ----------------------------------------------------------------------------------------------------------


def _e4m3_value(byte: int) -> float:
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    assert not (e == 0xF and m == 0x7), "NaN code"
    v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


_E4M3_LUT = torch.tensor([_e4m3_value(b) if (b & 0x7F) != 0x7F else math.nan for b in range(256)], dtype=torch.float64)
_E2M1_LUT = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _decode_e4m3(q: torch.Tensor) -> torch.Tensor:
    return _E4M3_LUT[q.view(torch.uint8).long()]


def _decode_mxfp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    mult = torch.pow(2.0, scale.double() - 127.0).repeat_interleave(32, dim=-1)
    return _decode_e4m3(q) * mult


def _decode_nvfp4(packed: torch.Tensor, bs: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    p = packed.long()
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    mult = (_decode_e4m3(bs).float() * gs.float()).double()  # the fp32 block multiplier of the spec
    return _E2M1_LUT[codes] * mult.repeat_interleave(16, dim=-1)


def _gs_of(t: torch.Tensor) -> float:
    """NVFP4 dynamic global scale, from the spec text: amax / 2688 in fp32, 1 for zero, >= 2**-126."""
    amax = float(t.float().abs().max()) if t.numel() else 0.0
    if amax == 0.0:
        return 1.0
    return max(float(torch.tensor(amax, dtype=torch.float32) / 2688.0), 2.0**-126)


def _q_row(v: torch.Tensor, fmt: str, gs: float | None) -> torch.Tensor:
    """Quantize one row [K] with core.quant and decode it with the independent decoders (fp64)."""
    v = v.float().reshape(1, -1)
    if fmt == "mxfp8":
        return _decode_mxfp8(*quantize_mxfp8(v))[0]
    packed, bs, g = quantize_nvfp4(v, global_scale=gs)
    return _decode_nvfp4(packed, bs, g)[0]


def _brute_force(x, ids, w, qw: QuantizedExpertWeights, spec: ActivationSpec, fmt: str) -> torch.Tensor:
    t_count, k_count = ids.shape
    if fmt == "mxfp8":
        w13 = _decode_mxfp8(qw.w13, qw.w13_scale)
        w2 = _decode_mxfp8(qw.w2, qw.w2_scale)
    else:
        w13 = torch.stack([_decode_nvfp4(qw.w13[e], qw.w13_scale[e], qw.w13_global_scale[e]) for e in range(E)])
        w2 = torch.stack([_decode_nvfp4(qw.w2[e], qw.w2_scale[e], qw.w2_global_scale[e]) for e in range(E)])
    gs1 = _gs_of(x) if fmt == "nvfp4" else None
    acts = {}
    for t in range(t_count):
        xr = _q_row(x[t], fmt, gs1)
        for j in range(k_count):
            e = int(ids[t, j])
            h = torch.stack([torch.dot(w13[e, r], xr) for r in range(w13.shape[1])])
            acts[t, j] = apply_activation(h, spec.name, spec.limit).float()
    gs2 = _gs_of(torch.stack(list(acts.values()))) if fmt == "nvfp4" and acts else None
    out = torch.zeros(t_count, H, dtype=torch.bfloat16)
    for t in range(t_count):
        acc = torch.zeros(H, dtype=torch.float32)
        for j in range(k_count):
            e = int(ids[t, j])
            ar = _q_row(acts[t, j], fmt, gs2)
            y = torch.stack([torch.dot(w2[e, c], ar) for c in range(H)]).to(torch.bfloat16)
            acc = acc + w[t, j].float() * y.float()
        out[t] = acc.to(torch.bfloat16)
    return out


def _case(seed: int, t: int, act: str):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = make_expert_weights(E, H, I, act, generator=g)
    x = make_hidden_states(t, H, generator=g)
    ids, w = make_topk(t, E, K, generator=g)
    return w13, w2, x, ids, w


# ----------------------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("act", ["swiglu", "relu2"])
@pytest.mark.parametrize("t", [0, 1, 7])
def test_equals_brute_force_fp64(fmt: str, act: str, t: int) -> None:
    w13, w2, x, ids, w = _case(1000 + t, t, act)
    qw = quantize_expert_weights(w13, w2, fmt)
    got = moe_reference_quantized(x, ids, w, qw, act, fmt=fmt, compute_dtype=torch.float64)
    want = _brute_force(x, ids, w, qw, ActivationSpec(act), fmt)
    assert got.shape == (t, H) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    # fp32 accumulation: the same up to fp32 sum order
    got32 = moe_reference_quantized(x, ids, w, qw, act, fmt=fmt)
    mean, _ = relative_errors(got32, want)
    assert mean < 1e-2


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_error_against_bf16_reference(fmt: str, act: str) -> None:
    w13, w2, x, ids, w = _case(7, 64, act)
    qw = quantize_expert_weights(w13, w2, fmt)
    w13d, w2d = qw.dequantize()
    got = moe_reference_quantized(x, ids, w, qw, act, fmt=fmt)
    ref = moe_reference(x, ids, w, w13d, w2d, act)  # BF16 layer on the same (dequantized) weights
    dense = moe_reference(x, ids, w, w13, w2, act)  # BF16 layer on the original weights
    for name, r in (("BF16 ref on the dequantized weights", ref), ("BF16 ref on the original weights", dense)):
        mean, mx = relative_errors(got, r)
        norm = float((got.double() - r.double()).norm() / r.double().norm())
        print(f"\n{fmt} {act} vs {name}: normwise {norm:.2%}, elementwise mean {mean:.2%} max {mx:.1%}")
        # Sanity only (activation quantization error; measured ~5 % MXFP8, ~15 % NVFP4 on dequantized weights).
        bound = 0.10 if fmt == "mxfp8" else 0.35
        assert norm < (bound if r is ref else 2 * bound)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_pre_quantized_inputs(fmt: str) -> None:
    w13, w2, x, ids, w = _case(3, 7, "swiglu")
    qw = quantize_expert_weights(w13, w2, fmt)
    want = moe_reference_quantized(x, ids, w, qw, fmt=fmt)
    xq = quantize_mxfp8(x) if fmt == "mxfp8" else quantize_nvfp4(x)
    assert torch.equal(moe_reference_quantized(xq, ids, w, qw, fmt=fmt), want)
    if fmt == "nvfp4":  # a given global scale, and the pre-quantized tensor carrying the same one
        gs = 0.01
        want_gs = moe_reference_quantized(x, ids, w, qw, fmt=fmt, input_global_scale=gs)
        got_gs = moe_reference_quantized(quantize_nvfp4(x, gs), ids, w, qw, fmt=fmt)
        assert torch.equal(got_gs, want_gs)
        with pytest.raises(MoEEpInputError, match="carry their own global scale"):
            moe_reference_quantized(xq, ids, w, qw, fmt=fmt, input_global_scale=gs)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_quantization_is_row_local(fmt: str) -> None:
    """What lets EP quantize on the owner: with the global scale fixed, any subset / order of rows
    quantizes to the same bits as in the whole tensor."""
    x = make_hidden_states(9, H, generator=torch.Generator().manual_seed(5))
    whole, gs = fake_quantize_activation(x, fmt)
    perm = torch.tensor([4, 0, 8, 8, 2])
    part, _ = fake_quantize_activation(x[perm], fmt, gs)
    assert torch.equal(part, whole[perm])
    if fmt == "nvfp4":
        assert torch.equal(nvfp4_global_scale_of_amax(x.float().abs().max()), gs)
        assert float(nvfp4_global_scale_of_amax(0.0)) == 1.0


def test_weight_layouts() -> None:
    w13, w2 = make_expert_weights(E, H, I, generator=torch.Generator().manual_seed(0))
    m = quantize_expert_weights(w13, w2, "mxfp8")
    assert (m.w13.dtype, tuple(m.w13.shape), tuple(m.w13_scale.shape)) == (
        torch.float8_e4m3fn,
        (E, 2 * I, H),
        (E, 2 * I, H // 32),
    )
    assert (m.w2.dtype, tuple(m.w2.shape), tuple(m.w2_scale.shape)) == (torch.float8_e4m3fn, (E, H, I), (E, H, I // 32))
    assert m.w13_scale.dtype == torch.uint8 and m.w13_global_scale is None
    n = quantize_expert_weights(w13, w2, "nvfp4")
    assert (n.w13.dtype, tuple(n.w13.shape), tuple(n.w13_scale.shape)) == (
        torch.uint8,
        (E, 2 * I, H // 2),
        (E, 2 * I, H // 16),
    )
    assert (tuple(n.w2.shape), tuple(n.w2_scale.shape)) == ((E, H, I // 2), (E, H, I // 16))
    assert n.w13_scale.dtype == torch.float8_e4m3fn and tuple(n.w13_global_scale.shape) == (E,)
    for e in (0, E - 1):  # per-expert global scale = that expert's quantize_nvfp4
        assert torch.equal(n.w2_global_scale[e], quantize_nvfp4(w2[e])[2])
    d13, _ = m.dequantize()
    assert torch.equal(d13.double(), _decode_mxfp8(m.w13, m.w13_scale))
    assert (n.intermediate_size, n.hidden_size, n.fc1_rows) == (I, H, 2 * I)


def test_bad_arguments() -> None:
    w13, w2, x, ids, w = _case(2, 3, "swiglu")
    m = quantize_expert_weights(w13, w2, "mxfp8")
    with pytest.raises(MoEEpInputError, match="format must be one of"):
        quantize_expert_weights(w13, w2, "fp8")
    with pytest.raises(MoEEpInputError, match="weights are mxfp8"):
        moe_reference_quantized(x, ids, w, m, fmt="nvfp4")
    with pytest.raises(MoEEpInputError, match="no global scale"):
        moe_reference_quantized(x, ids, w, m, fmt="mxfp8", input_global_scale=1.0)
    with pytest.raises(MoEEpInputError, match="tuple"):
        moe_reference_quantized((x,), ids, w, m, fmt="mxfp8")
    bad = QuantizedExpertWeights("mxfp8", m.w13, m.w13_scale[..., :1].contiguous(), m.w2, m.w2_scale)
    with pytest.raises(MoEEpInputError, match="w13_scale must have shape"):
        bad.dequantize()


def test_negative_nvfp4_scales_are_rejected_for_the_kernels() -> None:
    """The SM90 kernels store NVFP4 block scales without a sign: a negative one is an input error
    there (the torch dequantization takes it); -0 is a zero scale."""
    w13, w2 = make_expert_weights(2, 64, 32, "swiglu", generator=torch.Generator().manual_seed(3))
    q = quantize_expert_weights(w13, w2, "nvfp4")
    q.reject_negative_scales()  # quantize_nvfp4 makes non-negative scales
    q.w13_scale.view(torch.uint8)[0, 0, 0] = 0x80  # -0
    q.reject_negative_scales()
    q.w13_scale.view(torch.uint8)[0, 0, 0] = 0xB8  # -1.0
    with pytest.raises(MoEEpInputError, match="w13_scale has negative NVFP4 block scales"):
        q.reject_negative_scales()
    q.dequantize()  # the reference itself takes it
    quantize_expert_weights(w13, w2, "mxfp8").reject_negative_scales()  # UE8M0: nothing to reject


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_nan_codes_are_rejected_without_dequantizing(fmt: str) -> None:
    w13, w2 = make_expert_weights(2, 64, 32, "swiglu", generator=torch.Generator().manual_seed(3))
    q = quantize_expert_weights(w13, w2, fmt)
    q.reject_nan_codes()  # a clean pack passes
    bad = q.w2_scale.clone()
    bad.view(torch.uint8)[1, 0, 0] = 255 if fmt == "mxfp8" else 0x7F
    q.w2_scale = bad
    with pytest.raises(MoEEpInputError, match="weights.w2_scale contains"):
        q.reject_nan_codes()
    with pytest.raises(MoEEpInputError):
        q.dequantize()  # the same rule as the torch dequantization
    if fmt == "mxfp8":
        q = quantize_expert_weights(w13, w2, fmt)
        q.w13.view(torch.uint8)[0, 0, 0] = 0xFF
        with pytest.raises(MoEEpInputError, match="weights.w13 contains an E4M3 NaN code"):
            q.reject_nan_codes()
