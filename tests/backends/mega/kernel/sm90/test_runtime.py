"""``backends/mega/kernel/sm90/runtime.py`` on the CPU: the warm-up forward hands the backend inputs in
the layout its config takes (bf16, or pre-quantized codes with their scales)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.backends.mega.kernel.sm90 import runtime
from flashinfer.moe_ep.core.validation import check_forward_inputs

CONFIGS = {
    "bf16": moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(256, 128, 8, 2),
    "mxfp8": moe.Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig(256, 128, 8, 2, prequantized_input=True),
    "nvfp4": moe.Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig(
        256, 128, 8, 2, prequantized_input=True, input_global_scale=0.5
    ),
}


@pytest.mark.parametrize("fmt", list(CONFIGS))
def test_warmup_forward_passes_inputs_the_config_takes(fmt: str, monkeypatch) -> None:
    config = CONFIGS[fmt]
    seen = []
    backend = SimpleNamespace(
        config=config,
        device=torch.device("cpu"),
        fleet=SimpleNamespace(max_tokens_per_rank=16),
        compute=lambda staged, out: seen.append((staged, out)),
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    runtime.warmup_forward(backend)
    ((staged, out),) = seen
    t = check_forward_inputs(
        staged.hidden_states, staged.topk_ids, staged.topk_weights, hidden_size=256, top_k=2, num_experts=8,
        max_tokens=16, device=torch.device("cpu"), output=out, input_format=config.input_format,
        scales=staged.scales,
    )  # fmt: skip
    assert t == 8 and (staged.scales is None) == (fmt == "bf16")
