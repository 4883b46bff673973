"""``core.validation.check_forward_inputs`` for pre-quantized activations (codes and block scales):
the layouts of ``PREQUANTIZED_LAYOUTS``, and each way a forward's inputs can be wrong."""

from __future__ import annotations

import pytest
import torch

from flashinfer.moe_ep.core.quant import quantize_mxfp8, quantize_nvfp4
from flashinfer.moe_ep.core.validation import check_forward_inputs
from flashinfer.moe_ep.errors import MoEEpInputError

H, K, E, T = 64, 2, 8, 5
CPU = torch.device("cpu")


def _routing(t: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(t)]).int() if t else torch.zeros(0, K, dtype=torch.int32)
    return ids, torch.rand(t, K)


def _check(x, scales, fmt: str, t: int = T, **kw) -> int:
    ids, w = _routing(t)
    return check_forward_inputs(
        x,
        ids,
        w,
        hidden_size=H,
        top_k=K,
        num_experts=E,
        max_tokens=16,
        device=CPU,
        input_format=fmt,
        scales=scales,
        **kw,
    )


def test_codes_and_scales_of_core_quant_pass() -> None:
    x = torch.randn(T, H)
    assert _check(*quantize_mxfp8(x), "mxfp8") == T
    packed, bs, _ = quantize_nvfp4(x)
    assert _check(packed, bs, "nvfp4") == T
    q, s = quantize_mxfp8(x[:0])
    assert _check(q, s, "mxfp8", t=0) == 0


def test_wrong_prequantized_inputs_are_named() -> None:
    x = torch.randn(T, H)
    q, s = quantize_mxfp8(x)
    packed, bs, _ = quantize_nvfp4(x)
    with pytest.raises(MoEEpInputError, match="takes bf16 hidden_states"):
        _check(x.bfloat16(), s, "bf16")  # scales given to a bf16 layer
    with pytest.raises(MoEEpInputError, match="scales is None"):
        _check(q, None, "mxfp8")
    with pytest.raises(MoEEpInputError, match="hidden_states must have dtype"):
        _check(x.bfloat16(), s, "mxfp8")  # bf16 where the codes belong
    with pytest.raises(MoEEpInputError, match="hidden_states must have shape"):
        _check(packed.repeat(1, 2), bs, "nvfp4")  # E2M1 pairs: H / 2 bytes per row
    with pytest.raises(MoEEpInputError, match="scales must have shape"):
        _check(q, s[:, :1], "mxfp8")
    with pytest.raises(MoEEpInputError, match="scales must have dtype"):
        _check(packed, bs.view(torch.uint8), "nvfp4")  # NVFP4 block scales are E4M3
    with pytest.raises(MoEEpInputError, match="scales must have shape"):
        _check(q, s[:3], "mxfp8")  # one scale row per token
    with pytest.raises(MoEEpInputError, match="above FleetParams.max_tokens_per_rank"):
        big = torch.randn(20, H)
        _check(*quantize_mxfp8(big), "mxfp8", t=20)
    with pytest.raises(MoEEpInputError, match="topk_ids must have shape"):
        ids, w = _routing(T + 1)
        check_forward_inputs(q, ids, w, hidden_size=H, top_k=K, num_experts=E, max_tokens=16, device=CPU,
                             input_format="mxfp8", scales=s)  # fmt: skip
    with pytest.raises(MoEEpInputError, match="unknown input format"):
        _check(q, s, "fp8")
