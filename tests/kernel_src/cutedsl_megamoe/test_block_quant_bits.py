"""The register dequantization of the block-scaled kernels, bit for bit on the CPU: the instruction
sequences of ``block_quant.e4m3x4_to_bf16x4`` and ``e2m1x8_to_bf16x8`` replayed in Python with the
module's own selectors and masks, for every input byte, against torch's decoding of the formats."""

from __future__ import annotations

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


def test_e2m1_spread_is_value_times_2_pow_minus_126() -> None:
    bq = drop.kernel_helpers.block_quant
    for base in range(0, 256, 4):
        chunk = [base, base + 1, base + 2, base + 3]
        word = sum(b << (8 * k) for k, b in enumerate(chunk))
        lo, hi = word & 0x0F0F0F0F, (word >> 4) & 0x0F0F0F0F
        for m, sel in enumerate(bq.E2M1_PAIR_SELECTORS):
            w = ((prmt(lo, hi, sel) * bq.E2M1_SPREAD) & M32) & bq.E2M1_BF16_MASK
            b = chunk[m]
            want = [(-1.0 if n & 8 else 1.0) * E2M1[n & 7] * 2.0**-126 for n in (b & 0xF, b >> 4)]
            assert list(bf16_halves(w)) == want, (b, bf16_halves(w), want)
