"""Host-side packing of block-scaled expert weights into the quantized kernels' layout (torch only).

Two tensors per matrix, both ``[E, K/64, N, ...]`` uint8 so that the rows of one (expert, K tile)
are one contiguous run (one TMA box each):

- data ``[E, K/64, N, D]``: the row's 64 elements of the K tile (D = 64 E4M3 bytes, or 32 bytes of
  E2M1 pairs, element 2i in the low nibble), as D/16 segments of 16 bytes. Inside a segment the bytes
  are reordered so that 32-bit word ``q`` holds what lane ``q`` of a quad needs for a WGMMA A
  fragment (``SEGMENT_ORDER``): MXFP8 (a segment is one K16 block) the element pairs ``2q, 2q+1`` and
  ``2q+8, 2q+9``; NVFP4 (a segment is two K16 blocks) the bytes ``q, q+4, q+8, q+12``, i.e. element
  pairs ``2q + 8j`` for j = 0..3, and the 32 bits of that word are then stored permuted
  (``common.host_utils.e2m1_word_sources``, from ``constants.E2M1_PAIR_TERMS``) so the kernels turn
  each byte's pair into BF16 with one to four instructions. Segment ``s`` of row ``r`` is stored in
  slot ``s ^ swizzle(r)`` (``segment_swizzle``): 8 consecutive rows then occupy 8 different 16-byte
  bank groups, so an 8-row ``ldmatrix`` and the 16-byte loads of the shared-memory dequantization are
  conflict-free.
- scales ``[E, K/64, N, S]``: the row's block-scale bytes of the K tile: S = 2 raw UE8M0 bytes, or
  S = 4 NVFP4 scale bytes re-encoded (``constants.NVFP4_SCALE_BIAS``) so that the kernels make the BF16
  multiplier of one in two instructions; the codes of a block whose scale is zero are stored as zeros
  (their values are zero either way), and negative scales are rejected.

That is 1 + 1/32 bytes per MXFP8 weight and 1/2 + 1/16 per NVFP4 weight: what the checkpoint stores.
"""

from __future__ import annotations

import torch

from ..common import constants
from ..common.host_utils import e2m1_word_sources
from ..moe_bf16_glu.weights import interleave_gate_up

#: byte order inside a 16-byte data segment: stored byte ``i`` is source byte ``SEGMENT_ORDER[fmt][i]``
SEGMENT_ORDER = {
    constants.FMT_MXFP8: [b for q in range(4) for b in (2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9)],
    constants.FMT_NVFP4: [q + 4 * m for q in range(4) for m in range(4)],
}
#: the largest UE8M0 scale byte the kernels take (the BF16 multiplier ``2**(byte - 15)`` must be finite)
MXFP8_MAX_SCALE_BYTE = 142


def segment_swizzle(row: int | torch.Tensor, fmt: str) -> int | torch.Tensor:
    """The XOR applied to the segment index of ``row``: ``(row // rows_per_128_bytes) % segments``."""
    d = constants.QUANT_DATA_BYTES[fmt]
    return (row // (128 // d)) % (d // constants.QUANT_SEGMENT_BYTES)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _permute_word_bits(words: torch.Tensor, sources: list[int]) -> torch.Tensor:
    """``words`` (int64 holding 32-bit values): bit b of the result is bit ``sources[b]`` of the input
    (one masked shift per distinct distance)."""
    masks: dict[int, int] = {}
    for b, s in enumerate(sources):
        masks[b - s] = masks.get(b - s, 0) | (1 << s)
    out = torch.zeros_like(words)
    for d, mask in masks.items():
        part = words & mask
        out |= part << d if d >= 0 else part >> -d
    return out


def _e2m1_words(tiles: torch.Tensor, store: bool) -> torch.Tensor:
    """NVFP4 segments ``[..., 16]`` uint8 (bytes in ``SEGMENT_ORDER``) with the bits of each 32-bit
    word permuted into the stored layout (``store``) or back to the logical one (nibble n at bits
    4n..4n+3), one expert at a time (the int64 words take 8 bytes per 4)."""
    logical = [4 * n + i for n, i in e2m1_word_sources()]  # stored bit b <- logical bit logical[b]
    sources = logical if store else sorted(range(32), key=logical.__getitem__)
    lanes = torch.tensor([0, 8, 16, 24], device=tiles.device)
    out = torch.empty_like(tiles)
    for e in range(tiles.shape[0]):
        words = (tiles[e].reshape(-1, 4).long() << lanes).sum(-1)
        words = _permute_word_bits(words, sources)
        out[e] = ((words[:, None] >> lanes) & 0xFF).to(torch.uint8).reshape(tiles[e].shape)
    return out


def _check_scales(scale: torch.Tensor, fmt: str) -> None:
    if fmt == constants.FMT_MXFP8:
        if bool((_bytes(scale) > MXFP8_MAX_SCALE_BYTE).any()):
            raise ValueError(
                f"MXFP8 block scales above 2**15 (scale bytes > {MXFP8_MAX_SCALE_BYTE}) are not supported by the kernel"
            )
        return
    values = _bytes(scale).view(torch.float8_e4m3fn).float()
    if not bool(torch.isfinite(values).all()):
        raise ValueError("NVFP4 block scales must be finite (E4M3 NaN codes are rejected)")
    if bool((values < 0).any()):
        raise ValueError("NVFP4 block scales must not be negative")


def _nvfp4_scale_codes() -> tuple[torch.Tensor, torch.Tensor]:
    """(stored byte of each E4M3 byte 0..255, E4M3 byte of each stored byte): the BF16 multiplier
    ``scale * 2**112`` of a positive scale is ``(stored << 4) + NVFP4_SCALE_BIAS`` exactly (at most 4
    significant bits; its low 4 mantissa bits are 0); zero (and -0) is 0. Negative and NaN bytes map
    to 0 too: ``_check_scales`` rejects them first."""
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = e4m3.view(torch.float8_e4m3fn).float()
    bits = (values * 2.0**112).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    code = (bits - constants.NVFP4_SCALE_BIAS) >> 4
    positive = values > 0
    assert bool(((bits[positive] & 0xF) == 0).all()) and bool(((code[positive] > 0) & (code[positive] < 256)).all())
    stored = torch.where(positive, code, 0).to(torch.uint8)
    back = torch.zeros(256, dtype=torch.uint8)
    back[stored[positive].long()] = e4m3[positive]
    return stored, back


def _pack_nvfp4_scales(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``data`` [E, N, K/2] E2M1 pairs with the codes of zero-scale blocks zeroed, and ``scale``
    [E, N, K/16] re-encoded (``_nvfp4_scale_codes``)."""
    stored, _ = _nvfp4_scale_codes()
    codes = stored.to(scale.device)[scale.long()]
    e, n, kb = data.shape
    zero = (codes == 0).reshape(e, n, -1, 1)
    data = torch.where(zero, torch.zeros((), dtype=data.dtype, device=data.device), data.reshape(e, n, -1, 8))
    return data.reshape(e, n, kb), codes


def pack_quantized_matrix(data: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``data`` [E, N, K] float8_e4m3fn (mxfp8) or [E, N, K/2] uint8 (nvfp4), ``scale`` [E, N, K/block]
    (uint8 UE8M0 / float8_e4m3fn) -> (data [E, K/64, N, D], scales [E, K/64, N, S]) uint8."""
    if fmt not in constants.QUANT_FORMATS:
        raise ValueError(f"unknown format {fmt!r}")
    tk = constants.TILE_K
    data_b, scale_b = _bytes(data), _bytes(scale)
    e, n, kb = data_b.shape
    d = constants.QUANT_DATA_BYTES[fmt]
    k = kb * tk // d
    if k % tk:
        raise ValueError(f"K={k} must be a multiple of {tk}")
    kt = k // tk
    spt = constants.QUANT_SCALES_PER_TILE[fmt]
    if tuple(scale_b.shape) != (e, n, kt * spt):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match data {tuple(data.shape)} for {fmt}")
    _check_scales(scale, fmt)
    if fmt == constants.FMT_NVFP4:
        data_b, scale_b = _pack_nvfp4_scales(data_b, scale_b)
    seg = constants.QUANT_SEGMENT_BYTES
    nseg = d // seg
    order = torch.tensor(SEGMENT_ORDER[fmt], device=data_b.device)
    tiles = data_b.reshape(e, n, kt, nseg, seg)[..., order]  # bytes reordered inside each segment
    if fmt == constants.FMT_NVFP4:
        tiles = _e2m1_words(tiles, store=True)
    rows = torch.arange(n, device=data_b.device)
    slot = torch.arange(nseg, device=data_b.device)[None, :] ^ segment_swizzle(rows, fmt)[:, None]  # [N, nseg]
    out = torch.empty_like(tiles)
    out.scatter_(3, slot[None, :, None, :, None].expand_as(tiles), tiles)  # segment s -> slot s ^ swizzle
    packed = out.reshape(e, n, kt, d).transpose(1, 2).contiguous()
    scales = scale_b.reshape(e, n, kt, spt).transpose(1, 2).contiguous()
    return packed, scales


def unpack_quantized_matrix(packed: torch.Tensor, scales: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_quantized_matrix`: (data [E, N, K bytes] uint8, scales [E, N, K/block] uint8);
    NVFP4 blocks of zero scale come back with zero codes (and scale +0)."""
    e, kt, n, d = packed.shape
    seg = constants.QUANT_SEGMENT_BYTES
    nseg = d // seg
    tiles = packed.transpose(1, 2).reshape(e, n, kt, nseg, seg)
    rows = torch.arange(n, device=packed.device)
    slot = torch.arange(nseg, device=packed.device)[None, :] ^ segment_swizzle(rows, fmt)[:, None]
    segs = tiles.gather(3, slot[None, :, None, :, None].expand_as(tiles))
    if fmt == constants.FMT_NVFP4:
        segs = _e2m1_words(segs, store=False)
    inverse = torch.argsort(torch.tensor(SEGMENT_ORDER[fmt], device=packed.device))
    data = segs[..., inverse].reshape(e, n, kt * d)
    scales = scales.transpose(1, 2).reshape(e, n, -1)
    if fmt == constants.FMT_NVFP4:
        scales = _nvfp4_scale_codes()[1].to(scales.device)[scales.long()]
    return data.contiguous(), scales.contiguous()


def pack_quantized_weights(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    fmt: str,
    fc1_tile_n: int,
    gated: bool,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Both matrices of a layer, each as (data, scales): gate/up rows interleaved per ``fc1_tile_n``
    (gated activations, as in the BF16 kernel) for the data and the scales alike, then packed."""
    if gated:
        w13 = interleave_gate_up(_bytes(w13), fc1_tile_n)
        w13_scale = interleave_gate_up(_bytes(w13_scale), fc1_tile_n)
    return pack_quantized_matrix(w13, w13_scale, fmt), pack_quantized_matrix(w2, w2_scale, fmt)
