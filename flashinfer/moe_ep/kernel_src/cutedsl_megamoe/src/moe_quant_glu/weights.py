"""Host-side packing of block-scaled expert weights into the quantized kernel's layout (torch only).

One packed row per (expert, K tile of 64, output row): the row's 64 elements of the tile (64 E4M3
bytes, or 32 bytes of E2M1 pairs), then one BF16 multiplier per block of the tile (2 for MXFP8, 4
for NVFP4): the block scale times 2**112, the factor the kernel's E4M3 -> F16 -> BF16 bit move leaves
out (``src.block_quant.e4m3x4_to_bf16x4``), then zero padding to ``QUANT_ROW_BYTES`` (80 / 48,
multiples of 16). Layout ``[E, K/64, N, row]``
uint8: the rows of one (expert, K tile) are contiguous, so one TMA box brings a stage's weights and
their scales together.
"""

from __future__ import annotations

import torch

from ..common import constants
from ..moe_bf16_glu.weights import interleave_gate_up


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def block_multipliers(scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Block scales -> BF16 ``scale * 2**112`` (exact). MXFP8 scale bytes above 142 (block scales above
    2**15) would overflow BF16 and are rejected; NVFP4 E4M3 scales always fit."""
    if fmt == constants.FMT_MXFP8:
        b = _bytes(scale).to(torch.int32)
        if bool((b > 142).any()):
            raise ValueError("MXFP8 block scales above 2**15 (scale bytes > 142) are not supported by the kernel")
        bits = (b + 112) << 7  # BF16 2**(byte - 127 + 112)
        return bits.to(torch.int16).view(torch.bfloat16)
    value = scale.view(torch.float8_e4m3fn).float() * 2.0**112
    if not bool(torch.isfinite(value).all()):
        raise ValueError("NVFP4 block scales must be finite (E4M3 NaN codes are rejected)")
    return value.to(torch.bfloat16)


def pack_quantized_matrix(data: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """``data`` [E, N, K] float8_e4m3fn (mxfp8) or [E, N, K/2] uint8 (nvfp4), ``scale`` [E, N, K/block]
    (uint8 UE8M0 / float8_e4m3fn) -> packed uint8 [E, K/64, N, row_bytes]."""
    if fmt not in constants.QUANT_FORMATS:
        raise ValueError(f"unknown format {fmt!r}")
    tk = constants.TILE_K
    data_b, scale_b = _bytes(data), _bytes(scale)
    e, n, kb = data_b.shape
    k = kb * tk // constants.QUANT_DATA_BYTES[fmt]
    if k % tk:
        raise ValueError(f"K={k} must be a multiple of {tk}")
    kt = k // tk
    spt = tk // constants.QUANT_BLOCK[fmt]  # scales per row per K tile
    if tuple(scale_b.shape) != (e, n, kt * spt):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match data {tuple(data.shape)} for {fmt}")
    row = constants.QUANT_ROW_BYTES[fmt]
    d = constants.QUANT_DATA_BYTES[fmt]
    out = torch.zeros(e, kt, n, row, dtype=torch.uint8, device=data.device)
    out[..., :d] = data_b.reshape(e, n, kt, d).transpose(1, 2)
    mult = block_multipliers(scale_b if fmt == constants.FMT_MXFP8 else scale, fmt).view(torch.uint8)
    out[..., d : d + 2 * spt] = mult.reshape(e, n, kt, 2 * spt).transpose(1, 2)
    return out


def pack_quantized_weights(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    fmt: str,
    fc1_tile_n: int,
    gated: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both matrices of a layer: gate/up rows interleaved per ``fc1_tile_n`` (gated activations, as in
    the BF16 kernel) for the data and the scales alike, then packed."""
    if gated:
        w13 = interleave_gate_up(_bytes(w13), fc1_tile_n)
        w13_scale = interleave_gate_up(_bytes(w13_scale), fc1_tile_n)
    return pack_quantized_matrix(w13, w13_scale, fmt), pack_quantized_matrix(w2, w2_scale, fmt)
