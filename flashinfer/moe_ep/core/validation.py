"""Input and weight validation shared by every backend.

Every check raises before anything is written, so a rejected call leaves the layer usable. Checks of
tensor *values* (id ranges, duplicates, finiteness) read the device and synchronize; the layer runs
them only when asked to (``check_values``) and never during CUDA-graph capture.
"""

from __future__ import annotations

import math

import torch

from ..errors import MoEEpInputError


def is_positive_finite(value: object) -> bool:
    """A real number (int or float, not bool) that is finite and > 0: scales, limits, timeouts."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(
    name: str,
    t: object,
    *,
    shape: tuple[int | None, ...],
    dtype: torch.dtype | tuple[torch.dtype, ...],
    device: torch.device | None,
    contiguous: bool = True,
) -> torch.Tensor:
    """Shape (``None`` = any extent), dtype, device and contiguity of one tensor."""
    if not isinstance(t, torch.Tensor):
        raise MoEEpInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape, strict=True)):
        want_s = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise MoEEpInputError(f"{name} must have shape {want_s}, got {_describe(t)}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise MoEEpInputError(
            f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {_describe(t)} "
            f"(convert with .to({dtypes[0]}))"
        )
    if device is not None and not _same_device(t.device, device):
        raise MoEEpInputError(f"{name} must be on {device}, got {_describe(t)}")
    if contiguous and not t.is_contiguous():
        raise MoEEpInputError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")
    return t


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        ia = a.index if a.index is not None else torch.cuda.current_device()
        ib = b.index if b.index is not None else torch.cuda.current_device()
        return ia == ib
    return True


#: pre-quantized hidden_states per format: (codes dtype, codes columns per H, scales dtypes, H per scale)
PREQUANTIZED_LAYOUTS: dict[str, tuple[torch.dtype, float, tuple[torch.dtype, ...], int]] = {
    # E4M3 codes, UE8M0 scale bytes (uint8, or torch's float8_e8m0fnu where it exists)
    "mxfp8": (
        torch.float8_e4m3fn,
        1.0,
        (torch.uint8, *([torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else [])),
        32,
    ),
    "nvfp4": (torch.uint8, 0.5, (torch.float8_e4m3fn,), 16),  # E2M1 pairs (element 2i low), E4M3 scales
}


def check_forward_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    hidden_size: int,
    top_k: int,
    num_experts: int,
    max_tokens: int,
    device: torch.device,
    output: torch.Tensor | None = None,
    check_values: bool = True,
    input_format: str = "bf16",
    scales: torch.Tensor | None = None,
) -> int:
    """Validate one forward's inputs; returns T. ``input_format`` is how the layer takes hidden_states
    (``MegaKernelConfig.input_format``): bf16 [T, H] and no ``scales``, or pre-quantized codes with
    their block ``scales`` (``PREQUANTIZED_LAYOUTS``)."""
    if input_format != "bf16" or scales is not None:
        if not _prequantized_well_formed(
            hidden_states, scales, topk_ids, topk_weights, output, input_format, hidden_size, top_k, max_tokens, device
        ):
            t = _check_prequantized(hidden_states, scales, input_format, hidden_size, max_tokens, device)
            _check_routing_and_output(t, hidden_states, topk_ids, topk_weights, output, hidden_size, top_k, device)
    elif not _all_well_formed(hidden_states, topk_ids, topk_weights, output, hidden_size, top_k, max_tokens, device):
        # The common case passes one check of every rule; the per-field checks name what is wrong.
        _check_forward_fields(hidden_states, topk_ids, topk_weights, output, hidden_size, top_k, max_tokens, device)
    t = hidden_states.shape[0]
    if check_values and t > 0 and not _capturing(device):
        check_topk_values(topk_ids, topk_weights, num_experts)
    return t


def _prequantized_well_formed(
    codes: object,
    scales: object,
    ids: object,
    w: object,
    out: object,
    input_format: str,
    hidden: int,
    top_k: int,
    max_tokens: int,
    device: torch.device,
) -> bool:
    """``_all_well_formed`` for pre-quantized activations (False: the per-field checks name the fault)."""
    layout = PREQUANTIZED_LAYOUTS.get(input_format)
    if layout is None or not isinstance(scales, torch.Tensor):
        return False
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        return False
    code_dtype, per_h, scale_dtypes, block = layout
    t = codes.shape[0]
    return (
        t <= max_tokens
        and _well_formed(codes, t, int(hidden * per_h), code_dtype, device)
        and scales.dtype in scale_dtypes
        and _well_formed(scales, t, hidden // block, scales.dtype, device)
        and _routing_well_formed(t, codes, ids, w, out, hidden, top_k, device)
    )


def _check_prequantized(
    codes: torch.Tensor,
    scales: torch.Tensor | None,
    input_format: str,
    hidden_size: int,
    max_tokens: int,
    device: torch.device,
) -> int:
    if input_format == "bf16":
        raise MoEEpInputError(
            "MoEEpTensors.scales is set, but this layer takes bf16 hidden_states (pre-quantized activations: "
            "an SM90 block-scaled config with prequantized_input=True)"
        )
    if input_format not in PREQUANTIZED_LAYOUTS:
        raise MoEEpInputError(f"unknown input format {input_format!r}")
    code_dtype, per_h, scale_dtypes, block = PREQUANTIZED_LAYOUTS[input_format]
    if scales is None:
        raise MoEEpInputError(
            f"this layer takes pre-quantized {input_format} activations: hidden_states holds the codes and "
            "MoEEpTensors.scales their block scales (scales is None)"
        )
    t = _check_hidden_rows(codes, int(hidden_size * per_h), code_dtype, max_tokens, device)
    check_tensor("scales", scales, shape=(t, hidden_size // block), dtype=scale_dtypes, device=device)
    return t


def _check_hidden_rows(x: torch.Tensor, cols: int, dtype: torch.dtype, max_tokens: int, device: torch.device) -> int:
    """hidden_states [T, cols] of ``dtype`` with T within the workspace capacity; returns T."""
    check_tensor("hidden_states", x, shape=(None, cols), dtype=dtype, device=device)
    t = x.shape[0]
    if t > max_tokens:
        raise MoEEpInputError(
            f"hidden_states has T={t} tokens, above FleetParams.max_tokens_per_rank={max_tokens} "
            "(the workspace capacity)"
        )
    return t


def _check_routing_and_output(
    t: int,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    output: torch.Tensor | None,
    hidden_size: int,
    top_k: int,
    device: torch.device,
) -> None:
    check_tensor("topk_ids", topk_ids, shape=(t, top_k), dtype=torch.int32, device=device)
    check_tensor("topk_weights", topk_weights, shape=(t, top_k), dtype=torch.float32, device=device)
    if output is not None:
        check_tensor("output", output, shape=(t, hidden_size), dtype=torch.bfloat16, device=device)
        if t > 0 and _overlap(output, hidden_states):
            raise MoEEpInputError(
                "output must not overlap hidden_states in memory (the kernels read one while writing the other)"
            )


def _check_forward_fields(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    output: torch.Tensor | None,
    hidden_size: int,
    top_k: int,
    max_tokens: int,
    device: torch.device,
) -> None:
    """The rules of ``_all_well_formed`` one field at a time, raising ``MoEEpInputError`` on the first
    broken one with what it expected and what it got."""
    t = _check_hidden_rows(hidden_states, hidden_size, torch.bfloat16, max_tokens, device)
    _check_routing_and_output(t, hidden_states, topk_ids, topk_weights, output, hidden_size, top_k, device)


def _well_formed(t: object, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.dtype == dtype
        and t.dim() == 2
        and t.shape[0] == rows
        and t.shape[1] == cols
        and t.device == device
        and t.is_contiguous()
    )


def _all_well_formed(
    x: object,
    ids: object,
    w: object,
    out: object,
    hidden: int,
    top_k: int,
    max_tokens: int,
    device: torch.device,
) -> bool:
    """One pass over every rule ``check_forward_inputs`` enforces, without building messages; False
    sends the call through the per-field checks, which name what is wrong. ``device`` must carry its
    index (a bare "cuda" never matches here, only in the slow path)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return False
    t = x.shape[0]
    return (
        t <= max_tokens
        and _well_formed(x, t, hidden, torch.bfloat16, device)
        and _routing_well_formed(t, x, ids, w, out, hidden, top_k, device)
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte of memory."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _routing_well_formed(
    t: int, x: torch.Tensor, ids: object, w: object, out: object, hidden: int, top_k: int, device: torch.device
) -> bool:
    """The routing tensors and the output buffer (not overlapping ``x``) of a T-token forward."""
    return (
        _well_formed(ids, t, top_k, torch.int32, device)
        and _well_formed(w, t, top_k, torch.float32, device)
        and (out is None or (_well_formed(out, t, hidden, torch.bfloat16, device)
                             and (t == 0 or not _overlap(out, x))))  # type: ignore[arg-type]
    )  # fmt: skip


def check_live_tokens(num_tokens: object, t: int, device: torch.device, read_value: bool) -> int | None:
    """``MoEEpTensors.num_tokens``: an int32 tensor of one element on ``device``. With ``read_value``
    (synchronizes the device) its value must lie in [0, t] and is returned; else None."""
    check_tensor("num_tokens", num_tokens, shape=(1,), dtype=torch.int32, device=device)
    if not read_value:
        return None
    live = int(num_tokens.item())  # type: ignore[union-attr]
    if not 0 <= live <= t:
        raise MoEEpInputError(f"num_tokens holds {live}, outside [0, {t}] (T = the rows of hidden_states)")
    return live


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_topk_values(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> None:
    """Expert ids in range and distinct within each token; weights finite. Synchronizes the device."""
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        row = int((topk_ids == bad).any(dim=1).nonzero()[0, 0])
        raise MoEEpInputError(f"topk_ids holds expert id {bad} (token {row}), outside [0, {num_experts})")
    if topk_ids.shape[1] > 1:
        s = topk_ids.sort(dim=1).values
        dup = (s[:, 1:] == s[:, :-1]).any(dim=1)
        if bool(dup.any()):
            row = int(dup.nonzero()[0, 0])
            raise MoEEpInputError(f"topk_ids repeats an expert within token {row}: {topk_ids[row].tolist()}")
    finite = torch.isfinite(topk_weights).all(dim=1)
    if not bool(finite.all()):
        row = int((~finite).nonzero()[0, 0])
        raise MoEEpInputError(f"topk_weights holds a non-finite value (token {row}: {topk_weights[row].tolist()})")


def check_finite(name: str, t: torch.Tensor) -> None:
    """Reject NaN/Inf in a floating tensor (weights at load time)."""
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        raise MoEEpInputError(f"{name} holds a non-finite value (NaN or Inf); refusing to load it")


def check_expert_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    num_local_experts: int,
    fc1_rows: int,
    hidden_size: int,
    intermediate_size: int,
    dtype: torch.dtype | tuple[torch.dtype, ...],
    device: torch.device,
) -> None:
    """BF16-style (unquantized) expert weights: shapes, dtype, device, contiguity, finiteness."""
    check_tensor("weights.w13", w13, shape=(num_local_experts, fc1_rows, hidden_size), dtype=dtype, device=device)
    check_tensor(
        "weights.w2", w2, shape=(num_local_experts, hidden_size, intermediate_size), dtype=dtype, device=device
    )
    check_finite("weights.w13", w13)
    check_finite("weights.w2", w2)


__all__ = [
    "check_expert_weights",
    "check_finite",
    "PREQUANTIZED_LAYOUTS",
    "check_forward_inputs",
    "check_tensor",
    "check_topk_values",
]
