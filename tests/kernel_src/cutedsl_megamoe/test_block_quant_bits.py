"""The register dequantization of the block-scaled kernels, bit for bit on the CPU: the instruction
sequences of ``block_quant.e4m3x4_to_bf16x4`` and ``e2m1x8_to_bf16x8`` replayed in Python with the
module's own selectors, masks and shift terms, for every input byte, against torch's decoding of the
formats."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

pytestmark = pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL (pip install .[test])")

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
M32 = 0xFFFFFFFF


def prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte i of the result is byte ``f & 7`` of {b, a}, or with
    ``f & 8`` that byte's sign bit replicated, where f is nibble i of ``sel``."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        f = (sel >> (4 * i)) & 0xF
        byte = pool[f & 7]
        if f & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def bf16_halves(word: int) -> tuple[float, float]:
    t = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return float(t[0]), float(t[1])


def e4m3(byte: int) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def test_e4m3_bit_move_is_value_times_2_pow_minus_120() -> None:
    bq = drop.kernel_helpers.block_quant
    values = [b for b in range(256) if b & 0x7F != 0x7F]  # NaN codes are rejected at weight preprocessing
    for i in range(0, len(values), 4):
        chunk = (values[i : i + 4] * 4)[:4]
        word = sum(b << (8 * k) for k, b in enumerate(chunk))
        got = []
        for sel in bq.E4M3_PAIR_SELECTORS:
            got.extend(bf16_halves(((prmt(word, 0, sel) << 4) & M32) & bq.E4M3_BF16_MASK))
        want = [e4m3(b) * 2.0**-120 for b in chunk]
        assert got == want, (chunk, got, want)
    # with a block multiplier ``scale * 2**112`` the product is exact: value * scale / MXFP8_ACC_SCALE
    for scale_byte in (100, 120, 127, 135, 142):
        mult = bf16_halves((scale_byte + 112) << 7)[0]
        assert mult == 2.0 ** (scale_byte - 127 + 112)
        for b in values:
            product = e4m3(b) * 2.0**-120 * mult
            assert float(torch.tensor(product).to(torch.bfloat16)) == product
            assert product * bq.MXFP8_ACC_SCALE == e4m3(b) * 2.0 ** (scale_byte - 127)


def e2m1_term(word: int, op: str, amount: int) -> int:
    """One term of ``constants.E2M1_PAIR_TERMS`` as its PTX computes it (shl.b32, shr.u32, shf.l.wrap)."""
    if op == "shl":
        return (word << amount) & M32
    if op == "shr":
        return word >> amount
    assert op == "rotl"
    return ((word << amount) | (word >> (32 - amount))) & M32


def test_e2m1_stored_words_give_value_times_2_pow_minus_126() -> None:
    """Every byte value in every byte of a logical word (nibble n = element n), stored with the
    packing's bit layout (``e2m1_word_sources``): the terms of pair m OR-ed give element 2m in the low
    BF16 half and 2m + 1 in the high one, each ``value * 2**-126``; each stored bit is read once."""
    bq, kh = drop.kernel_helpers.block_quant, drop.kernel_helpers
    sources = kh.e2m1_word_sources()
    assert sorted(4 * n + i for n, i in sources) == list(range(32))
    for base in range(0, 256, 4):
        for rot in range(4):
            chunk = [(base + (k + rot) % 4) % 256 for k in range(4)]
            logical = sum(b << (8 * k) for k, b in enumerate(chunk))
            stored = sum(((logical >> (4 * n + i)) & 1) << b for b, (n, i) in enumerate(sources))
            for m, terms in enumerate(kh.constants.E2M1_PAIR_TERMS):
                w = 0
                for op, amount, mask in terms:
                    w |= e2m1_term(stored, op, amount) & mask
                assert w & ~bq.E2M1_BF16_MASK == 0
                b = chunk[m]
                want = [(-1.0 if n & 8 else 1.0) * E2M1[n & 7] * 2.0**-126 for n in (b & 0xF, b >> 4)]
                assert list(bf16_halves(w)) == want, (b, bf16_halves(w), want)
    # the terms read disjoint stored bits that cover the word (no bit is used twice, none is lost)
    read = [t for terms in kh.constants.E2M1_PAIR_TERMS for op, amount, mask in terms
            for t in range(32) if e2m1_term(1 << t, op, amount) & mask]  # fmt: skip
    assert sorted(read) == list(range(32))


def test_nvfp4_stored_scales_give_the_bf16_multiplier() -> None:
    """The NVFP4 scale bytes as packed (every E4M3 byte >= 0 but NaN) through the kernel's two
    instructions (``prmt`` byte j to both halves, ``mad.lo`` by 16 plus the bias in both halves): the
    BF16 multiplier ``scale * 2**112`` in each half, exactly. Zero scales zero their block's codes;
    negative scales are rejected."""
    kh = drop.kernel_helpers
    bias2 = kh.constants.NVFP4_SCALE_BIAS * 0x10001
    codes = [b for b in range(128) if b != 0x7F] + [0x38]  # 128 blocks of 16: K a multiple of 64
    e4m3_values = {b: e4m3(b) for b in codes}
    k = 16 * len(codes)
    scale = torch.tensor(codes, dtype=torch.uint8).reshape(1, 1, -1)
    data = torch.full((1, 1, k // 2), 0x11, dtype=torch.uint8)  # every element 0.5
    packed, stored_t = kh.pack_quantized_weights(data, scale, data, scale, "nvfp4", 64, False)[1]
    stored = stored_t.reshape(-1).tolist()  # [1, K/64, 1, 4]: block order
    for j, b in enumerate(codes):
        word = stored[4 * (j // 4) : 4 * (j // 4) + 4]
        word = sum(x << (8 * i) for i, x in enumerate(word))
        t = prmt(word, 0, 0x4040 + 0x101 * (j % 4))
        mult = (t * 16 + bias2) & M32
        want = e4m3_values[b] * 2.0**112
        if b == 0:
            continue  # its block's codes are zero: any multiplier gives 0
        assert bf16_halves(mult) == (want, want), (b, bf16_halves(mult), want)
    data_back, scale_back = kh.unpack_quantized_matrix(packed, stored_t, "nvfp4")
    assert data_back[0, 0, :8].tolist() == [0] * 8 and data_back[0, 0, 8:].eq(0x11).all()  # block 0: scale 0
    assert torch.equal(scale_back, scale)
    with pytest.raises(ValueError, match="must not be negative"):
        kh.pack_quantized_weights(data, scale | 0x80, data, scale, "nvfp4", 64, False)


def _e2m1_threshold_chain(a: np.ndarray) -> np.ndarray:
    """The E2M1 magnitude rounding of drop v19 and before: seven comparisons, each adding a step."""
    v = np.zeros_like(a)
    for bound, inclusive, step in (
        (0.25, False, 0.5), (0.75, True, 0.5), (1.25, False, 0.5), (1.75, True, 0.5),
        (2.5, False, 1.0), (3.5, True, 1.0), (5.0, False, 2.0),
    ):  # fmt: skip
        hit = a >= np.float32(bound) if inclusive else a > np.float32(bound)
        v += np.where(hit, np.float32(step), np.float32(0.0))
    return v


def _e2m1_rint(a: np.ndarray) -> np.ndarray:
    """The E2M1 magnitude rounding of drops v20-v31: ``rint(x / step) * step`` (PTX max/min return the
    non-NaN operand: np.fmax / np.fmin; cvt.rni: np.rint, ties to even)."""
    x = np.fmax(a, np.float32(0.0))
    p4, p2 = x >= np.float32(4.0), x >= np.float32(2.0)
    inv = np.where(p2, np.where(p4, np.float32(0.5), np.float32(1.0)), np.float32(2.0))
    step = np.where(p2, np.where(p4, np.float32(2.0), np.float32(1.0)), np.float32(0.5))
    t = np.rint(x * inv) * step
    return np.fmin(t, np.float32(6.0))


def _e2m1_add_pow2(r: np.ndarray) -> np.ndarray:
    """``block_quant._round_e2m1_magnitude`` instruction by instruction (float32 adds round to nearest
    even, as ``add.rn.f32``)."""
    x = np.fmin(np.fmax(np.abs(r), np.float32(0.0)), np.float32(8.0))
    e = np.maximum(x.view(np.uint32) & np.uint32(0x7F800000), np.uint32(0x3F800000))
    c = (e + np.uint32(0x0B000000)).view(np.float32)
    t = (x + c) - c
    return np.fmin(t, np.float32(6.0))


def test_e2m1_roundings_equal_the_threshold_chain() -> None:
    # every fp32 within 64 ulps of each threshold and grid point, a dense sweep of [0, 16], specials;
    # the drop's rounding takes the magnitude itself, so negative inputs too
    points = np.array([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0], np.float32)
    near = (points.view(np.int32)[:, None] + np.arange(-64, 65, dtype=np.int32)[None, :]).reshape(-1)
    sweep = np.arange(0, np.float32(16.0).view(np.int32), 37, dtype=np.int32)
    special = np.array([0.0, -0.0, np.inf, np.nan, 3e38, 1e-45, 1e-30], np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        a = np.concatenate([near.view(np.float32), sweep.view(np.float32), special])
        want = _e2m1_threshold_chain(a)
        assert np.array_equal(_e2m1_rint(a), want)
        got = _e2m1_add_pow2(a)
        assert np.array_equal(got, want), a[got != want][:8]
        neg = _e2m1_add_pow2(-a)
    assert np.array_equal(neg, want), a[neg != want][:8]


def _rn32(x: Fraction) -> Fraction:
    """``x`` rounded to the nearest fp32 (ties to even; subnormals; no overflow in these tests)."""
    if x == 0:
        return Fraction(0)
    mag = abs(x)
    e = max(mag.numerator.bit_length() - mag.denominator.bit_length() - 1, -126)
    while Fraction(2) ** (e + 1) <= mag:
        e += 1
    while e > -126 and Fraction(2) ** e > mag:
        e -= 1
    quantum = Fraction(2) ** (e - 23)
    n, rest = divmod(mag / quantum, 1)
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2 == 1):
        n += 1
    return (n * quantum) * (1 if x > 0 else -1)


def _fma(a: Fraction, b: Fraction, c: Fraction) -> Fraction:
    return _rn32(a * b + c)


def _ulp(x: Fraction) -> Fraction:
    return Fraction(2) ** (max(abs(x).numerator.bit_length() - abs(x).denominator.bit_length() - 1, -126) - 23)


def _div_by(a: Fraction, b: Fraction, y0: Fraction, big: float) -> Fraction:
    """``block_quant.div_by(a, b, rcp_refined(b))`` with ``rcp.approx`` returning ``y0``, exactly."""
    y = _fma(y0, _fma(-b, y0, Fraction(1)), y0)
    q0 = _rn32(a * y)
    q1 = _fma(y, _fma(-b, q0, a), q0)
    return q0 if abs(q0) > big else q1


def test_division_by_a_hoisted_reciprocal_is_ieee() -> None:
    """``block_quant.div_by``, replayed in exact arithmetic, equals the IEEE quotient for divisors of the
    NVFP4 range (block scale times a global scale in [2**-90, 2**90]) and quotients at and around
    every E2M1 (``big`` 16) and E4M3 (``big`` 1024) rounding threshold, for each reciprocal
    ``rcp.approx`` may return (within 1 ulp of ``1 / b``, as PTX specifies); past ``big`` it returns a
    quotient past ``big`` too, which the caller saturates alike."""
    rng = np.random.default_rng(7)
    e2m1 = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1.0, 3.0, 15.9, 16.0, 40.0]
    e4m3 = [float(v) * 2.0**e for v in (1.0, 1.0625, 1.125, 1.5, 1.9375) for e in range(-10, 9)] + [464.0, 1023.0, 1e4]
    checked = saturated = 0
    for _ in range(120):
        b = _rn32(Fraction(float(rng.uniform(1, 2))) * Fraction(2) ** int(rng.integers(-99, 99)))
        inv = _rn32(1 / b)
        for thresholds, big in ((e2m1, 16.0), (e4m3, 1024.0)):
            for tau in rng.choice(thresholds, 4):
                base = _rn32(Fraction(float(tau)) * b)
                for k in (-2, -1, 0, 1, 2):
                    a = base + k * _ulp(base)
                    want = _rn32(a / b)
                    for y0 in (inv - _ulp(inv), inv, inv + _ulp(inv)):
                        got = _div_by(a, b, y0, big)
                        if abs(want) <= big / 2:
                            assert got == want, (a, b, y0)
                            checked += 1
                        else:
                            assert abs(got) > big / 2, (a, b, y0)
                            saturated += 1
    assert checked > 4000 and saturated > 100, (checked, saturated)
