"""The reference semantics of the quantized MoE layers (MXFP8, NVFP4), in plain torch.

The oracle of the MXFP8 and NVFP4 kernels; ``docs/numerics.md`` ("Quantized layers") states it in prose.
Every quantize / dequantize is the bit-exact RNE code of :mod:`core.quant`; the combine is the BF16
path's :func:`core.reference.combine_topk`. Per (token t, slot k) with expert ``e = topk_ids[t, k]``::

    xq  = Q(x[t])                         quantized along H (per row; done by the kernel, fused)
    h   = deq(xq) @ deq(w13[e]).T         dequantized operands (exact in fp32), ``compute_dtype`` accumulation
    a   = fp32(act(h))                    activation in ``compute_dtype``, rounded to fp32 (no bf16 step)
    aq  = Q(a)                            requantized to the FC2 input format along I (FC1 epilogue)
    y   = bf16(deq(aq) @ deq(w2[e]).T)    ``compute_dtype`` accumulation, rounded to bf16
    out = bf16(sum_k w[t, k] * y_k)       fp32, k = 0 .. K-1 in that order (``combine_topk``)

``Q`` is :func:`core.quant.quantize_mxfp8` (E4M3 + UE8M0 per 32) or :func:`core.quant.quantize_nvfp4`
(E2M1 + E4M3 per 16 + an fp32 global scale).

NVFP4 activation global scales (``input_global_scale`` for ``x``, ``fc2_input_global_scale`` for ``a``):
given (static, calibrated: what checkpoints ship and the kernels take) or ``None`` = dynamic, computed
from the tensor being quantized: ``amax / (448 * 6)`` (the :func:`core.quant.quantize_nvfp4` rule) over
the *whole* tensor of the call, i.e. every row of ``hidden_states`` [T, H] for FC1 and every (t, k) row
of ``a`` [T*K, I] for FC2. In an EP layer "the call" is the whole group's tokens (the ranks all-reduce
the amax), so the EP result equals this function on the concatenated inputs.

Row locality: once the global scale is fixed, both formats quantize each row independently (blocks of 32
or 16 lie inside a row along K). So quantizing a token's hidden row on the rank that owns the expert
gives the same bits as quantizing it on the source rank; EP may move bf16 rows and quantize on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import MoEEpInputError
from .activations import ActivationSpec, apply_activation
from .quant import (
    MXFP8_BLOCK,
    NVFP4_BLOCK,
    dequantize_mxfp8,
    dequantize_nvfp4,
    quantize_mxfp8,
    quantize_nvfp4,
)
from .reference import combine_topk, combine_wire, exact_fp32_matmul
from .validation import check_tensor

QUANT_FORMATS = ("mxfp8", "nvfp4")
#: elements per block scale along K, per format.
FORMAT_BLOCK = {"mxfp8": MXFP8_BLOCK, "nvfp4": NVFP4_BLOCK}

#: a pre-quantized activation: ``(q, scale)`` for MXFP8, ``(packed, block_scale, global_scale)`` for NVFP4.
QuantizedActivation = tuple[torch.Tensor, ...]


def check_format(fmt: object) -> str:
    if fmt not in QUANT_FORMATS:
        raise MoEEpInputError(f"quantized format must be one of {', '.join(QUANT_FORMATS)}, got {fmt!r}")
    return fmt  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------------------


@dataclass
class QuantizedExpertWeights:
    """Expert weights in MXFP8 or NVFP4. K (the quantized, block-scaled dim) is the *last* dim of each
    matrix: H for ``w13`` [E, R, H] (R = 2I gate rows then up rows, or I for relu2), I for ``w2`` [E, H, I].

    ``mxfp8``: ``w13`` float8_e4m3fn [E, R, H], ``w13_scale`` uint8 [E, R, H/32] (UE8M0 biased exponents);
    ``w2`` float8_e4m3fn [E, H, I], ``w2_scale`` uint8 [E, H, I/32]; no global scales.

    ``nvfp4``: ``w13`` uint8 [E, R, H/2] (two E2M1 per byte, element 2i in the low nibble), ``w13_scale``
    float8_e4m3fn [E, R, H/16], ``w13_global_scale`` fp32 [E] (one per expert and matrix, the ModelOpt
    ``weight_scale_2``, a dequantization multiplier); ``w2`` uint8 [E, H, I/2], ``w2_scale``
    float8_e4m3fn [E, H, I/16], ``w2_global_scale`` fp32 [E].
    """

    fmt: str
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_global_scale: torch.Tensor | None = None
    w2_global_scale: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        k = self.w2.shape[2]
        return 2 * k if self.fmt == "nvfp4" else k

    @property
    def fc1_rows(self) -> int:
        return self.w13.shape[1]

    def check(
        self,
        *,
        num_local_experts: int | None = None,
        fc1_rows: int | None = None,
        hidden_size: int | None = None,
        intermediate_size: int | None = None,
        device: torch.device | None = None,
        prefix: str = "weights",
    ) -> None:
        """Shapes, dtypes, device and contiguity of every tensor (``None`` = taken from the tensors)."""
        fmt = check_format(self.fmt)
        p = prefix
        for name in ("w13", "w2"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise MoEEpInputError(f"{p}.{name} must be a 3-dim tensor, got {getattr(t, 'shape', type(t))}")
        e = self.w13.shape[0] if num_local_experts is None else num_local_experts
        r = self.w13.shape[1] if fc1_rows is None else fc1_rows
        h = self.w2.shape[1] if hidden_size is None else hidden_size
        i = self.intermediate_size if intermediate_size is None else intermediate_size
        block = FORMAT_BLOCK[fmt]
        for name, k in (("hidden_size", h), ("intermediate_size", i)):
            if k is not None and k % block:
                raise MoEEpInputError(f"{fmt} weights need {name} to be a multiple of {block}, got {k}")
        if fmt == "mxfp8":
            el, sc = torch.float8_e4m3fn, torch.uint8
            check_tensor(f"{p}.w13", self.w13, shape=(e, r, h), dtype=el, device=device)
            check_tensor(f"{p}.w13_scale", self.w13_scale, shape=(e, r, h // block), dtype=sc, device=device)
            check_tensor(f"{p}.w2", self.w2, shape=(e, h, i), dtype=el, device=device)
            check_tensor(f"{p}.w2_scale", self.w2_scale, shape=(e, h, i // block), dtype=sc, device=device)
            for name in ("w13_global_scale", "w2_global_scale"):
                if getattr(self, name) is not None:
                    raise MoEEpInputError(f"{p}.{name}: mxfp8 weights take no global scale (NVFP4 only)")
            return
        el, sc = torch.uint8, torch.float8_e4m3fn
        check_tensor(f"{p}.w13", self.w13, shape=(e, r, h // 2), dtype=el, device=device)
        check_tensor(f"{p}.w13_scale", self.w13_scale, shape=(e, r, h // block), dtype=sc, device=device)
        check_tensor(f"{p}.w2", self.w2, shape=(e, h, i // 2), dtype=el, device=device)
        check_tensor(f"{p}.w2_scale", self.w2_scale, shape=(e, h, i // block), dtype=sc, device=device)
        for name in ("w13_global_scale", "w2_global_scale"):
            gs = getattr(self, name)
            if gs is None:
                raise MoEEpInputError(f"{p}.{name} is required for nvfp4 weights (fp32 [{e}], one per expert)")
            check_tensor(f"{p}.{name}", gs, shape=(e,), dtype=torch.float32, device=device)
            if not bool((torch.isfinite(gs) & (gs > 0)).all()):
                raise MoEEpInputError(f"{p}.{name} must be finite and > 0")

    def reject_nan_codes(self) -> None:
        """Raise on the NaN encodings (UE8M0 scale byte 255, E4M3 codes 0x7F / 0xFF) that
        ``dequantize`` rejects too: for consumers (kernels) that never dequantize in torch."""
        if self.fmt == "mxfp8":
            for name in ("w13_scale", "w2_scale"):
                if bool((getattr(self, name) == 255).any()):
                    raise MoEEpInputError(f"weights.{name} contains 255 (the UE8M0 NaN encoding)")
            e4m3 = ("w13", "w2")  # elements; NVFP4: the block scales
        else:
            e4m3 = ("w13_scale", "w2_scale")
        for name in e4m3:
            if bool(((getattr(self, name).view(torch.uint8) & 0x7F) == 0x7F).any()):
                raise MoEEpInputError(f"weights.{name} contains an E4M3 NaN code (0x7F / 0xFF)")

    def reject_negative_scales(self) -> None:
        """Raise on negative NVFP4 block scales (an E4M3 sign bit with a non-zero magnitude; -0 is zero),
        which the torch dequantization takes but the SM90 kernels do not: they store each block scale
        as the exponent and mantissa of its BF16 multiplier (drop v26). Scales come out of
        ``quantize_nvfp4`` non-negative; MXFP8 scales have no sign."""
        if self.fmt != "nvfp4":
            return
        for name in ("w13_scale", "w2_scale"):
            b = getattr(self, name).view(torch.uint8)
            if bool(((b & 0x80 != 0) & (b & 0x7F != 0)).any()):
                raise MoEEpInputError(f"weights.{name} has negative NVFP4 block scales (the SM90 kernels take >= 0)")

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13, w2)`` in fp32 (exact: every dequantized value is representable in fp32)."""
        self.check()
        if self.fmt == "mxfp8":
            return dequantize_mxfp8(self.w13, self.w13_scale), dequantize_mxfp8(self.w2, self.w2_scale)
        assert self.w13_global_scale is not None and self.w2_global_scale is not None

        def per_expert(packed: torch.Tensor, bs: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
            out = torch.empty(*packed.shape[:-1], 2 * packed.shape[-1], device=packed.device)
            for e in range(packed.shape[0]):
                out[e] = dequantize_nvfp4(packed[e], bs[e], gs[e])
            return out

        w13 = per_expert(self.w13, self.w13_scale, self.w13_global_scale)
        w2 = per_expert(self.w2, self.w2_scale, self.w2_global_scale)
        return w13, w2


def quantize_expert_weights(w13: torch.Tensor, w2: torch.Tensor, fmt: str) -> QuantizedExpertWeights:
    """Quantize BF16 (or fp16 / fp32) expert weights ``w13`` [E, R, H], ``w2`` [E, H, I] along their last
    dim (H for ``w13``, I for ``w2``). NVFP4 gets one global scale per expert and matrix, computed from
    that expert's matrix (``amax / 2688``)."""
    fmt = check_format(fmt)
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise MoEEpInputError(f"quantize_expert_weights: {name} must be a 3-dim tensor [E, rows, K]")
    if w13.shape[0] != w2.shape[0] or w13.shape[2] != w2.shape[1]:
        raise MoEEpInputError(
            f"quantize_expert_weights: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} disagree on E or H"
        )
    if fmt == "mxfp8":
        # Expert by expert: the fp32 temporaries of one expert, not of the whole layer (deepseek-v3: 45 GB).
        def per_expert(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
            sc = torch.empty(*w.shape[:-1], w.shape[-1] // MXFP8_BLOCK, dtype=torch.uint8, device=w.device)
            for e in range(w.shape[0]):
                q[e], sc[e] = quantize_mxfp8(w[e])
            return q, sc

        q13, s13 = per_expert(w13)
        q2, s2 = per_expert(w2)
        return QuantizedExpertWeights(fmt, q13, s13, q2, s2)
    per13 = [quantize_nvfp4(w13[e]) for e in range(w13.shape[0])]
    per2 = [quantize_nvfp4(w2[e]) for e in range(w2.shape[0])]

    def stack(parts: list, j: int, like: torch.Tensor) -> torch.Tensor:
        return torch.stack([p[j] for p in parts]) if parts else like

    e, r, h, i = w13.shape[0], w13.shape[1], w13.shape[2], w2.shape[2]
    dev = w13.device
    return QuantizedExpertWeights(
        fmt,
        stack(per13, 0, torch.empty(e, r, h // 2, dtype=torch.uint8, device=dev)),
        stack(per13, 1, torch.empty(e, r, h // NVFP4_BLOCK, dtype=torch.float8_e4m3fn, device=dev)),
        stack(per2, 0, torch.empty(e, h, i // 2, dtype=torch.uint8, device=dev)),
        stack(per2, 1, torch.empty(e, h, i // NVFP4_BLOCK, dtype=torch.float8_e4m3fn, device=dev)),
        stack(per13, 2, torch.empty(e, device=dev)),
        stack(per2, 2, torch.empty(e, device=dev)),
    )


# ----------------------------------------------------------------------------------------------------------
# activations
# ----------------------------------------------------------------------------------------------------------


def nvfp4_global_scale_of_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """The dynamic NVFP4 global scale of a tensor whose amax is ``amax`` (fp32 0-dim), by the exact rule of
    :func:`core.quant.quantize_nvfp4` (it is run on a 16-element tensor with that amax). Lets EP ranks
    all-reduce an amax and derive the scale the single-process reference computes."""
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    block = torch.cat([a.abs(), a.new_zeros(NVFP4_BLOCK - 1)])
    return quantize_nvfp4(block)[2]


def nvfp4_static_scales(
    calibration: torch.Tensor,
    weights: QuantizedExpertWeights,
    activation: ActivationSpec | str,
    activation_limit: float | None = None,
) -> tuple[float, float]:
    """Static NVFP4 activation global scales from a calibration batch ``calibration`` [n, H], as a
    checkpoint ships them: the dynamic scale of the batch, and that of the FC1 output (after the
    activation) of every expert on it. Values beyond them saturate later (the same in kernel and
    reference)."""
    spec = activation if isinstance(activation, ActivationSpec) else ActivationSpec(activation, activation_limit)
    gs1 = nvfp4_global_scale_of_amax(calibration.float().abs().amax())
    xq, _ = fake_quantize_activation(calibration.float(), "nvfp4", gs1)
    amax = torch.zeros((), device=calibration.device)
    for e in range(weights.num_experts):
        w13 = dequantize_nvfp4(weights.w13[e], weights.w13_scale[e], weights.w13_global_scale[e])  # type: ignore[index]
        with exact_fp32_matmul():
            a = apply_activation(xq @ w13.T, spec.name, spec.limit)
        amax = torch.maximum(amax, a.abs().amax())
    return float(gs1), float(nvfp4_global_scale_of_amax(amax))


def fake_quantize_activation(
    x: torch.Tensor, fmt: str, global_scale: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize ``x`` [n, K] along K and dequantize: returns ``(fp32 [n, K], global_scale used)``.

    ``x`` in fp64 is rounded to fp32 first. NVFP4: ``global_scale`` None = computed from ``x`` (the whole
    tensor); MXFP8 takes none (returns None).
    """
    fmt = check_format(fmt)
    xf = x.float() if x.dtype == torch.float64 else x
    if fmt == "mxfp8":
        if global_scale is not None:
            raise MoEEpInputError("mxfp8 activations take no global scale (NVFP4 only)")
        return dequantize_mxfp8(*quantize_mxfp8(xf)), None
    packed, bs, gs = quantize_nvfp4(xf, global_scale)
    return dequantize_nvfp4(packed, bs, gs), gs


def dequantize_activation(xq: QuantizedActivation | list, fmt: str, hidden_size: int) -> torch.Tensor:
    """A pre-quantized activation ``(q, scale)`` (MXFP8) or ``(packed, block_scale, global_scale)``
    (NVFP4), rows along K = ``hidden_size``, to fp32 [n, hidden_size]."""
    fmt = check_format(fmt)
    want = 2 if fmt == "mxfp8" else 3
    if len(xq) != want:
        names = "(q, scale)" if fmt == "mxfp8" else "(packed, block_scale, global_scale)"
        raise MoEEpInputError(f"pre-quantized {fmt} hidden_states must be a tuple {names}, got {len(xq)} items")
    out = dequantize_mxfp8(*xq) if fmt == "mxfp8" else dequantize_nvfp4(*xq)
    if out.dim() != 2 or out.shape[1] != hidden_size:
        raise MoEEpInputError(
            f"pre-quantized hidden_states dequantize to shape {tuple(out.shape)}, expected [T, {hidden_size}]"
        )
    return out


# ----------------------------------------------------------------------------------------------------------
# the expert MLP, in two halves (EP ranks reduce the dynamic FC2 global scale between them)
# ----------------------------------------------------------------------------------------------------------


def _rows_by_expert(local_expert_of_row: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    return [
        (e, (local_expert_of_row == e).nonzero(as_tuple=True)[0]) for e in torch.unique(local_expert_of_row).tolist()
    ]


def quantized_fc1(
    xq_rows: torch.Tensor,
    local_expert_of_row: torch.Tensor,
    w13_deq: torch.Tensor,
    activation: ActivationSpec,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """FC1 + activation on dequantized inputs ``xq_rows`` [n, H] (fp32) with dequantized ``w13_deq``
    [E_local, R, H]; returns the activation ``a`` [n, I] in fp32 (before requantization)."""
    i = w13_deq.shape[1] // 2 if activation.gated else w13_deq.shape[1]
    a = torch.empty(xq_rows.shape[0], i, dtype=torch.float32, device=xq_rows.device)
    with exact_fp32_matmul():
        for e, rows in _rows_by_expert(local_expert_of_row):
            h = xq_rows[rows].to(compute_dtype) @ w13_deq[e].to(compute_dtype).T
            a[rows] = apply_activation(h, activation.name, activation.limit).float()
    return a


def quantized_fc2(
    aq_rows: torch.Tensor,
    local_expert_of_row: torch.Tensor,
    w2_deq: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
    fc2_abs: torch.Tensor | None = None,
) -> torch.Tensor:
    """FC2 on the dequantized requantized activation ``aq_rows`` [n, I]; returns bf16 ``y`` [n, H].

    ``fc2_abs`` (optional, [n, H] fp32) receives ``|aq| @ |w2|^T`` per row.
    """
    y = torch.empty(aq_rows.shape[0], w2_deq.shape[1], dtype=torch.bfloat16, device=aq_rows.device)
    with exact_fp32_matmul():
        for e, rows in _rows_by_expert(local_expert_of_row):
            y[rows] = (aq_rows[rows].to(compute_dtype) @ w2_deq[e].to(compute_dtype).T).to(torch.bfloat16)
            if fc2_abs is not None:
                fc2_abs[rows] = aq_rows[rows].float().abs() @ w2_deq[e].float().abs().T
    return y


# ----------------------------------------------------------------------------------------------------------
# the whole layer
# ----------------------------------------------------------------------------------------------------------


def moe_reference_quantized(
    hidden_states: torch.Tensor | QuantizedActivation,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: QuantizedExpertWeights,
    activation: ActivationSpec | str = "swiglu",
    activation_limit: float | None = None,
    fmt: str = "mxfp8",
    compute_dtype: torch.dtype = torch.float32,
    *,
    return_term_scale: bool = False,
    input_global_scale: float | torch.Tensor | None = None,
    fc2_input_global_scale: float | torch.Tensor | None = None,
    combine_dtype: str = "bf16",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The quantized layer on one process holding every expert: [T, H] bf16 (see the module docstring).

    ``hidden_states``: bf16 [T, H] (quantized here along H, as the kernels will in their prologue), or
    pre-quantized in ``fmt``: ``(q, scale)`` / ``(packed, block_scale, global_scale)``. ``weights`` must be
    in ``fmt``. ``input_global_scale`` / ``fc2_input_global_scale`` (NVFP4 only): the activation global
    scales, ``None`` = dynamic from the tensor (``input_global_scale`` must be None for pre-quantized
    inputs, which carry theirs). ``compute_dtype=torch.float64`` gives an fp64-accumulated oracle with the
    same rounding points. ``return_term_scale``: also return ``S = sum_k |w| (|y| + |aq| @ |w2|^T)`` as
    :func:`core.reference.moe_reference` does (with the dequantized operands). ``combine_dtype``: the
    wire format of ``y`` (:func:`core.reference.combine_wire`).
    """
    fmt = check_format(fmt)
    if weights.fmt != fmt:
        raise MoEEpInputError(f"weights are {weights.fmt}, the layer format is {fmt}")
    if fmt == "mxfp8" and (input_global_scale is not None or fc2_input_global_scale is not None):
        raise MoEEpInputError("mxfp8 activations take no global scale (NVFP4 only)")
    spec = activation if isinstance(activation, ActivationSpec) else ActivationSpec(activation, activation_limit)
    w13_deq, w2_deq = weights.dequantize()
    h_size = w2_deq.shape[1]
    if isinstance(hidden_states, (tuple, list)):
        if input_global_scale is not None:
            raise MoEEpInputError("pre-quantized hidden_states carry their own global scale")
        xq = dequantize_activation(hidden_states, fmt, h_size)
    else:
        xq, _ = fake_quantize_activation(hidden_states, fmt, input_global_scale)
    t, k = topk_ids.shape
    if xq.shape[0] != t:
        raise MoEEpInputError(f"hidden_states has {xq.shape[0]} rows, topk_ids {t}")
    flat_ids = topk_ids.reshape(-1).long()
    x_rows = xq.repeat_interleave(k, dim=0) if t else xq[:0]
    a = quantized_fc1(x_rows, flat_ids, w13_deq, spec, compute_dtype)
    aq, _ = fake_quantize_activation(a, fmt, fc2_input_global_scale)
    fc2_abs = torch.empty(t * k, h_size, device=xq.device) if return_term_scale else None
    y = quantized_fc2(aq, flat_ids, w2_deq, compute_dtype, fc2_abs).view(t, k, h_size)
    y = combine_wire(y, combine_dtype)
    out = combine_topk(y, topk_weights)
    if fc2_abs is None:
        return out
    terms = y.float().abs() + fc2_abs.view(t, k, h_size)
    scale = (topk_weights.float().abs()[:, :, None] * terms).sum(dim=1)
    return out, scale


__all__ = [
    "FORMAT_BLOCK",
    "QUANT_FORMATS",
    "QuantizedActivation",
    "QuantizedExpertWeights",
    "check_format",
    "dequantize_activation",
    "fake_quantize_activation",
    "moe_reference_quantized",
    "nvfp4_global_scale_of_amax",
    "nvfp4_static_scales",
    "quantize_expert_weights",
    "quantized_fc1",
    "quantized_fc2",
]
