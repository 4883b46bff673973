"""Bit-exact pure-torch reference quantizers: MXFP8 and NVFP4 (CPU and GPU).

All rounding is round-to-nearest, ties-to-even (RNE), done in fp32 arithmetic by this module (it does not
rely on torch's float8 cast, whose out-of-range behaviour differs between torch versions: NaN on some,
saturation on others); the final cast to ``float8_e4m3fn`` only ever sees exactly representable values.
Inputs may be bf16 / fp16 / fp32; NaN or Inf in an input raises :class:`MoEEpInputError`.

* MXFP8 (OCP MX v1.0): E4M3 elements (max 448, no inf) and one UE8M0 scale per 32 consecutive elements
  of the last dim K. ``X = floor(log2(amax_block)) - 8``, clamped to [-127, 127]; the scale is stored as
  the biased exponent ``X + 127`` (uint8). Elements are ``RNE_e4m3(v / 2**X)``, saturating to +-448 (so
  a block whose amax has a mantissa above 1.75 saturates its largest element, as in the spec). An
  all-zero block gets scale byte 0 (2**-127, the clamped limit of the formula) and zero elements.
  ``dequant = float(q) * 2**X`` (exact in fp32).
* NVFP4 (NVIDIA ModelOpt / TensorRT convention): E2M1 elements (magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6),
  packed two per byte (element 2i in the low nibble, 2i+1 in the high nibble, sign = bit 3 of a nibble),
  one E4M3 block scale per 16 elements of K, one fp32 global scale per tensor. ``global_scale`` is the
  dequantization multiplier ``amax(tensor) / (448 * 6)`` (1.0 for an all-zero tensor; never below the
  smallest normal fp32). ``block_scale = RNE_e4m3(amax_block / (6 * global_scale))`` (saturating at
  448); with ``d = float(block_scale) * global_scale`` (fp32), ``element = RNE_e2m1(v / d)`` saturating
  to +-6, and a zero block scale gives zero elements. ``dequant = e2m1 * d``.

Signs of zero are kept (a negative value that rounds to zero becomes -0, nibble 0x8 / byte 0x80).
"""

from __future__ import annotations

import torch

from flashinfer.moe_ep.errors import MoEEpInputError

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "MXFP8_BLOCK",
    "NVFP4_BLOCK",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "pack_e2m1",
    "quantize_activations",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "round_to_e2m1",
    "round_to_e4m3",
    "unpack_e2m1",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16

_E4M3_MBITS, _E4M3_EMIN = 3, -6  # 3 mantissa bits; smallest normal 2**-6, subnormal step 2**-9
_E2M1_MBITS, _E2M1_EMIN = 1, 0  # 1 mantissa bit; smallest normal 1.0, subnormal step 0.5
_E4M3_EMAX = 8  # emax_elem of the OCP spec: 448 = 1.75 * 2**8
_UE8M0_BIAS = 127
_UE8M0_XMIN, _UE8M0_XMAX = -127, 127  # byte 255 is NaN
_NVFP4_GLOBAL_DIV = E4M3_MAX * E2M1_MAX  # 2688.0
_FP32_TINY = torch.finfo(torch.float32).tiny  # 2**-126

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
# E2M1 nibble code -> value (codes 0..7 positive, 8..15 the same magnitudes negated).
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_VALUES = _E2M1_MAGNITUDES + tuple(-m for m in _E2M1_MAGNITUDES)


# ----------------------------------------------------------------------------------------------------------
# exact power-of-two and rounding helpers
# ----------------------------------------------------------------------------------------------------------


def _exp2i(n: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2**n`` for an integer tensor ``n`` in [-149, 127], built from the bit pattern."""
    n = n.to(torch.int32)
    normal = torch.bitwise_left_shift((n + 127).clamp(1, 254), 23)
    subnormal = torch.bitwise_left_shift(torch.ones_like(n), (n + 149).clamp(0, 22))
    return torch.where(n >= -126, normal, subnormal).view(torch.float32)


def _round_to_grid(x: torch.Tensor, mbits: int, emin: int, max_value: float) -> torch.Tensor:
    """RNE of fp32 ``x`` onto a float format with ``mbits`` mantissa bits and min normal exponent ``emin``.

    Saturates to ``+-max_value`` (Inf too); NaN stays NaN; the sign of zero is kept. Clamping before
    rounding equals rounding then saturating, since ``max_value`` is on the grid and RNE is monotone.
    """
    mag = x.abs().clamp(max=max_value)
    _, e = torch.frexp(mag)  # mag = m * 2**e, m in [0.5, 1): floor(log2(mag)) = e - 1 (mag > 0)
    e = (e - 1).clamp(min=emin)  # below the normal range the step is the subnormal one
    # mag * 2**(mbits - e) is exact (power-of-two scaling of a value in range); torch.round is RNE.
    steps = torch.round(mag * _exp2i(mbits - e))
    return torch.copysign(steps * _exp2i(e - mbits), x)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E4M3 (float8_e4m3fn) value, ties to even, saturating to +-448; returns fp32."""
    return _round_to_grid(x.float(), _E4M3_MBITS, _E4M3_EMIN, E4M3_MAX)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value, ties to even, saturating to +-6; returns fp32.

    Ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (the even code wins).
    """
    return _round_to_grid(x.float(), _E2M1_MBITS, _E2M1_EMIN, E2M1_MAX)


# ----------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------


def _check_float_input(x: object, fn: str, name: str, block: int) -> torch.Tensor:
    """Validate a quantizer input and return it as fp32."""
    if not isinstance(x, torch.Tensor):
        raise MoEEpInputError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise MoEEpInputError(f"{fn}: {name} dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1:
        raise MoEEpInputError(f"{fn}: {name} must have at least one dim (K is the last), got a 0-dim tensor")
    k = x.shape[-1]
    if k % block != 0:
        raise MoEEpInputError(f"{fn}: {name} last dim K={k} must be a multiple of the block size {block}")
    if bool(torch.isnan(x).any()):
        raise MoEEpInputError(f"{fn}: {name} contains NaN (inputs must be finite)")
    if bool(torch.isinf(x).any()):
        raise MoEEpInputError(f"{fn}: {name} contains Inf (inputs must be finite)")
    return x.float()


def _check_dtype(t: object, fn: str, name: str, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise MoEEpInputError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise MoEEpInputError(f"{fn}: {name} dtype must be {dtype}, got {t.dtype}")
    if t.dim() < 1:
        raise MoEEpInputError(f"{fn}: {name} must have at least one dim, got a 0-dim tensor")
    return t


def _check_scale_shape(data_shape: torch.Size, k: int, scale: torch.Tensor, block: int, fn: str) -> None:
    expected = (*data_shape[:-1], k // block)
    if tuple(scale.shape) != expected:
        raise MoEEpInputError(
            f"{fn}: scale shape must be {expected} (one per {block} elements of K={k}), got {tuple(scale.shape)}"
        )


def _check_same_device(fn: str, *tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise MoEEpInputError(f"{fn}: all tensors must be on one device, got {sorted(map(str, devices))}")


def _global_scale_tensor(gs: object, fn: str, device: torch.device) -> torch.Tensor:
    """Validate a user global scale (float or one-element tensor): finite and > 0; return fp32 0-dim."""
    if isinstance(gs, torch.Tensor):
        if gs.numel() != 1:
            raise MoEEpInputError(f"{fn}: global_scale must be a scalar, got shape {tuple(gs.shape)}")
        if not gs.is_floating_point():
            raise MoEEpInputError(f"{fn}: global_scale must be a floating-point tensor, got {gs.dtype}")
        t = gs.detach().reshape(()).to(device=device, dtype=torch.float32)
    elif isinstance(gs, (int, float)) and not isinstance(gs, bool):
        t = torch.tensor(float(gs), dtype=torch.float32, device=device)
    else:
        raise MoEEpInputError(f"{fn}: global_scale must be a float or a scalar tensor, got {type(gs).__name__}")
    value = float(t)
    if not (value > 0.0 and value != float("inf")):  # also rejects NaN
        raise MoEEpInputError(f"{fn}: global_scale must be finite and > 0 (in fp32), got {value}")
    return t


# ----------------------------------------------------------------------------------------------------------
# MXFP8
# ----------------------------------------------------------------------------------------------------------


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` (K % 32 == 0) to MXFP8.

    Returns ``(q: float8_e4m3fn [..., K], scale: uint8 [..., K/32])`` where ``scale`` holds the UE8M0
    biased exponent ``X + 127`` of the block scale ``2**X``; see the module docstring for the conventions.
    """
    fn = "quantize_mxfp8"
    xf = _check_float_input(x, fn, "x", MXFP8_BLOCK)
    k = xf.shape[-1]
    blocks = xf.reshape(*xf.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    _, e = torch.frexp(amax)  # floor(log2(amax)) = e - 1 for amax > 0 (fp32 subnormals included)
    x_exp = torch.where(amax > 0, e - 1 - _E4M3_EMAX, torch.full_like(e, _UE8M0_XMIN))
    x_exp = x_exp.clamp(_UE8M0_XMIN, _UE8M0_XMAX)
    # Multiply by 2**-X (exact: -X <= 127 is a normal fp32; fp32 can only underflow for |w| < 2**-126,
    # which E4M3 rounds to zero anyway, so the result is the exact RNE of v / 2**X).
    scaled = blocks * _exp2i(-x_exp).unsqueeze(-1)
    q = round_to_e4m3(scaled).reshape(xf.shape).to(torch.float8_e4m3fn)
    scale = (x_exp + _UE8M0_BIAS).to(torch.uint8)
    return q, scale


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantize MXFP8: ``float32(q) * 2**(scale - 127)`` per 32-element block of the last dim.

    Exact in fp32 for every scale :func:`quantize_mxfp8` produces (scale bytes above 246 can overflow
    to Inf with large elements). A scale byte of 255 (UE8M0 NaN) or a NaN element is rejected.
    """
    fn = "dequantize_mxfp8"
    _check_dtype(q, fn, "q", torch.float8_e4m3fn)
    _check_dtype(scale, fn, "scale", torch.uint8)
    _check_same_device(fn, q, scale)
    k = q.shape[-1]
    if k % MXFP8_BLOCK != 0:
        raise MoEEpInputError(f"{fn}: q last dim K={k} must be a multiple of the block size {MXFP8_BLOCK}")
    _check_scale_shape(q.shape, k, scale, MXFP8_BLOCK, fn)
    if bool((scale == 255).any()):
        raise MoEEpInputError(f"{fn}: scale contains 255 (the UE8M0 NaN encoding)")
    qf = q.float()
    if bool(torch.isnan(qf).any()):
        raise MoEEpInputError(f"{fn}: q contains NaN (E4M3 code 0x7F / 0xFF)")
    mult = _exp2i(scale.to(torch.int32) - _UE8M0_BIAS)
    blocks = qf.reshape(*q.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK) * mult.unsqueeze(-1)
    return blocks.reshape(q.shape)


# ----------------------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------------------


def _e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """uint8 nibble codes of fp32 values that are exactly E2M1 (sign from the sign bit, -0 -> 0x8)."""
    mags = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=values.device)
    idx = torch.searchsorted(mags, values.abs().contiguous())
    return (idx + torch.signbit(values).to(idx.dtype) * 8).to(torch.uint8)


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Pack exactly-E2M1 float values ``[..., K]`` (K even) into bytes ``uint8 [..., K/2]``.

    Element 2i goes in the low nibble, 2i+1 in the high nibble; a nibble is ``sign << 3 | code`` with
    codes 0..7 for 0, .5, 1, 1.5, 2, 3, 4, 6. Values not exactly on the E2M1 grid are rejected.
    """
    fn = "pack_e2m1"
    if not isinstance(values, torch.Tensor) or not values.is_floating_point() or values.dim() < 1:
        raise MoEEpInputError(f"{fn}: values must be a floating-point tensor with at least one dim")
    k = values.shape[-1]
    if k % 2 != 0:
        raise MoEEpInputError(f"{fn}: values last dim K={k} must be even (two elements per byte)")
    vf = values.float()
    if not bool((round_to_e2m1(vf) == vf).all()):  # NaN fails the comparison too
        raise MoEEpInputError(f"{fn}: values must be exactly representable in E2M1 (finite, on the grid)")
    codes = _e2m1_codes(vf)
    return torch.bitwise_or(torch.bitwise_left_shift(codes[..., 1::2], 4), codes[..., 0::2])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack ``uint8 [..., N]`` bytes (low nibble first) into fp32 E2M1 values ``[..., 2N]``."""
    fn = "unpack_e2m1"
    _check_dtype(packed, fn, "packed", torch.uint8)
    lut = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack([torch.bitwise_and(packed, 0x0F), torch.bitwise_right_shift(packed, 4)], dim=-1)
    return lut[codes.long()].reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize_nvfp4(
    x: torch.Tensor, global_scale: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` (K % 16 == 0) to NVFP4.

    Returns ``(packed: uint8 [..., K/2], block_scale: float8_e4m3fn [..., K/16], global_scale: fp32
    0-dim)``. ``global_scale`` is the dequantization multiplier; when None it is
    ``amax(x) / 2688`` (1.0 for an all-zero or empty tensor, raised to 2**-126 if it would be smaller).
    A given ``global_scale`` must be finite and > 0; one too small saturates block scales at 448 and
    elements at +-6. See the module docstring for the rounding conventions.
    """
    fn = "quantize_nvfp4"
    xf = _check_float_input(x, fn, "x", NVFP4_BLOCK)
    if global_scale is None:
        amax = xf.abs().amax() if xf.numel() > 0 else torch.zeros((), dtype=torch.float32, device=xf.device)
        gs = amax / _NVFP4_GLOBAL_DIV
        gs = torch.where(amax > 0, gs.clamp(min=_FP32_TINY), torch.ones_like(gs))
    else:
        gs = _global_scale_tensor(global_scale, fn, xf.device)
    k = xf.shape[-1]
    blocks = xf.reshape(*xf.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    bs = round_to_e4m3(block_amax / (E2M1_MAX * gs))  # ModelOpt order: amax / (6 * gs), in fp32
    d = (bs * gs).unsqueeze(-1)  # the fp32 block multiplier, identical in dequantize_nvfp4
    nonzero = d > 0
    scaled = torch.where(nonzero, blocks / torch.where(nonzero, d, torch.ones_like(d)), blocks * 0.0)
    values = round_to_e2m1(scaled).reshape(xf.shape)
    packed = pack_e2m1(values)
    return packed, bs.to(torch.float8_e4m3fn), gs.reshape(())


def quantize_activations(
    x: torch.Tensor, fmt: str, global_scale: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``x [T, H]`` as a layer with pre-quantized input takes them (``MoEEpTensors(codes, ...,
    scales=scales)``): MXFP8 ``(float8_e4m3fn [T, H], uint8 UE8M0 [T, H/32])``, NVFP4 ``(uint8 E2M1
    pairs [T, H/2], float8_e4m3fn [T, H/16])`` with ``global_scale`` (the layer's ``input_global_scale``)."""
    if fmt == "mxfp8":
        return quantize_mxfp8(x)
    if fmt == "nvfp4":
        packed, block_scale, _ = quantize_nvfp4(x, global_scale)
        return packed, block_scale
    raise MoEEpInputError(f"quantize_activations: unknown format {fmt!r} (mxfp8 or nvfp4)")


def dequantize_nvfp4(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: float | torch.Tensor
) -> torch.Tensor:
    """Dequantize NVFP4: ``e2m1 * (float32(block_scale) * global_scale)`` per 16 elements; fp32 ``[..., K]``."""
    fn = "dequantize_nvfp4"
    _check_dtype(packed, fn, "packed", torch.uint8)
    _check_dtype(block_scale, fn, "block_scale", torch.float8_e4m3fn)
    _check_same_device(fn, packed, block_scale)
    k = packed.shape[-1] * 2
    if k % NVFP4_BLOCK != 0:
        raise MoEEpInputError(
            f"{fn}: unpacked last dim K={k} (2 * packed.shape[-1]) must be a multiple of {NVFP4_BLOCK}"
        )
    _check_scale_shape(packed.shape, k, block_scale, NVFP4_BLOCK, fn)
    gs = _global_scale_tensor(global_scale, fn, packed.device)
    bsf = block_scale.float()
    if bool(torch.isnan(bsf).any()):
        raise MoEEpInputError(f"{fn}: block_scale contains NaN (E4M3 code 0x7F / 0xFF)")
    values = unpack_e2m1(packed)
    d = (bsf * gs).unsqueeze(-1)
    out = values.reshape(*packed.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK) * d
    return out.reshape(*packed.shape[:-1], k)
