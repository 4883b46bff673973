"""Tests for flashinfer.moe_ep.core.quant: hand-computed MXFP8 / NVFP4 cases and hypothesis properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashinfer.moe_ep.core.quant import (
    dequantize_mxfp8,
    dequantize_nvfp4,
    pack_e2m1,
    quantize_mxfp8,
    quantize_nvfp4,
    round_to_e2m1,
    round_to_e4m3,
    unpack_e2m1,
)
from flashinfer.moe_ep.errors import MoEEpInputError

F32_MAX = float(torch.finfo(torch.float32).max)
PROP = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def t32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def block(values, size: int) -> list[float]:
    """Pad ``values`` with zeros to one block of ``size`` elements."""
    return list(values) + [0.0] * (size - len(values))


def bits(q: torch.Tensor) -> list[int]:
    return q.view(torch.uint8).tolist()


# ----------------------------------------------------------------------------------------------------------
# independent references (brute force over the whole value set, float64)
# ----------------------------------------------------------------------------------------------------------

# All 127 non-negative finite E4M3 values, by code 0x00..0x7E (decoding a byte is exact).
E4M3_POS = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().double()
E2M1_POS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def brute_rne(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Nearest grid value to |x| (grid sorted by code), ties to the even code, saturating; sign kept."""
    a = x.double().abs().clamp(max=float(grid[-1])).reshape(-1, 1)
    dist = (a - grid.reshape(1, -1)).abs()
    is_min = dist == dist.min(dim=1, keepdim=True).values
    codes = torch.arange(grid.numel())
    # among the (at most two) nearest codes prefer the even one
    score = is_min.long() * 2 + (codes % 2 == 0).long()
    best = grid[torch.argmax(score * is_min.long(), dim=1)]
    return torch.copysign(best.reshape(x.shape), x.double())


def e4m3_half_ulp(w: torch.Tensor) -> torch.Tensor:
    """Half the E4M3 spacing at |w|'s binade (subnormal spacing 2**-9 below 2**-6), float64."""
    _, e = torch.frexp(w.double().abs().clamp(min=2.0**-6))
    return torch.ldexp(torch.ones_like(w, dtype=torch.float64), (e - 1) - 4)


def e2m1_half_ulp(w: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 spacing at |w|'s binade (subnormal spacing 0.5 below 1), float64."""
    _, e = torch.frexp(w.double().abs().clamp(min=1.0))
    return torch.ldexp(torch.ones_like(w, dtype=torch.float64), (e - 1) - 2)


# ----------------------------------------------------------------------------------------------------------
# rounding primitives
# ----------------------------------------------------------------------------------------------------------


def test_round_to_e2m1_ties_to_even_and_saturation():
    # E2M1 codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6. Midpoints go to the even code:
    # 0.25 (0|0.5)->0, 0.75 (0.5|1)->1, 1.25 (1|1.5)->1, 1.75 (1.5|2)->2, 2.5 (2|3)->2, 3.5 (3|4)->4, 5 (4|6)->4.
    x = t32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.26, 4.99, 5.01, 6.5, 100.0, -7.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 0.5, 4.0, 6.0, 6.0, 6.0, -6.0]
    got = round_to_e2m1(x)
    assert got.tolist() == want
    assert torch.signbit(got[7])  # -0.25 -> -0
    assert torch.equal(round_to_e2m1(E2M1_POS.float()), E2M1_POS.float())  # exact values unchanged


def test_round_to_e4m3_ties_to_even_subnormals_and_saturation():
    x = t32(
        [
            1 + 2**-4,  # 1.0 (m=000) | 1.125 (m=001) -> 1.0
            1 + 3 * 2**-4,  # 1.125 (001) | 1.25 (010) -> 1.25
            17.0,  # 16 (0x50) | 18 (0x51) -> 16
            19.0,  # 18 (0x51) | 20 (0x52) -> 20
            232.0,  # 224 (0x76) | 240 (0x77) -> 224
            248.0,  # 240 (0x77) | 256 (0x78) -> 256
            400.0,  # 384 (0x7C) | 416 (0x7D) -> 384
            432.0,  # 416 (0x7D) | 448 (0x7E) -> 448
            2**-10,  # 0 | 2**-9 (0x01) -> 0
            3 * 2**-10,  # 2**-9 (0x01) | 2*2**-9 (0x02) -> 2**-8
            5 * 2**-10,  # 2*2**-9 (0x02) | 3*2**-9 (0x03) -> 2**-8
            15 * 2**-10,  # 7*2**-9 (0x07, largest subnormal) | 2**-6 (0x08) -> 2**-6
            464.0,  # 448 | (480, not in E4M3FN): saturate -> 448
            1e30,  # saturate -> 448
            -479.0,  # -> -448
        ]
    )
    want = [1.0, 1.25, 16.0, 20.0, 224.0, 256.0, 384.0, 448.0, 0.0, 2**-8, 2**-8, 2**-6, 448.0, 448.0, -448.0]
    assert round_to_e4m3(x).tolist() == want
    # Inf saturates, NaN stays NaN (the quantizers reject both before rounding).
    special = round_to_e4m3(t32([math.inf, -math.inf, math.nan]))
    assert special[:2].tolist() == [448.0, -448.0] and torch.isnan(special[2])


def test_round_to_e4m3_matches_every_code():
    # Every finite E4M3 value is a fixed point and casts to its own code.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # drop the two NaN codes
    values = codes.view(torch.float8_e4m3fn).float()
    r = round_to_e4m3(values)
    assert torch.equal(r, values)
    assert torch.equal(r.to(torch.float8_e4m3fn).view(torch.uint8), codes)


# ----------------------------------------------------------------------------------------------------------
# MXFP8 hand-computed cases
# ----------------------------------------------------------------------------------------------------------


def test_mxfp8_exact_values_round_trip():
    # amax 448 -> floor(log2 448) = 8 -> X = 8 - 8 = 0 -> scale byte 127; every value is on the E4M3 grid.
    vals = [448.0, -448.0, 1.0, -1.75, 0.5, 2**-6, 2**-9, -7 * 2**-9, 240.0, 0.0, -0.0]
    x = t32([block(vals, 32)])
    q, s = quantize_mxfp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
    assert q.shape == (1, 32) and s.shape == (1, 1)
    assert s.tolist() == [[127]]
    # 448 = 0x7E, -448 = 0xFE, 1.0 = 0x38 (exp 7, m 0), -1.75 = 0xBE, 0.5 = 0x30, 2**-6 = 0x08,
    # 2**-9 = 0x01, -7*2**-9 = 0x87, 240 = 0x77, 0, -0 = 0x80
    assert bits(q)[0][:11] == [0x7E, 0xFE, 0x38, 0xBE, 0x30, 0x08, 0x01, 0x87, 0x77, 0x00, 0x80]
    assert torch.equal(dequantize_mxfp8(q, s), x)


def test_mxfp8_scale_and_subnormal_elements():
    # amax 1.0 -> X = 0 - 8 = -8 -> byte 119; elements are v * 2**8.
    # 2**-15 -> w = 2**-7 (E4M3 subnormal 4 * 2**-9, exact); 2**-17 -> w = 2**-9 (smallest subnormal);
    # 2**-18 -> w = 2**-10: tie 0 | 2**-9 -> 0; 3 * 2**-18 -> w = 1.5 * 2**-9: tie -> 2 * 2**-9 -> 2**-16.
    x = t32([block([1.0, 0.5, 2**-15, 2**-17, 2**-18, 3 * 2**-18, -(2**-17)], 32)])
    q, s = quantize_mxfp8(x)
    assert s.tolist() == [[119]]
    assert bits(q)[0][:7] == [0x38 + 8 * 8, 0x38 + 7 * 8, 0x04, 0x01, 0x00, 0x02, 0x81]
    want = t32([block([1.0, 0.5, 2**-15, 2**-17, 0.0, 2**-16, -(2**-17)], 32)])
    assert torch.equal(dequantize_mxfp8(q, s), want)


def test_mxfp8_ties_to_even():
    # amax 432 in [256, 512) -> X = 0, so elements are rounded as they are (see the E4M3 tie table above).
    x = t32([block([432.0, 1 + 2**-4, 1 + 3 * 2**-4, 17.0, -19.0, 248.0, 2**-10, 3 * 2**-10], 32)])
    q, s = quantize_mxfp8(x)
    assert s.tolist() == [[127]]
    want = t32([block([448.0, 1.0, 1.25, 16.0, -20.0, 256.0, 0.0, 2**-8], 32)])
    assert torch.equal(dequantize_mxfp8(q, s), want)


def test_mxfp8_saturation():
    # amax 480 = 1.875 * 2**8 -> X = 0 -> 480 saturates to 448 (OCP spec: X keeps amax's binade, and a
    # mantissa above 1.75 does not fit E4M3). 470 -> 448 (saturation), 460 -> 448 (ordinary rounding).
    # amax 31 = 1.9375 * 2**4 -> X = -4 -> w = 496 -> 448 -> 28.
    # fp32 max = (2 - 2**-23) * 2**127 -> X = 119 (byte 246) -> w ~ 511.99 -> 448 -> 1.75 * 2**127.
    x = t32([block([480.0, -470.0, 460.0], 32) + block([31.0, -31.0], 32) + block([F32_MAX], 32)])
    q, s = quantize_mxfp8(x)
    assert s.tolist() == [[127, 123, 246]]
    want = t32([block([448.0, -448.0, 448.0], 32) + block([28.0, -28.0], 32) + block([1.75 * 2.0**127], 32)])
    assert torch.equal(dequantize_mxfp8(q, s), want)


def test_mxfp8_all_zero_block():
    # Convention: an all-zero block gets scale byte 0 (2**-127) and zero elements (signs of zero kept).
    x = t32([block([0.0, -0.0], 32) + block([3.0], 32)])
    q, s = quantize_mxfp8(x)
    assert s.tolist() == [[0, 1 - 8 + 127]]  # second block: floor(log2 3) = 1 -> X = -7
    assert bits(q)[0][:2] == [0x00, 0x80] and all(b == 0 for b in bits(q)[0][2:32])
    assert torch.equal(dequantize_mxfp8(q, s), x)


@pytest.mark.parametrize(
    ("amax", "byte", "want"),
    [
        (2.0**-119, 0, 2.0**-119),  # X = -127 exactly: w = 256
        (2.0**-120, 0, 2.0**-120),  # X = -128 clamped to -127: w = 128, still exact
        (2.0**-136, 0, 2.0**-136),  # clamped: w = 2**-9, smallest E4M3 subnormal (an fp32 subnormal result)
        (2.0**-137, 0, 0.0),  # clamped: w = 2**-10, tie 0 | 2**-9 -> 0
        (2.0**-149, 0, 0.0),  # smallest fp32 subnormal: w = 2**-22 -> 0
        (2.0**127, 246, 2.0**127),  # X = 127 - 8 = 119: w = 256
    ],
)
def test_mxfp8_ue8m0_range_ends(amax, byte, want):
    x = t32([block([amax], 32)])
    q, s = quantize_mxfp8(x)
    assert s.tolist() == [[byte]]
    assert dequantize_mxfp8(q, s)[0, 0].item() == want


def test_mxfp8_dequant_scale_extremes():
    # q = 1.0 (0x38) and 2**-9 (0x01) under scale bytes 254 (2**127), 127 (1) and 0 (2**-127).
    q = t32([block([1.0, 2**-9], 32)] * 3).to(torch.float8_e4m3fn)
    s = torch.tensor([[254], [127], [0]], dtype=torch.uint8)
    out = dequantize_mxfp8(q, s)
    assert out[:, :2].tolist() == [[2.0**127, 2.0**118], [1.0, 2.0**-9], [2.0**-127, 2.0**-136]]
    with pytest.raises(MoEEpInputError, match="255"):
        dequantize_mxfp8(q, torch.full((3, 1), 255, dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------------------
# NVFP4 hand-computed cases
# ----------------------------------------------------------------------------------------------------------


def test_e2m1_nibble_packing_order():
    # 1.0 = code 0b0010, -3.0 = 0b1000 | 0b0101 = 0b1101: element 0 low nibble -> byte 0xD2.
    # 0.5 = 0b0001, 6.0 = 0b0111 -> 0x71; -0.0 = 0b1000, 0.0 -> 0x08.
    packed = pack_e2m1(t32([[1.0, -3.0, 0.5, 6.0, -0.0, 0.0]]))
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0xD2, 0x71, 0x08]]
    out = unpack_e2m1(torch.tensor([[0xD2, 0x71, 0x08, 0xF7]], dtype=torch.uint8))
    assert out.tolist() == [[1.0, -3.0, 0.5, 6.0, -0.0, 0.0, 6.0, -6.0]]
    assert torch.signbit(out[0, 4]) and not torch.signbit(out[0, 5])
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(pack_e2m1(unpack_e2m1(all_bytes)), all_bytes)
    with pytest.raises(MoEEpInputError, match="E2M1"):
        pack_e2m1(t32([0.7, 1.0]))
    with pytest.raises(MoEEpInputError, match="even"):
        pack_e2m1(t32([1.0, 1.0, 1.0]))


def test_nvfp4_default_global_scale_and_ties():
    # amax(tensor) = 2688 -> global_scale = 2688 / (448 * 6) = 1.0 exactly.
    # Block 0: amax 2688 -> block scale RNE(2688 / 6) = 448 (0x7E); d = 448; w = v / 448 with the E2M1 ties
    #   6, -6, .5, 1.5, .25->0, .75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, -5->-4, 3, 4, 2, 1.
    # Block 1: amax 6 -> block scale 1.0 (0x38); d = 1; w = v: 0.3 -> 0.5 (nearest), -0.2 -> -0, 5.2 -> 6.
    w0 = [6, -6, 0.5, 1.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5, 3, 4, 2, 1]
    e0 = [6, -6, 0.5, 1.5, 0, 1, 1, 2, 2, 4, 4, -4, 3, 4, 2, 1]
    x = t32([[448.0 * v for v in w0] + block([6.0, 0.3, -0.2, 5.2], 16)])
    packed, bs, gs = quantize_nvfp4(x)
    assert packed.shape == (1, 16) and bs.shape == (1, 2) and gs.shape == () and gs.dtype == torch.float32
    assert gs.item() == 1.0
    assert bits(bs) == [[0x7E, 0x38]]
    assert packed[0, 0].item() == 0xF7  # 6 -> 0x7 low, -6 -> 0xF high
    want = t32([[448.0 * v for v in e0] + block([6.0, 0.5, -0.0, 6.0], 16)])
    assert torch.equal(dequantize_nvfp4(packed, bs, gs), want)


def test_nvfp4_saturation():
    # global_scale 1: block amax 7 -> s = 7/6 = 1.1667 -> E4M3 neighbours 1.125 | 1.25 -> 1.125; d = 1.125;
    #   7 / 1.125 = 6.22 saturates to 6 -> 6.75; 5.5 / 1.125 = 4.89 -> 4 -> 4.5.
    x = t32([block([7.0, 5.5], 16)])
    packed, bs, gs = quantize_nvfp4(x, global_scale=1.0)
    assert bs.float().tolist() == [[1.125]] and gs.item() == 1.0
    assert dequantize_nvfp4(packed, bs, gs).tolist() == [block([6.75, 4.5], 16)]
    # global_scale 2**-10 (too small for amax 6): s = 6 / (6 * 2**-10) = 1024 saturates to 448;
    #   d = 448 * 2**-10 = 0.4375; 6 / 0.4375 = 13.7 saturates to 6 -> 2.625.
    packed, bs, gs = quantize_nvfp4(t32([block([6.0], 16)]), global_scale=2.0**-10)
    assert bs.float().tolist() == [[448.0]]
    assert dequantize_nvfp4(packed, bs, gs)[0, 0].item() == 2.625


def test_nvfp4_fp32_operation_order():
    # The fp32 operation order is part of the convention (ModelOpt's): block scale = RNE(amax / (6 * gs)),
    # dequant = e2m1 * (float(bs) * gs). These inputs sit where the other orders round differently.
    amax, gs = float.fromhex("0x1.135504p+4"), float.fromhex("0x1.5983c8p+1")
    a32, g32 = t32(amax), t32(gs)
    assert (a32 / (6.0 * g32)).item() == 1.0625  # an exact E4M3 tie 1 | 1.125 -> 1.0 ...
    assert (a32 / 6.0 / g32).item() > 1.0625  # ... that amax / 6 / gs would push up to 1.125
    _, bs, _ = quantize_nvfp4(t32([block([amax], 16)]), global_scale=gs)
    assert bs.float().item() == 1.0
    # dequant: 1.5 (code 3) * (1.5 * gs) rounds once more than (1.5 * 1.5) * gs does
    gs = float.fromhex("0x1.5f92d4p+0")
    packed = torch.full((1, 8), 0x33, dtype=torch.uint8)
    bs = t32([[1.5]]).to(torch.float8_e4m3fn)
    want = float.fromhex("0x1.8b8530p+1")
    assert want != ((1.5 * t32(1.5)) * t32(gs)).item()
    assert dequantize_nvfp4(packed, bs, gs).tolist() == [[want] * 16]
    # elements: v / d is an exact E2M1 tie 0.5 | 1 -> 1, which v * (1 / d) would round down to 0.5.
    gs, v = float.fromhex("0x1.d0cdb6p-2"), float.fromhex("0x1.5c9a48p-2")
    amax = (6.0 * t32(gs)).item()  # block scale amax / (6 * gs) = 1 exactly, so d = gs
    assert (t32(v) / t32(gs)).item() == 0.75 and round_to_e2m1(t32(v) * (1 / t32(gs))).item() == 0.5
    packed, bs, _ = quantize_nvfp4(t32([block([amax, v], 16)]), global_scale=gs)
    assert bs.float().item() == 1.0 and unpack_e2m1(packed)[0, :2].tolist() == [6.0, 1.0]


def test_nvfp4_zero_and_tiny_blocks():
    # global_scale 1: block amax 6 * 2**-10 -> s = 2**-10: tie 0 | 2**-9 -> 0 -> zero elements (sign kept);
    # block amax 6 * 2**-9 -> s = 2**-9 (E4M3 subnormal 0x01), d = 2**-9, elements exact;
    # an all-zero block -> block scale 0.
    x = t32([block([6 * 2**-10, -(2**-11)], 16) + block([6 * 2**-9, 2**-10, -3 * 2**-9], 16) + block([], 16)])
    packed, bs, gs = quantize_nvfp4(x, global_scale=1.0)
    assert bits(bs) == [[0x00, 0x01, 0x00]]
    assert packed[0, :8].tolist() == [0x80] + [0] * 7  # +0 low nibble, -0 high nibble
    want = t32([block([0.0, -0.0], 16) + block([6 * 2**-9, 2**-10, -3 * 2**-9], 16) + block([], 16)])
    assert torch.equal(dequantize_nvfp4(packed, bs, gs), want)


def test_nvfp4_all_zero_and_tiny_tensor():
    # Convention: an all-zero (or empty) tensor gets global_scale 1.0, zero block scales, zero bytes.
    packed, bs, gs = quantize_nvfp4(torch.zeros(2, 32))
    assert gs.item() == 1.0 and not bs.float().any() and not packed.any()
    assert not dequantize_nvfp4(packed, bs, gs).any()
    packed, bs, gs = quantize_nvfp4(torch.zeros(0, 32, dtype=torch.bfloat16))
    assert packed.shape == (0, 16) and bs.shape == (0, 2) and gs.item() == 1.0
    # amax 2**-140: amax / 2688 is below the smallest normal fp32, so global_scale = 2**-126.
    packed, bs, gs = quantize_nvfp4(t32([block([2.0**-140], 16)]))
    assert gs.item() == 2.0**-126


# ----------------------------------------------------------------------------------------------------------
# input validation
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantize", [quantize_mxfp8, quantize_nvfp4])
@pytest.mark.parametrize(("bad", "word"), [(math.nan, "NaN"), (math.inf, "Inf"), (-math.inf, "Inf")])
def test_non_finite_rejected(quantize, bad, word):
    x = torch.ones(2, 64)
    x[1, 7] = bad
    with pytest.raises(MoEEpInputError, match=word):
        quantize(x)
    with pytest.raises(MoEEpInputError, match=word):
        quantize(x.bfloat16())


@pytest.mark.parametrize(("quantize", "k"), [(quantize_mxfp8, 48), (quantize_mxfp8, 16), (quantize_nvfp4, 24)])
def test_wrong_k_rejected(quantize, k):
    with pytest.raises(MoEEpInputError, match="multiple"):
        quantize(torch.ones(2, k))


@pytest.mark.parametrize("quantize", [quantize_mxfp8, quantize_nvfp4])
def test_bad_dtype_and_rank_rejected(quantize):
    with pytest.raises(MoEEpInputError, match="dtype"):
        quantize(torch.ones(2, 32, dtype=torch.int32))
    with pytest.raises(MoEEpInputError, match="0-dim"):
        quantize(torch.tensor(1.0))


@pytest.mark.parametrize("gs", [0.0, -1.0, math.nan, math.inf, torch.ones(2), 1e-50, "1"])
def test_nvfp4_bad_global_scale_rejected(gs):
    with pytest.raises(MoEEpInputError, match="global_scale"):
        quantize_nvfp4(torch.ones(1, 16), global_scale=gs)


def test_dequant_shape_checks():
    q, s = quantize_mxfp8(torch.ones(2, 64))
    with pytest.raises(MoEEpInputError, match="scale shape"):
        dequantize_mxfp8(q, s[:, :1])
    with pytest.raises(MoEEpInputError, match="dtype"):
        dequantize_mxfp8(q.float(), s)
    packed, bs, gs = quantize_nvfp4(torch.ones(2, 64))
    with pytest.raises(MoEEpInputError, match="scale shape"):
        dequantize_nvfp4(packed, bs[:, :3], gs)
    with pytest.raises(MoEEpInputError, match="multiple"):
        dequantize_nvfp4(packed[:, :4], bs[:, :1], gs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_match_fp32(dtype):
    x = (torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    for a, b in zip(quantize_mxfp8(x), quantize_mxfp8(x.float()), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in zip(quantize_nvfp4(x), quantize_nvfp4(x.float()), strict=True):
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)


# ----------------------------------------------------------------------------------------------------------
# properties
# ----------------------------------------------------------------------------------------------------------


def _clamp_f32(v: float) -> float:
    return max(-F32_MAX, min(F32_MAX, v))


@st.composite
def fp32_blocks(draw, size: int, count: int) -> torch.Tensor:
    """``count`` blocks of ``size`` fp32 values as a [1, size * count] tensor, mixing magnitudes and ties."""
    out: list[float] = []
    for _ in range(count):
        kind = draw(st.sampled_from(["raw", "scaled", "grid", "zero"]))
        if kind == "raw":  # any finite fp32, subnormals included
            vals = draw(
                st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=size, max_size=size)
            )
        elif kind == "scaled":  # one binade range, like real activations
            e = draw(st.integers(-150, 126))
            mant = st.floats(-4.0, 4.0, width=32)
            vals = [_clamp_f32(m * 2.0**e) for m in draw(st.lists(mant, min_size=size, max_size=size))]
        elif kind == "grid":  # few-bit integers: exact values and exact ties of both grids
            e = draw(st.integers(-150, 120))
            ints = draw(st.lists(st.integers(-64, 64), min_size=size, max_size=size))
            vals = [_clamp_f32(i * 2.0**e) for i in ints]
        else:
            vals = [0.0] * size
        out.extend(vals)
    return torch.tensor([out], dtype=torch.float32)


@PROP
@given(fp32_blocks(32, 2))
def test_mxfp8_error_bound_and_reference(x):
    q, s = quantize_mxfp8(x)
    y = dequantize_mxfp8(q, s)
    x_exp = s.to(torch.int64).repeat_interleave(32, dim=-1) - 127
    w = torch.ldexp(x.double(), -x_exp)  # exact: v / 2**X
    # |y - x| <= 2**X * (half an E4M3 ulp at w's binade), or 2**X * (|w| - 448) when |w| > 448 (saturation).
    bound = torch.where(w.abs() > 448, w.abs() - 448, e4m3_half_ulp(w))
    err = (y.double() - x.double()).abs()
    assert bool((err <= torch.ldexp(bound, x_exp)).all())
    # The element codes are the brute-force RNE of w (an independent reference over all 254 values) ...
    assert torch.equal(q.float().double(), brute_rne(w, E4M3_POS))
    # ... and agree with torch's own cast where that cast cannot overflow (|w| <= 464 in every torch).
    ok = w.abs() <= 464
    assert torch.equal(q.view(torch.uint8)[ok], w.float().to(torch.float8_e4m3fn).view(torch.uint8)[ok])


@PROP
@given(fp32_blocks(32, 2))
def test_mxfp8_idempotent(x):
    y = dequantize_mxfp8(*quantize_mxfp8(x))
    q2, s2 = quantize_mxfp8(y)
    assert torch.equal(dequantize_mxfp8(q2, s2), y)
    assert torch.equal(s2, quantize_mxfp8(x)[1])  # the scale is stable too


@PROP
@given(
    st.integers(-119, 127),
    st.integers(0, 6),
    st.lists(st.floats(-1.0, 1.0, width=32), min_size=31, max_size=31),
    st.integers(0, 31),
)
def test_mxfp8_exact_amax_not_saturated(e, m, fractions, pos):
    # amax = (1 + m/8) * 2**e with m <= 6 is an E4M3 mantissa times a power of two; then X = e - 8 and
    # amax / 2**X = (1 + m/8) * 256 <= 448, so amax is reproduced exactly and no element saturates.
    amax = (1 + m / 8) * 2.0**e
    vals = [f * amax for f in fractions]
    vals.insert(pos, -amax if m % 2 else amax)
    x = t32([vals])
    q, s = quantize_mxfp8(x)
    assert s.item() == e - 8 + 127
    assert dequantize_mxfp8(q, s)[0, pos].abs().item() == amax
    assert bool((q.float().abs() <= 448).all())
    assert int((q.view(torch.uint8) & 0x7F).max()) <= 0x7E


@PROP
@given(fp32_blocks(16, 4))
def test_nvfp4_error_bound_and_reference(x):
    packed, bs, gs = quantize_nvfp4(x)
    y = dequantize_nvfp4(packed, bs, gs)
    d = (bs.float() * gs).double().repeat_interleave(16, dim=-1)  # the fp32 block multiplier
    xd = x.double()
    # A zero multiplier only comes from amax_block / (6 * gs) <= 2**-10 (RNE of that is 0).
    zero = d == 0
    amax_blk = x.abs().reshape(1, 4, 16).amax(-1).double().repeat_interleave(16, dim=-1)
    assert bool((amax_blk[zero] <= 6 * gs.double() * 2.0**-10 * (1 + 2.0**-20)).all())
    assert bool((y[zero] == 0).all())
    # Elsewhere: |y - x| <= d * (half an E2M1 ulp at w's binade, or |w| - 6 when saturated), plus the two
    # fp32 roundings of v / d and e * d (each relative 2**-24; the slack also covers a tie flip).
    nz = ~zero
    w = xd[nz] / d[nz]
    half = torch.where(w.abs() > 6, w.abs() - 6, e2m1_half_ulp(w * (1 + 2.0**-22)))
    slack = 2.0**-22 * (xd[nz].abs() + y.double()[nz].abs())
    assert bool(((y.double()[nz] - xd[nz]).abs() <= d[nz] * half + slack).all())
    # Element codes are the brute-force RNE of the fp32 v / d the quantizer sees.
    w32 = (x.reshape(1, 4, 16) / (bs.float() * gs).unsqueeze(-1)).reshape(1, 64)
    assert torch.equal(unpack_e2m1(packed)[nz].double(), brute_rne(w32[nz], E2M1_POS))
    # Block scales are the brute-force RNE (saturating) of amax_block / (6 * gs).
    s32 = x.abs().reshape(1, 4, 16).amax(-1) / (6.0 * gs)
    assert torch.equal(bs.float().double(), brute_rne(s32, E4M3_POS))


@PROP
@given(fp32_blocks(16, 4))
def test_nvfp4_idempotent_with_fixed_global_scale(x):
    # With the same global scale, and block scales that are zero or normal E4M3 (>= 2**-6), re-quantizing a
    # dequantized tensor reproduces it bit for bit: the block scale s rounds to bs within a relative 1/16,
    # so the block's largest |w| lies in [6 / (1 + 1/16), 6 * (1 + 1/16)] and rounds to 6, giving back bs.
    # (Not a theorem elsewhere: a subnormal bs can round s up by almost 2x, e.g. s = 0.55 * 2**-9 -> 2**-9,
    # w_max = 3.3 -> 3, and the re-quantized s' = 0.5 * 2**-9 ties to 0; and re-deriving the global scale
    # from amax(dequant) can move it by an fp32 ulp.)
    packed, bs, gs = quantize_nvfp4(x)
    bsf = bs.float()
    if bool(((bsf > 0) & (bsf < 2.0**-6)).any()):
        return
    y = dequantize_nvfp4(packed, bs, gs)
    packed2, bs2, gs2 = quantize_nvfp4(y, global_scale=gs)
    assert torch.equal(bs2.view(torch.uint8), bs.view(torch.uint8))
    assert torch.equal(dequantize_nvfp4(packed2, bs2, gs2), y)


@PROP
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=8, max_size=8))
def test_rounding_matches_brute_force(vals):
    x = t32(vals)
    assert torch.equal(round_to_e2m1(x).double(), brute_rne(x, E2M1_POS))
    assert torch.equal(round_to_e4m3(x).double(), brute_rne(x, E4M3_POS))
    scaled = x * 2.0**-120  # exercise the E4M3 subnormal range too
    assert torch.equal(round_to_e4m3(scaled).double(), brute_rne(scaled, E4M3_POS))


# ----------------------------------------------------------------------------------------------------------
# device agreement (runs only where CUDA is present)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_bit_exactly():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-130, 120, (64, 1), generator=g).float())
    x[3, :32] = 0
    for quantize in (quantize_mxfp8, quantize_nvfp4):
        for a, b in zip(quantize(x), quantize(x.cuda()), strict=True):
            assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.cpu().view(torch.uint8) if b.dim() else b.cpu())
    q, s = quantize_mxfp8(x)
    assert torch.equal(dequantize_mxfp8(q.cuda(), s.cuda()).cpu(), dequantize_mxfp8(q, s))
    p, bs, gs = quantize_nvfp4(x)
    assert torch.equal(dequantize_nvfp4(p.cuda(), bs.cuda(), gs.cuda()).cpu(), dequantize_nvfp4(p, bs, gs))
