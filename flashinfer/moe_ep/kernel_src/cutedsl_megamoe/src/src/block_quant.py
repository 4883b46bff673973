"""Device helpers for the block-scaled formats on Hopper (no block-scaled MMA): dequantization to
BF16 and the quantize-dequantize of activations, as inline PTX on 32-bit registers.

Formats (bit conventions of ``flashinfer.moe_ep.core.quant``; the kernels follow them bit for bit):

- MXFP8: E4M3 elements, one UE8M0 scale byte per 32 (``2 ** (byte - 127)``).
- NVFP4: E2M1 elements packed two per byte (element 2i in the low nibble), one E4M3 scale per 16,
  one fp32 global scale per tensor applied outside (to the fp32 accumulator).

Why BF16: ``e4m3 * 2**X`` and ``e2m1 * e4m3`` have at most 4 and 6 significant bits, so they are exact
in BF16 (8 bits) and BF16 WGMMA on the dequantized operands equals the reference's fp32 math on them up
to accumulation order. Plain Python functions emitting code while a ``@cute.kernel`` is traced.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from ..common import constants


def _sel(cond, a, b, ty):
    """``a if cond else b`` for traced values (a plain helper is not rewritten by the DSL)."""
    return ty(cutlass.select_(cond, ty(a), ty(b)))


def smem_addr(ptr) -> Int32:
    """The 32-bit shared-window address of a shared-memory pointer."""
    return cute.arch.inline_ptx("mov.u32 {$w0}, {$r0};", write_only_types=[Int32], read_only_args=[ptr])


def ld_shared_u8(addr: Int32) -> Uint32:
    return cute.arch.inline_ptx(
        "{ .reg .b16 t; ld.shared.u8 t, [{$r0}]; cvt.u32.u16 {$w0}, t; }",
        write_only_types=[Uint32],
        read_only_args=[addr],
    )


def ld_shared_b32(addr: Int32) -> Uint32:
    return cute.arch.inline_ptx("ld.shared.b32 {$w0}, [{$r0}];", write_only_types=[Uint32], read_only_args=[addr])


def ld_shared_u16(addr: Int32) -> Uint32:
    return cute.arch.inline_ptx(
        "{ .reg .b16 t; ld.shared.b16 t, [{$r0}]; cvt.u32.u16 {$w0}, t; }",
        write_only_types=[Uint32],
        read_only_args=[addr],
    )


def ld_shared_v4(addr: Int32) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    return cute.arch.inline_ptx(
        "ld.shared.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Uint32, Uint32, Uint32, Uint32],
        read_only_args=[addr],
    )


def ldmatrix_x4(addr: Int32) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """Four 8x16-byte matrices: lanes 8m..8m+7 give the row addresses of matrix m; every lane gets
    word ``lane % 4`` of row ``lane // 4`` of each matrix."""
    return cute.arch.inline_ptx(
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Uint32, Uint32, Uint32, Uint32],
        read_only_args=[addr],
    )


def ue8m0_multiplier(byte: Uint32) -> Uint32:
    """A UE8M0 scale byte (<= 142) -> the BF16 multiplier ``2**(byte - 127) * 2**112`` in both halves
    of a word: bits ``(byte + 112) << 7``. ``e4m3x4_to_bf16x4`` leaves out ``2**120`` of each value,
    so the products are ``value * scale * 2**-8``: the caller multiplies its fp32 accumulator by
    ``MXFP8_ACC_SCALE``."""
    return (byte + Uint32(112)) * Uint32(0x00800080)


def nvfp4_scale_multipliers(word: Uint32, count: int) -> list[Uint32]:
    """The first ``count`` stored NVFP4 scale bytes of ``word`` (``constants.NVFP4_SCALE_BIAS``) -> their
    BF16 multipliers ``scale * 2**112``, each in both halves of a word: ``prmt`` puts byte j at the
    bottom of both halves, one multiply-add shifts it into the exponent and mantissa fields."""
    bias2 = constants.NVFP4_SCALE_BIAS * 0x10001
    return [
        cute.arch.inline_ptx(
            f"{{ .reg .b32 t; prmt.b32 t, {{$r0}}, 0, {0x4040 + 0x101 * j:#x};"
            f" mad.lo.u32 {{$w0}}, t, 16, {bias2:#x}; }}",
            write_only_types=[Uint32],
            read_only_args=[word],
        )
        for j in range(count)
    ]


def st_shared_v4(addr: Int32, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32) -> None:
    cute.arch.inline_ptx(
        "st.shared.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};", read_only_args=[addr, w0, w1, w2, w3]
    )


def f32_bits(x: Float32) -> Uint32:
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Uint32], read_only_args=[x])


def f32_from_bits(b: Uint32) -> Float32:
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[b])


def ue8m0_to_f32(byte: Uint32) -> Float32:
    """``2 ** (byte - 127)`` (byte 0 is the fp32 subnormal 2**-127)."""
    bits = _sel(byte != Uint32(0), byte << 23, Uint32(0x00400000), Uint32)
    return f32_from_bits(bits)


def e4m3_to_f32(byte: Uint32) -> Float32:
    """One E4M3 byte (in the low 8 bits) to fp32, exactly."""
    return cute.arch.inline_ptx(
        "{ .reg .b16 lo, hi; .reg .b32 h; .reg .f16 h0, h1;\n"
        "mov.b32 {lo, hi}, {$r0};\n"
        "cvt.rn.f16x2.e4m3x2 h, lo;\n"
        "mov.b32 {h0, h1}, h;\n"
        "cvt.f32.f16 {$w0}, h0; }",
        write_only_types=[Float32],
        read_only_args=[byte],
    )


def e2m1_to_f32(nibble: Uint32) -> Float32:
    """One E2M1 code (the low 4 bits: sign, two exponent bits, one mantissa bit) to fp32, exactly:
    ``2**(e - 1) * (1 + m / 2)`` for e > 0, ``m / 2`` for e = 0."""
    mag = nibble & Uint32(7)
    e = mag >> 1
    m = mag & Uint32(1)
    normal = ((e + Uint32(126)) << 23) | (m << 22)
    sub = _sel(m != Uint32(0), Uint32(0x3F000000), Uint32(0), Uint32)  # 0.5 or 0
    bits = _sel(e != Uint32(0), normal, sub, Uint32) | ((nibble & Uint32(8)) << 28)
    return f32_from_bits(bits)


#: ``prmt`` selectors of ``e4m3x4_to_bf16x4``: bytes (2p, sign of 2p, 2p+1, sign of 2p+1) for pair p
E4M3_PAIR_SELECTORS = (0x9180, 0xB3A2)
#: the BF16 bits an E4M3 byte lands on after ``prmt`` and ``<< 4``: sign, then exponent and mantissa
E4M3_BF16_MASK = 0x87F087F0


def e4m3x4_to_bf16x4(word: Uint32, mult2: Uint32) -> tuple[Uint32, Uint32]:
    """Four E4M3 bytes times a block multiplier -> four BF16 (two packed words, byte 0 in the low half
    of the first), exactly; the result is ``value * scale * 2**-8`` (``MXFP8_ACC_SCALE``).
    ``mult2``: the BF16 multiplier ``scale * 2**112`` in both halves (``ue8m0_multiplier``).

    Per pair, four instructions: ``prmt`` puts each byte in the low byte of a half and its sign
    replicated in the high byte; ``<< 4`` and a mask leave the sign at bit 15 and ``eeeemmm`` at bits
    10..4, which read as a BF16 are ``value * 2**-120`` (E4M3 subnormals become BF16 subnormals, the
    same factor); one BF16 FMA with the multiplier (exact: <= 4 significant bits times a power of 2).
    """
    body = "".join(
        f"prmt.b32 y, {{$r0}}, 0, {sel:#x}; shl.b32 y, y, 4; and.b32 y, y, {E4M3_BF16_MASK:#x};\n"
        f"fma.rn.bf16x2 {{$w{p}}}, y, {{$r1}}, z;\n"
        for p, sel in enumerate(E4M3_PAIR_SELECTORS)
    )
    return cute.arch.inline_ptx(
        "{ .reg .b32 y, z;\nmov.b32 z, 0x80008000;\n" + body + "}",
        write_only_types=[Uint32, Uint32],
        read_only_args=[word, mult2],
    )


#: what ``e4m3x4_to_bf16x4`` leaves out of the MXFP8 products (the accumulators are ``2**-8`` too small)
MXFP8_ACC_SCALE = 2.0**8

E2M1_BF16_MASK = constants.E2M1_BF16_MASK


def _e2m1_term_ptx(op: str, amount: int) -> str:
    """PTX putting term ``(op, amount)`` of ``constants.E2M1_PAIR_TERMS`` of the word ``{$r0}`` in ``t``."""
    if op == "shl":
        return f"shl.b32 t, {{$r0}}, {amount};" if amount else "mov.b32 t, {$r0};"
    if op == "shr":
        return f"shr.u32 t, {{$r0}}, {amount};"
    if op == "rotl":
        return f"shf.l.wrap.b32 t, {{$r0}}, {{$r0}}, {amount};"
    raise ValueError(f"unknown E2M1 term {op!r}")


def e2m1x8_to_bf16x8(word: Uint32, mult_lo: Uint32, mult_hi: Uint32) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """One stored NVFP4 data word (eight E2M1 nibbles, bits permuted by the packing; logical byte m =
    elements 2m (low nibble) and 2m+1) times block multipliers -> four BF16 pairs, one word per byte,
    exactly: bytes 0-1 times ``mult_lo``, bytes 2-3 times ``mult_hi`` (``scale * 2**112`` in both
    halves, as for E4M3). The result is ``value * 2**-14``: the caller multiplies its fp32
    accumulator by ``NVFP4_ACC_SCALE``.

    A nibble ``s e1 e0 m`` placed at BF16 bits 15 and 8..6 is the BF16 ``value * 2**-126`` (the two
    exponent bits land in the exponent field, m in the top mantissa bit; e = 0 gives the subnormal
    ``m * 2**-127``, which is ``0.5 * 2**-126``), so one multiply by ``scale * 2**112`` is exact (<= 6
    significant bits, normal). The packing stores the word's bits so that pair m is the OR of masked
    shifts or rotations of the word (``constants.E2M1_PAIR_TERMS``): 9 instructions for the 8
    placements, then the 4 multiplies."""
    body = ""
    for m, terms in enumerate(constants.E2M1_PAIR_TERMS):
        for i, (op, amount, mask) in enumerate(terms):
            combine = "mov.b32 w, t;" if i == 0 else "or.b32 w, w, t;"
            body += f"{_e2m1_term_ptx(op, amount)} and.b32 t, t, {mask:#x}; {combine}\n"
        body += f"fma.rn.bf16x2 {{$w{m}}}, w, {{$r{1 if m < 2 else 2}}}, z0;\n"
    return cute.arch.inline_ptx(
        "{ .reg .b32 t, w, z0;\nmov.b32 z0, 0x80008000;\n" + body + "}",
        write_only_types=[Uint32, Uint32, Uint32, Uint32],
        read_only_args=[word, mult_lo, mult_hi],
    )


#: what ``e2m1x8_to_bf16x8`` leaves out of the NVFP4 products (the accumulators are ``2**-14`` too small)
NVFP4_ACC_SCALE = 2.0**14


# ------------------------------------------------------------------------------------------------
# quantize-dequantize of fp32 values (activations), bit-exact with core.quant
# ------------------------------------------------------------------------------------------------


def _e4m3_roundtrip_pair(a: Float32, b: Float32, mul: Float32, scale: Float32) -> tuple[Float32, Float32]:
    """``RNE_e4m3_saturating(v * mul) * scale`` for v in (a, b) (cvt.satfinite clamps to +-448)."""
    return cute.arch.inline_ptx(
        "{ .reg .f32 x0, x1; .reg .b16 q; .reg .b32 h; .reg .f16 h0, h1;\n"
        "mul.rn.f32 x0, {$r0}, {$r2}; mul.rn.f32 x1, {$r1}, {$r2};\n"
        "cvt.rn.satfinite.e4m3x2.f32 q, x1, x0;\n"
        "cvt.rn.f16x2.e4m3x2 h, q;\n"
        "mov.b32 {h0, h1}, h;\n"
        "cvt.f32.f16 x0, h0; cvt.f32.f16 x1, h1;\n"
        "mul.rn.f32 {$w0}, x0, {$r3}; mul.rn.f32 {$w1}, x1, {$r3}; }",
        write_only_types=[Float32, Float32],
        read_only_args=[a, b, mul, scale],
    )


def _mxfp8_scale(amax: Float32) -> tuple[Uint32, Float32]:
    """The UE8M0 scale byte of a block with max |v| = ``amax``, ``max(exponent(amax) - 8, 0)``
    (``floor(log2 amax) - 8`` biased, clamped at 2**-127), and ``2**-X``, its inverse (a normal fp32
    for every X)."""
    e = (f32_bits(amax) >> 23) & Uint32(0xFF)
    sbyte = _sel(e > Uint32(8), e - Uint32(8), Uint32(0), Uint32)
    return sbyte, f32_from_bits((Uint32(254) - sbyte) << 23)


def mxfp8_qdq(vals: list, amax: Float32) -> list:
    """MXFP8 quantize-dequantize of one 32-element block (``amax`` = max |v| over it): the scale byte
    of ``_mxfp8_scale``, elements ``RNE_e4m3(v * 2**-X)`` saturating; returns ``q * 2**X`` (exact in
    BF16). ``vals`` may be a thread's part of a block spread over warps, of odd length too (the
    last value then goes through the pair conversion twice)."""
    sbyte, inv = _mxfp8_scale(amax)
    scale = ue8m0_to_f32(sbyte)
    out = []
    for i in range(0, len(vals), 2):
        pair = _e4m3_roundtrip_pair(vals[i], vals[min(i + 1, len(vals) - 1)], inv, scale)
        out.extend(pair[: len(vals) - i])
    return out


def _e4m3x4_codes(a: Float32, b: Float32, c: Float32, d: Float32, mul: Float32) -> Uint32:
    """``RNE_e4m3_saturating(v * mul)`` of four values as one word, the first value in the low byte
    (``cvt.rn.satfinite.e4m3x2.f32 q, hi, lo`` puts ``lo`` in the low byte): memory order."""
    return cute.arch.inline_ptx(
        "{ .reg .f32 x0, x1, x2, x3; .reg .b16 lo, hi;\n"
        "mul.rn.f32 x0, {$r0}, {$r4}; mul.rn.f32 x1, {$r1}, {$r4};\n"
        "mul.rn.f32 x2, {$r2}, {$r4}; mul.rn.f32 x3, {$r3}, {$r4};\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, x1, x0;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, x3, x2;\n"
        "mov.b32 {$w0}, {lo, hi}; }",
        write_only_types=[Uint32],
        read_only_args=[a, b, c, d, mul],
    )


def mxfp8_codes(vals: list, amax: Float32) -> tuple[Uint32, list]:
    """MXFP8 quantization of one 32-element block (the rule of ``mxfp8_qdq``): its scale byte and its
    E4M3 codes as 8 words, element 4i + j in byte j of word i."""
    sbyte, inv = _mxfp8_scale(amax)
    words = [_e4m3x4_codes(vals[i], vals[i + 1], vals[i + 2], vals[i + 3], inv) for i in range(0, len(vals), 4)]
    return sbyte, words


def mul_rn(a: Float32, b: Float32) -> Float32:
    return cute.arch.inline_ptx("mul.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b])


def rcp_refined(b: Float32) -> Float32:
    """The reciprocal that ``div.rn.f32`` multiplies by on its fast path: ``rcp.approx(b)`` (``MUFU.RCP``)
    refined by one Newton step, ``y0 + y0 * (1 - b * y0)``. For a normal ``b`` whose reciprocal is
    normal (``|b|`` in [2**-125, 2**125])."""
    return cute.arch.inline_ptx(
        "{ .reg .f32 y0, e, nb;\n"
        "rcp.approx.ftz.f32 y0, {$r0}; neg.f32 nb, {$r0};\n"
        "fma.rn.f32 e, nb, y0, 0f3F800000; fma.rn.f32 {$w0}, y0, e, y0; }",
        write_only_types=[Float32],
        read_only_args=[b],
    )


def div_by(a: Float32, b: Float32, y: Float32, big: float) -> Float32:
    """``a / b`` rounded to nearest (IEEE), from ``y = rcp_refined(b)`` computed once per divisor:
    ``div.rn.f32``'s fast path, ``q0 = a * y``, ``q = q0 + y * (a - b * q0)`` (the remainder exact by
    FMA), which ``ptxas`` emits for ``div.rn`` behind a range check (``FCHK``) and a call to a slow path.
    Without the check and the call, divisions of a block no longer serialize on a branch each. The
    check fails only where the quotient overflows or underflows, or an operand is not a normal number:
    here ``|q0| > big`` (a quotient past every threshold of the caller's rounding, +-inf included)
    returns ``q0``, whose rounding saturates the same way; NaN stays NaN; an underflowing quotient
    stays a tiny number of the same sign (or a zero), which the callers round to zero as they do the
    IEEE one."""
    return cute.arch.inline_ptx(
        "{ .reg .f32 q0, r, q1, nb, m; .reg .pred p;\n"
        "mul.rn.f32 q0, {$r0}, {$r2}; neg.f32 nb, {$r1};\n"
        "fma.rn.f32 r, nb, q0, {$r0}; fma.rn.f32 q1, {$r2}, r, q0;\n"
        f"abs.f32 m, q0; setp.gt.f32 p, m, {_f32_hex(big)};\n"
        "selp.f32 {$w0}, q0, q1, p; }",
        write_only_types=[Float32],
        read_only_args=[a, b, y],
    )


def _f32_hex(x: float) -> str:
    """A PTX fp32 literal (``0f`` and the IEEE bits)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", x))[0]


def _round_e2m1_magnitude(r: Float32) -> Float32:
    """RNE of ``|r|`` onto {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating (ties to the even code), NaN -> 0.

    The grid step is 0.5 below 2, 1 from 2 and 2 from 4: ``2 ** (e - 1)`` for ``x = |r|`` in
    ``[2 ** e, 2 ** (e + 1))``, e >= 0 (0.5 below 1 too). Adding ``c = 2 ** (e + 22)``, whose ulp is that
    step, rounds x to a multiple of it (ties to the even multiple, which is the even code) and
    subtracting c again is exact; x is clamped to 8 first (past 5 everything gives 6) and the result
    to 6. 8 instructions (``max(|r|, 0)`` maps NaN to 0). Equal, for every fp32 input, to
    ``rint(x / step) * step`` of drops v20-v31 and to the threshold chain of drop v19 and before
    (0.25 < x -> .5, 0.75 <= x -> 1, ..., 5 < x -> 6; tests/kernel_src/cutedsl_megamoe/test_block_quant_bits.py)."""
    return cute.arch.inline_ptx(
        "{ .reg .f32 x, c, t; .reg .b32 e;\n"
        "abs.f32 x, {$r0}; max.f32 x, x, 0f00000000; min.f32 x, x, 0f41000000;\n"  # min(|r|, 8), NaN -> 0
        "mov.b32 e, x; and.b32 e, e, 0x7F800000; max.u32 e, e, 0x3F800000;\n"  # 2**e, e >= 0
        "add.u32 e, e, 0x0B000000; mov.b32 c, e;\n"  # c = 2**(e + 22)
        "add.rn.f32 t, x, c; sub.rn.f32 t, t, c;\n"
        "min.f32 {$w0}, t, 0f40C00000; }",
        write_only_types=[Float32],
        read_only_args=[r],
    )


class Nvfp4Global(NamedTuple):
    """The per-tensor part of NVFP4 quantization, computed outside the blocks' loops (``nvfp4_global``:
    once per kernel in the gathers, once per tile in the GEMM epilogues): the global scale ``gs``,
    ``c6 = 6 * gs`` (the block scale's divisor) and its ``rcp_refined``."""

    gs: Float32
    c6: Float32
    y6: Float32


def nvfp4_global(global_scale: Float32) -> Nvfp4Global:
    c6 = mul_rn(Float32(6.0), global_scale)
    return Nvfp4Global(global_scale, c6, rcp_refined(c6))


#: ``div_by`` thresholds: a block scale quotient past 1024 saturates E4M3 (448), an element quotient
#: past 16 saturates E2M1 (6)
_E4M3_SATURATED = 1024.0
_E2M1_SATURATED = 16.0


def nvfp4_qdq(vals: list, amax: Float32, g: Nvfp4Global) -> list:
    """NVFP4 quantize-dequantize of one 16-element block with the global scale of ``g``
    (``nvfp4_global``): ``bs = RNE_e4m3(amax / (6 * gs))``, ``d = bs * gs``, elements ``RNE_e2m1(v / d)``
    saturating; returns ``e2m1 * bs`` (exact in BF16; the caller applies ``gs`` to the fp32 accumulator).

    The divisions are IEEE (``div_by``: one reciprocal per block, three instructions per element, no
    branch), so the result equals ``core.quant``'s bit for bit for global scales in [2**-90, 2**90]
    (then ``6 * gs`` and ``d``, at least ``2**-9 * gs``, are normal with normal reciprocals), up to the
    sign of a zero where ``v / d`` underflows."""
    t = div_by(amax, g.c6, g.y6, _E4M3_SATURATED)
    bs_byte = cute.arch.inline_ptx(
        "{ .reg .b16 q; cvt.rn.satfinite.e4m3x2.f32 q, {$r1}, {$r0}; cvt.u32.u16 {$w0}, q; }",
        write_only_types=[Uint32],
        read_only_args=[t, Float32(0.0)],
    )
    bs = e4m3_to_f32(bs_byte & Uint32(0xFF))
    d = mul_rn(bs, g.gs)
    d_safe = _sel(d > Float32(0.0), d, Float32(1.0), Float32)
    y = rcp_refined(d_safe)
    out = []
    for v in vals:
        r = div_by(v, d_safe, y, _E2M1_SATURATED)
        m = _round_e2m1_magnitude(r) * bs
        out.append(_sel(r < Float32(0.0), -m, m, Float32))
    return out


def block_amax(vals: list) -> Float32:
    m = Float32(0.0)
    for v in vals:
        m = cute.arch.fmax(m, cute.arch.fmax(v, -v))
    return m


def quad_amax(m: Float32) -> Float32:
    """Max over the 4 lanes of a quad (the lanes sharing a row of a WGMMA accumulator fragment)."""
    m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, 1))
    return cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, 2))


__all__ = [
    "block_amax",
    "E2M1_BF16_MASK",
    "E4M3_BF16_MASK",
    "E4M3_PAIR_SELECTORS",
    "MXFP8_ACC_SCALE",
    "NVFP4_ACC_SCALE",
    "e2m1_to_f32",
    "e2m1x8_to_bf16x8",
    "e4m3_to_f32",
    "e4m3x4_to_bf16x4",
    "ld_shared_b32",
    "ld_shared_u16",
    "ld_shared_u8",
    "ld_shared_v4",
    "ldmatrix_x4",
    "mxfp8_codes",
    "mxfp8_qdq",
    "Nvfp4Global",
    "nvfp4_global",
    "nvfp4_qdq",
    "rcp_refined",
    "div_by",
    "nvfp4_scale_multipliers",
    "quad_amax",
    "smem_addr",
    "st_shared_v4",
    "ue8m0_multiplier",
    "ue8m0_to_f32",
]
