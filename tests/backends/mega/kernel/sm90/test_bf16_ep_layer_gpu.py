"""The SM90 BF16 backend at world_size > 1 through the public layer API, with loopback ranks on one GPU
(marked ``gpu``): every rank's output against the single-process reference on the same global inputs,
repeatability, and a forced timeout that raises ``MoEEpTransportError``. Not a performance test.

Run it in its own pytest process (it sets ``CUDA_DEVICE_MAX_CONNECTIONS`` before CUDA starts, so the
ranks' streams do not share one hardware queue). Kernels: ``scripts/gpu_session.py build``.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import pytest
import torch

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.core.inputs import (
    make_expert_weights,
    make_hidden_states,
    make_topk,
    relative_errors,
    rounding_ulps,
)
from flashinfer.moe_ep.core.reference import moe_reference

pytestmark = pytest.mark.gpu

EP_GEOMETRY = {"hidden_size": 256, "intermediate_size": 128, "num_experts": 16, "top_k": 4}
#: (world size, explicit EP knobs or None) of every layer these tests build (prebuilt by gpu_session.py)
EP_CASES = [(2, None), (4, None), (2, {"tile_m": 128, "fc1_tile_n": 256})]
EP_MAX_TOKENS = 256


def _config(knobs: dict | None = None) -> moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig:
    return moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(**EP_GEOMETRY, knobs=knobs)


def _world(world: int, timeout_s: float = 2.0, knobs: dict | None = None):
    cfg = _config(knobs)
    g = torch.Generator().manual_seed(world)
    w13, w2 = make_expert_weights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, generator=g, device="cuda")
    group = moe.make_loopback_group(world, "cuda")
    e_loc = cfg.num_experts // world
    layers = [
        moe.MoEEpLayer(
            moe.BootstrapConfig(
                world_size=world,
                rank=r,
                device="cuda",
                symmetric_memory="loopback",
                loopback_group=group,
                transport_timeout_s=timeout_s,
            ),
            moe.FleetParams(cfg.num_experts, EP_MAX_TOKENS, cfg.hidden_size),
            moe.MoEWeightPack(
                w13[r * e_loc : (r + 1) * e_loc].contiguous(), w2[r * e_loc : (r + 1) * e_loc].contiguous()
            ),
            backend=moe.MegaConfig(cfg),
            check_values=False,
        )
        for r in range(world)
    ]
    for layer in layers:
        layer.warmup()
    streams = [torch.cuda.Stream() for _ in range(world)]
    for s in streams:  # load the sleep kernel now: a lazy load inside a forward would block the host
        with torch.cuda.stream(s):
            torch.cuda._sleep(1)
    torch.cuda.synchronize()
    return cfg, w13, w2, layers, streams


def _rank_inputs(cfg, g: torch.Generator, tokens_per_rank: list[int]) -> list[tuple]:
    """(x, topk_ids, topk_weights) of every rank, uniform routing."""
    inputs = []
    for t in tokens_per_rank:
        x = make_hidden_states(t, cfg.hidden_size, generator=g, device="cuda")
        ids, w = make_topk(t, cfg.num_experts, cfg.top_k, generator=g, device="cuda")
        inputs.append((x, ids, w))
    return inputs


def _assert_matches_reference(inputs, outs, w13, w2) -> None:
    """Every rank's output against the single-process reference on the concatenated global inputs."""
    ref, scale = moe_reference(torch.cat([i[0] for i in inputs]), torch.cat([i[1] for i in inputs]),
                               torch.cat([i[2] for i in inputs]), w13, w2, return_term_scale=True)  # fmt: skip
    got = torch.cat(outs)
    assert relative_errors(got, ref)[0] < 1e-2 and rounding_ulps(got, ref, scale) <= 4.0


def _forward(layers, streams, inputs, ranks=None):
    outs = [None] * len(layers)
    for r in ranks if ranks is not None else range(len(layers)):
        with torch.cuda.stream(streams[r]):
            x, ids, w = inputs[r]
            outs[r] = torch.full_like(x, float("nan"))
            layers[r].forward(moe.MoEEpTensors(x, ids, w), output=outs[r])
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("world, knobs", EP_CASES)
def test_loopback_ep_layer_matches_the_reference(world: int, knobs: dict | None) -> None:
    cfg, w13, w2, layers, streams = _world(world, knobs=knobs)
    g = torch.Generator().manual_seed(100 + world)
    tokens = [(37 * (r + 3)) % 200 + 1 for r in range(world)]
    tokens[1] = 0  # a zero-token rank
    for routing in ("uniform", "skewed"):
        inputs = []
        for t in tokens:
            x = make_hidden_states(t, cfg.hidden_size, generator=g, device="cuda")
            ids, w = make_topk(t, cfg.num_experts, cfg.top_k, routing=routing, generator=g, device="cuda")
            inputs.append((x, ids, w))
        first = _forward(layers, streams, inputs)
        for layer in layers:
            layer.check_transport()
        ref, scale = moe_reference(torch.cat([i[0] for i in inputs]), torch.cat([i[1] for i in inputs]),
                                   torch.cat([i[2] for i in inputs]), w13, w2, return_term_scale=True)  # fmt: skip
        got = torch.cat(first)
        assert not bool(got.isnan().any())
        mean_err, max_err = relative_errors(got, ref)
        ulps = rounding_ulps(got, ref, scale)
        print(f"world {world} {routing}: mean rel {mean_err:.2e}, max rel {max_err:.2e}, {ulps:.2f} units")
        assert mean_err < 1e-2 and ulps <= 4.0
        again = _forward(layers, streams, inputs)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    for layer in layers:
        layer.destroy()


def test_missing_rank_raises_transport_error_then_recovers() -> None:
    cfg, w13, w2, layers, streams = _world(2, timeout_s=0.2)
    inputs = _rank_inputs(cfg, torch.Generator().manual_seed(7), [5, 5])
    _forward(layers, streams, inputs, ranks=[0])  # rank 1 never arrives
    with pytest.raises(moe.MoEEpTransportError, match=r"rank 0 of 2: .* on rank 1 timed out"):
        layers[0].check_transport()
    for layer in layers:  # collective; rank 1 never ran the failed forward and is one epoch behind
        layer.recover_transport()
    for _ in range(2):  # the next forwards run normally on every rank
        outs = _forward(layers, streams, inputs)
        for layer in layers:
            layer.check_transport()
        _assert_matches_reference(inputs, outs, w13, w2)
    for layer in layers:
        layer.destroy()


def test_ep_layer_refuses_autotune_and_unknown_knobs() -> None:
    group = moe.make_loopback_group(2, "cuda")
    for knobs, match in (("auto", "no autotune"), ({"cluster_m": 2}, "unknown EP knob")):
        cfg = _config(knobs)
        w13, w2 = make_expert_weights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, device="cuda")
        with pytest.raises(moe.MoEEpConfigError, match=match):
            moe.MoEEpLayer(
                moe.BootstrapConfig(
                    world_size=2, rank=0, device="cuda", symmetric_memory="loopback", loopback_group=group
                ),
                moe.FleetParams(cfg.num_experts, EP_MAX_TOKENS, cfg.hidden_size),
                moe.MoEWeightPack(w13[:8].contiguous(), w2[:8].contiguous()),
                backend=moe.MegaConfig(cfg),
            )


def test_graph_capture_is_refused_and_the_layer_stays_usable() -> None:
    cfg, w13, w2, layers, streams = _world(2)
    inputs = _rank_inputs(cfg, torch.Generator().manual_seed(5), [9, 9])
    x, ids, w = inputs[0]
    with pytest.raises(moe.MoEEpConfigError, match="CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layers[0].forward(moe.MoEEpTensors(x, ids, w), output=torch.empty_like(x))
    outs = _forward(layers, streams, inputs)  # every rank, eagerly: correct
    for layer in layers:
        layer.check_transport()
    _assert_matches_reference(inputs, outs, w13, w2)
    for layer in layers:
        layer.destroy()
