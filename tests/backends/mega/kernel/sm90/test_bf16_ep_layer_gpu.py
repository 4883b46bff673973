"""The SM90 BF16 backend at world_size > 1 through the public layer API, with loopback ranks on one GPU
(marked ``gpu``): every rank's output against the single-process reference on the same global inputs,
repeatability, a forced timeout that raises ``MoEEpTransportError``, CUDA-graph replays with other live
token counts. Not a performance test.

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
EP_CASES = [
    (2, None),
    (4, None),
    (2, {"tile_m": 128, "fc1_tile_n": 256}),
    (2, {"tile_m": 64, "cluster_m": 2}),  # GEMM clusters: odd block counts close with a phantom block
    (2, {"tile_m": 128, "fc2_tile_n": 128, "cluster_m": 2}),
    (2, {"dispatch": "push"}),  # the sources write their rows into the owners' a_buf
    (4, {"dispatch": "push"}),
]
EP_MAX_TOKENS = 256


#: (world size, knobs) of the mxfp8 combine wire test (kernels prebuilt by gpu_session.py)
EP_WIRE_CASES = [(2, None), (4, {"dispatch": "push"})]


def _config(knobs: dict | None = None, combine_dtype: str = "bf16") -> moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig:
    return moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(**EP_GEOMETRY, knobs=knobs, combine_dtype=combine_dtype)


def _world(world: int, timeout_s: float = 2.0, knobs: dict | str | None = None, warm: bool = True, *, group=None,
           seed: int | None = None, share: bool = True, max_tokens: int = 256,
           combine_dtype: str = "bf16"):  # fmt: skip
    cfg = _config(knobs, combine_dtype).replace(share_workspace=share)
    g = torch.Generator().manual_seed(world if seed is None else seed)
    w13, w2 = make_expert_weights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, generator=g, device="cuda")
    group = moe.make_loopback_group(world, "cuda") if group is None else group
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
            moe.FleetParams(cfg.num_experts, max_tokens, cfg.hidden_size),
            moe.MoEWeightPack(
                w13[r * e_loc : (r + 1) * e_loc].contiguous(), w2[r * e_loc : (r + 1) * e_loc].contiguous()
            ),
            backend=moe.MegaConfig(cfg),
            check_values=False,
        )
        for r in range(world)
    ]
    for layer in layers if warm else ():
        layer.warmup()
    streams = [torch.cuda.Stream() for _ in range(world)]
    for s in streams:  # load the sleep kernel now: a lazy load inside a forward would block the host
        with torch.cuda.stream(s):
            torch.cuda._sleep(1)
    torch.cuda.synchronize()
    return cfg, w13, w2, layers, streams


def _rank_inputs(cfg, g: torch.Generator, tokens_per_rank: list[int], routing: str = "uniform") -> list[tuple]:
    """(x, topk_ids, topk_weights) of every rank."""
    inputs = []
    for t in tokens_per_rank:
        x = make_hidden_states(t, cfg.hidden_size, generator=g, device="cuda")
        ids, w = make_topk(t, cfg.num_experts, cfg.top_k, routing=routing, generator=g, device="cuda")
        inputs.append((x, ids, w))
    return inputs


def _global_inputs(inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ranks' (x, topk_ids, topk_weights) concatenated: the single-process reference's inputs."""
    return tuple(torch.cat([i[k] for i in inputs]) for k in range(3))


def _assert_matches_reference(inputs, outs, w13, w2) -> None:
    """Every rank's output against the single-process reference on the concatenated global inputs."""
    ref, scale = moe_reference(*_global_inputs(inputs), w13, w2, return_term_scale=True)
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
        inputs = _rank_inputs(cfg, g, tokens, routing)
        first = _forward(layers, streams, inputs)
        for layer in layers:
            layer.check_transport()
        ref, scale = moe_reference(*_global_inputs(inputs), w13, w2, return_term_scale=True)
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


#: world size and capacity of the mixed-bucket test: global T up to 2400 reaches the prefill bucket
#: (push dispatch by default), while a rank with few rows picks the decode bucket
EP_MIXED_WORLD = 2
EP_MIXED_MAX_TOKENS = 1200


def test_ranks_in_different_token_buckets_agree_on_the_dispatch() -> None:
    """Each rank picks its token bucket from its own rows, so one rank may run the prefill bucket's
    kernel while another runs the decode one. The dispatch is the layer's (the largest bucket's, in
    every bucket): otherwise a push source would never fill ``x_sym`` for a pull owner, and a push owner
    would wait for pushes that never come."""
    from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import ep_tuning

    cfg, w13, w2, layers, streams = _world(EP_MIXED_WORLD, max_tokens=EP_MIXED_MAX_TOKENS)
    by_bucket = layers[0]._backend.by_bucket
    assert len({fe.knobs.dispatch for fe in by_bucket.values()}) == 1
    g = torch.Generator().manual_seed(12)
    # loopback only: call every bucket's library once with every rank in that bucket first (a library's
    # first call loads its CUDA module, which waits for the kernels on the GPU, e.g. a spinning peer)
    for t in (3, 600, 1100):  # decode, mid, prefill at world 2
        inputs = _rank_inputs(cfg, g, [t, t])
        _assert_matches_reference(inputs, _forward(layers, streams, inputs), w13, w2)
    for tokens in ([1100, 3], [2, 1200], [900, 0]):
        buckets = {ep_tuning.bucket_of(EP_MIXED_WORLD, t) for t in tokens}
        inputs = _rank_inputs(cfg, g, tokens)
        outs = _forward(layers, streams, inputs)
        for layer in layers:
            layer.check_transport()
        _assert_matches_reference(inputs, outs, w13, w2)
        print(f"tokens {tokens}: buckets {sorted(buckets)}")
    assert len({ep_tuning.bucket_of(EP_MIXED_WORLD, t) for t in (1100, 3)}) == 2
    for layer in layers:
        layer.destroy()


@pytest.mark.parametrize("world, knobs", EP_WIRE_CASES)
def test_mxfp8_combine_wire_matches_the_reference(world: int, knobs: dict | None) -> None:
    """``combine_dtype="mxfp8"``: the owners send y as MXFP8 codes and scales (rewritten in place in their
    a_buf), the sources dequantize them: against the reference with the same wire (every element within
    4 half-steps of E4M3 of the term scale: an element of y on a rounding boundary may round to the
    other side after fp32 sums of another order), mean relative error < 1 %; repeatable bit for bit."""
    from .test_quant_gpu import format_units

    cfg, w13, w2, layers, streams = _world(world, knobs=knobs, combine_dtype="mxfp8")
    g = torch.Generator().manual_seed(200 + world)
    tokens = [(41 * (r + 2)) % 250 + 1 for r in range(world)]
    tokens[-1] = 0  # a zero-token rank
    for routing in ("uniform", "skewed", "empty"):
        inputs = _rank_inputs(cfg, g, tokens, routing)
        first = _forward(layers, streams, inputs)
        for layer in layers:
            layer.check_transport()
        ref, scale = moe_reference(*_global_inputs(inputs), w13, w2, return_term_scale=True, combine_dtype="mxfp8")
        plain = moe_reference(*_global_inputs(inputs), w13, w2)
        got = torch.cat(first)
        assert not bool(got.isnan().any())
        mean_err, max_err = relative_errors(got, ref)
        units = format_units(got, ref, scale, "mxfp8")
        wire_err = relative_errors(got, plain)[0]
        print(f"world {world} {routing} mxfp8 wire: mean rel {mean_err:.2e} (vs the bf16-wire reference "
              f"{wire_err:.2e}), max rel {max_err:.2e}, {units:.2f} units")  # fmt: skip
        assert mean_err < 1e-2 and units <= 4.0
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


#: world size and capacity of the knobs="auto" test (two token buckets: decode and mid; its candidates
#: are prebuilt by gpu_session.py)
EP_AUTO_WORLD = 2
EP_AUTO_MAX_TOKENS = 512


def test_knobs_auto_tunes_every_loopback_rank_together(tmp_path, monkeypatch) -> None:
    """``knobs="auto"``: the first rank's warmup tunes every token bucket of the whole loopback group
    (the largest first; the others keep its FC1 tile, the weight layout), every rank applies the same
    winners, they are recorded under the loopback context, the tuned layers are correct in both buckets,
    and a later layer with ``knobs=None`` reads the recorded knobs."""
    from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import ep_tuning
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

    monkeypatch.setenv("FLASHINFER_MOE_EP_KNOB_CACHE", str(tmp_path / "knobs.json"))
    cfg, w13, w2, layers, streams = _world(EP_AUTO_WORLD, knobs="auto", max_tokens=EP_AUTO_MAX_TOKENS)
    backends = [layer._backend for layer in layers]
    results = backends[0].tune_results
    assert sorted(results) == ["decode", "mid"] and all(not be.auto_pending for be in backends)
    geometry = backends[0].frontend.geometry
    for name, result in results.items():
        assert all(be.by_bucket[name].knobs == result.winner for be in backends)
        assert sum(row.ok for row in result.table) >= 2 and result.table[0].ok  # the incumbent ran too
        drop.Bf16EpFrontend(geometry, result.winner).check()
        print(f"EP autotune (loopback) {name}:", drop.ep_knob_dict(result.winner), f"{result.winner_ms:.3f} ms",
              f"{len(result.table)} candidates")  # fmt: skip
    assert results["decode"].winner.fc1_tile_n == results["mid"].winner.fc1_tile_n
    g = torch.Generator().manual_seed(21)
    for tokens in ([100, 256], [512, 300]):  # decode, then mid (global T 356 / 812)
        inputs = _rank_inputs(cfg, g, tokens)
        outs = _forward(layers, streams, inputs)
        for layer in layers:
            layer.check_transport()
        _assert_matches_reference(inputs, outs, w13, w2)
    real = ep_tuning.ep_context(torch.device("cuda"), EP_AUTO_WORLD, loopback=False)
    context = ep_tuning.ep_context(torch.device("cuda"), EP_AUTO_WORLD, loopback=True)
    for name, result in results.items():
        assert ep_tuning.cached_ep_knobs(geometry, context, name) == drop.ep_knob_dict(result.winner)
        assert ep_tuning.cached_ep_knobs(geometry, real, name) is None
    for layer in layers:
        layer.destroy()
    _, _, _, again, _ = _world(EP_AUTO_WORLD, max_tokens=EP_AUTO_MAX_TOKENS)  # knobs=None: the knob cache
    assert all(set(layer._backend.knob_sources.values()) == {"knob cache"} for layer in again)
    assert again[0]._backend.by_bucket["mid"].knobs == results["mid"].winner
    for layer in again:
        layer.destroy()


def test_ep_layer_refuses_unknown_knobs() -> None:
    """A knob value no mode names is refused by the config itself; a world-size-1 knob by the EP layer."""
    group = moe.make_loopback_group(2, "cuda")
    with pytest.raises(moe.MoEEpConfigError, match="knobs must be None, 'auto', a dict of knobs; got 'fast'"):
        _config("fast")
    cfg = _config({"num_sms": 64})
    w13, w2 = make_expert_weights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, device="cuda")
    with pytest.raises(moe.MoEEpConfigError, match="unknown EP knob"):
        moe.MoEEpLayer(
            moe.BootstrapConfig(world_size=2, rank=0, device="cuda", symmetric_memory="loopback", loopback_group=group),
            moe.FleetParams(cfg.num_experts, EP_MAX_TOKENS, cfg.hidden_size),
            moe.MoEWeightPack(w13[:8].contiguous(), w2[:8].contiguous()),
            backend=moe.MegaConfig(cfg),
        )


@pytest.mark.parametrize("world", [2, 4])
def test_graph_replays_with_other_live_token_counts(world: int) -> None:
    """Each rank captures one CUDA graph (capacity-row buffers, device-side live count) after an eager
    forward; replays with other uneven counts (zero-token ranks, full capacity) match the reference on
    the live rows, leave the other rows untouched, and equal an eager forward of the same inputs."""
    cfg, w13, w2, layers, streams = _world(world)
    cap, h, k = EP_MAX_TOKENS, cfg.hidden_size, cfg.top_k

    def buffers():
        return (torch.zeros(cap, h, dtype=torch.bfloat16, device="cuda"),
                torch.zeros(cap, k, dtype=torch.int32, device="cuda"),
                torch.zeros(cap, k, dtype=torch.float32, device="cuda"),
                torch.full((1,), cap, dtype=torch.int32, device="cuda"))  # fmt: skip

    bufs = [buffers() for _ in range(world)]
    static = [moe.MoEEpTensors(x, ids, w, num_tokens=live) for x, ids, w, live in bufs]
    outs = [torch.empty(cap, h, dtype=torch.bfloat16, device="cuda") for _ in range(world)]
    for r in range(world):  # eager, with the live count, on every rank before any capture
        with torch.cuda.stream(streams[r]):
            layers[r].forward(static[r], output=outs[r])
    torch.cuda.synchronize()
    for layer in layers:
        layer.check_transport()
    graphs = [torch.cuda.CUDAGraph() for _ in range(world)]
    for r in range(world):
        with torch.cuda.graph(graphs[r], stream=streams[r]):
            layers[r].forward(static[r], output=outs[r])
    g = torch.Generator().manual_seed(300 + world)
    cases = [[0] + [cap] * (world - 1), [(53 * (r + 1)) % cap + 1 for r in range(world)], [1] * world]
    for tokens in cases:
        inputs = _rank_inputs(cfg, g, tokens)
        for (x_buf, ids_buf, w_buf, live), (x, ids, w), out in zip(bufs, inputs, outs, strict=True):
            t = x.shape[0]
            x_buf.normal_()  # rows past the live count hold garbage that must not matter
            ids_buf.fill_(-1)
            x_buf[:t], ids_buf[:t], w_buf[:t] = x, ids, w
            live.fill_(t)
            out.fill_(float("nan"))
        torch.cuda.synchronize()
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        for layer in layers:
            layer.check_transport()
        for out, t in zip(outs, tokens, strict=True):
            assert bool(out[t:].isnan().all()), f"{tokens}: rows past the live count were written"
        live_rows = [out[:t] for out, t in zip(outs, tokens, strict=True)]
        assert not bool(torch.cat(live_rows).isnan().any()), f"{tokens}: live rows not written"
        _assert_matches_reference(inputs, live_rows, w13, w2)
        eager = _forward(layers, streams, inputs)  # eager between replays: same protocol state
        for layer in layers:
            layer.check_transport()
        assert all(torch.equal(a, b) for a, b in zip(eager, live_rows, strict=True)), f"{tokens}: eager != replay"
    del graphs
    for layer in layers:
        layer.destroy()


def test_layers_of_one_geometry_share_the_rank_state() -> None:
    """Two EP layers of one geometry on the same loopback ranks share each rank's EP state (symmetric
    arena, workspace, device epoch); a third with ``share_workspace=False`` has its own. Forwards of
    the three, interleaved, are each correct for their own weights; recovery reaches shared state."""
    group = moe.make_loopback_group(2, "cuda")
    worlds = [_world(2, group=group, seed=10 + i, share=share) for i, share in enumerate((True, True, False))]
    states = [[layer._backend.state for layer in w[3]] for w in worlds]
    for r in range(2):
        assert states[0][r] is states[1][r] and states[2][r] is not states[0][r]
    g = torch.Generator().manual_seed(11)
    for _ in range(2):
        for cfg, w13, w2, layers, streams in worlds:
            inputs = _rank_inputs(cfg, g, [37, 120])
            outs = _forward(layers, streams, inputs)
            for layer in layers:
                layer.check_transport()
            _assert_matches_reference(inputs, outs, w13, w2)
    for layer in worlds[0][3]:
        layer.destroy()
    cfg, w13, w2, layers, streams = worlds[1]
    inputs = _rank_inputs(cfg, g, [0, 64])
    _assert_matches_reference(inputs, _forward(layers, streams, inputs), w13, w2)
    for _cfg, _w13, _w2, layers, _streams in worlds[1:]:
        for layer in layers:
            layer.destroy()


def test_capture_before_warmup_is_refused() -> None:
    cfg, _, _, layers, _ = _world(2, warm=False)
    x, ids, w = _rank_inputs(cfg, torch.Generator().manual_seed(5), [9, 9])[0]
    with pytest.raises(moe.MoEEpConfigError, match="warmup"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layers[0].forward(moe.MoEEpTensors(x, ids, w), output=torch.empty_like(x))
    for layer in layers:
        layer.destroy()
