"""Fresh inputs of a contract's layer for the GPU tests: hidden states and a routing, drawn on the CPU
from one seed (so a failing case can be replayed) and moved to the GPU."""

from __future__ import annotations

from typing import Any

import torch

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.core.inputs import make_hidden_states, make_topk


def fresh_inputs(cfg: Any, t: int, routing: str, seed: int) -> moe.MoEEpTensors:
    """``t`` tokens of ``cfg``'s hidden size routed by ``routing`` (``make_topk``'s names), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = make_hidden_states(t, cfg.hidden_size, generator=g, device="cuda")
    ids, w = make_topk(t, cfg.num_experts, cfg.top_k, routing=routing, generator=g, device="cuda")
    return moe.MoEEpTensors(x, ids, w)
