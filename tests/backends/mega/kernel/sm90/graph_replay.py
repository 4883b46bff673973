"""CUDA-graph replay checks shared by the GPU tests: capture forwards of a layer on static inputs, copy
fresh inputs into them, replay with the output poisoned, compare with an eager forward."""

from __future__ import annotations

from typing import Any

import torch


def capture(layer: Any, static: Any, hidden: int, launches: int = 1) -> tuple[torch.cuda.CUDAGraph, Any, torch.Tensor]:
    """A graph of ``launches`` forwards on ``static`` (``MoEEpTensors``) into a [T, hidden] output, warmed
    up on the capture stream."""
    out = torch.empty(static.hidden_states.shape[0], hidden, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer.forward(static, output=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            layer.forward(static, output=out)
    return graph, static, out


def replay_equals_eager(layer: Any, captured: tuple[torch.cuda.CUDAGraph, Any, torch.Tensor], fresh: Any) -> bool:
    """``fresh`` inputs copied into the graph's static ones; the replay equals an eager forward on them."""
    graph, static, out = captured
    static.hidden_states.copy_(fresh.hidden_states)
    static.topk_ids.copy_(fresh.topk_ids)
    static.topk_weights.copy_(fresh.topk_weights)
    out.fill_(float("nan"))
    graph.replay()
    return torch.equal(out, layer.forward(fresh))
