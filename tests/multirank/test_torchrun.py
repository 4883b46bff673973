"""Multi-rank tests, one process per GPU: ``torchrun --nproc_per_node=N -m pytest -q tests/multirank``.

Skipped (with the reason) outside torchrun or with fewer GPUs than ranks. Without CUDA the ranks run on
the CPU over gloo (NVSHMEM tests skip), which checks the protocol anywhere. Every rank runs every test
in the same order (collectives inside), so a failure on one rank shows up on all of them.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.core.baselines import split_ep_moe
from flashinfer.moe_ep.core.inputs import (
    make_expert_weights,
    make_hidden_states,
    make_topk,
    relative_errors,
    rounding_ulps,
)
from flashinfer.moe_ep.core.reference import moe_reference

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))


def _skip_reason() -> str | None:
    if "RANK" not in os.environ or WORLD < 2:
        return "multi-rank tests run under torchrun --nproc_per_node=N (N >= 2)"
    if torch.cuda.is_available() and torch.cuda.device_count() < WORLD:
        return f"needs {WORLD} GPUs, found {torch.cuda.device_count()}"
    return None


DEVICE = f"cuda:{LOCAL_RANK}" if torch.cuda.is_available() else "cpu"


pytestmark = [pytest.mark.multigpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]


@pytest.fixture(scope="module")
def runtime():
    from flashinfer.moe_ep.core.runtime.bootstrap import bootstrap_moe_ep_runtime, finalize_moe_ep_runtime

    if DEVICE != "cpu":
        torch.cuda.set_device(LOCAL_RANK)
    rt = bootstrap_moe_ep_runtime(moe.BootstrapConfig(world_size=WORLD, rank=RANK, device=DEVICE))
    yield rt
    finalize_moe_ep_runtime()


def _global_case(seed: int, tokens_per_rank: list[int], e: int, h: int, i: int, k: int, routing: str):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = make_expert_weights(e, h, i, generator=g)
    t = sum(tokens_per_rank)
    x = make_hidden_states(t, h, generator=g)
    ids, w = make_topk(t, e, k, routing=routing, generator=g)
    return w13, w2, x, ids, w


def _mine(tokens: list[int]) -> slice:
    """This rank's rows of the concatenated global inputs."""
    return slice(sum(tokens[:RANK]), sum(tokens[: RANK + 1]))


def _my_experts(num_experts: int) -> slice:
    """This rank's experts of the global weights."""
    e_local = num_experts // WORLD
    return slice(RANK * e_local, (RANK + 1) * e_local)


def _rank_layer(runtime, config, w13, w2, max_tokens: int, **kwargs):
    """This rank's layer of ``config`` (its E / WORLD experts of the global ``w13``/``w2``)."""
    experts = _my_experts(config.num_experts)
    dev = runtime.device
    return moe.MoEEpLayer(
        moe.BootstrapConfig(world_size=WORLD, rank=RANK, device=dev, process_group=runtime.group),
        moe.FleetParams(config.num_experts, max_tokens, config.hidden_size),
        moe.MoEWeightPack(w13[experts].contiguous().to(dev), w2[experts].contiguous().to(dev)),
        backend=moe.MegaConfig(config),
        **kwargs,
    )


@pytest.mark.parametrize("routing", ["uniform", "skewed", "one_expert"])
def test_reference_backend_over_nccl_matches_the_all_gather_oracle(runtime, routing: str) -> None:
    e, h, i, k = 8 * WORLD, 256, 128, 4
    seed = 1000 + len(routing)
    tokens = [(37 * (r + 1)) % 50 for r in range(WORLD)]
    tokens[-1] = 0  # a zero-token rank
    w13, w2, x, ids, w = _global_case(seed, tokens, e, h, i, k, routing)
    dev = runtime.device
    mine = _mine(tokens)
    layer = _rank_layer(runtime, moe.ReferenceMegaMoeConfig(h, i, e, k), w13, w2, 64)
    out = layer.forward(moe.MoEEpTensors(x[mine].to(dev), ids[mine].to(dev), w[mine].to(dev)))
    # all-gather oracle: every rank's output gathered, compared with the single-process reference
    cap = max(tokens)  # all_gather needs equal sizes: pad every rank's output to the largest T
    padded = torch.zeros(cap, h, dtype=torch.bfloat16, device=dev)
    padded[: out.shape[0]] = out
    outs = [torch.empty_like(padded) for _ in range(WORLD)]
    dist.all_gather(outs, padded, group=runtime.group)
    got = torch.cat([o[:n] for o, n in zip(outs, tokens, strict=True)]).cpu()
    want = moe_reference(x, ids, w, w13, w2)
    mean_err, max_err = relative_errors(got, want)
    assert mean_err < 1e-3 and max_err < 2e-2, (mean_err, max_err)
    layer.destroy()


def _gather_rows(out: torch.Tensor, tokens: list[int], group) -> torch.Tensor:
    """Every rank's [T_r, H] output, concatenated in rank order (padded for all_gather)."""
    cap = max(max(tokens), 1)
    padded = torch.zeros(cap, out.shape[1], dtype=out.dtype, device=out.device)
    padded[: out.shape[0]] = out
    outs = [torch.empty_like(padded) for _ in range(WORLD)]
    dist.all_gather(outs, padded, group=group)
    return torch.cat([o[:n] for o, n in zip(outs, tokens, strict=True)]).cpu()


def test_split_ep_baseline_matches_the_reference(runtime) -> None:
    """The EP benchmark's baseline (all_to_all_single dispatch, grouped_mm, all_to_all_single combine)."""
    e, h, i, k = 4 * WORLD, 256, 128, 4
    tokens = [(29 * (r + 2)) % 40 for r in range(WORLD)]
    tokens[0] = 0  # a zero-token rank
    w13, w2, x, ids, w = _global_case(77, tokens, e, h, i, k, "skewed")
    dev = runtime.device
    mine, experts = _mine(tokens), _my_experts(e)
    out = split_ep_moe(x[mine].to(dev), ids[mine].to(dev), w[mine].to(dev),
                       w13[experts].to(dev).transpose(1, 2), w2[experts].to(dev).transpose(1, 2),
                       group=runtime.group)  # fmt: skip
    got = _gather_rows(out, tokens, runtime.group)
    mean_err, _ = relative_errors(got, moe_reference(x, ids, w, w13, w2))
    assert mean_err < 1e-2, mean_err


#: the SM90 expert-parallel layer under torchrun (one process per GPU, NVSHMEM); its kernels are
#: prebuilt by ``scripts/gpu_session.py build`` for world sizes 2, 4 and 8 (the GPU machine cannot compile)
SM90_EP_GEOMETRY = {"hidden_size": 256, "intermediate_size": 128, "experts_per_rank": 4, "top_k": 4}
SM90_EP_WORLDS = (2, 4, 8)
SM90_EP_MAX_TOKENS = 64


def _sm90_ep_skip_reason(runtime) -> str | None:
    if DEVICE == "cpu":
        return "the SM90 expert-parallel kernel needs CUDA GPUs"
    if torch.cuda.get_device_capability(LOCAL_RANK) != (9, 0):
        return "needs SM90 (Hopper) GPUs"
    if not runtime.nvshmem:
        return "needs nvshmem4py (the symmetric heap across processes)"
    return None


@pytest.mark.parametrize("routing, dispatch", [("uniform", "pull"), ("skewed", "pull"), ("skewed", "push")])
def test_sm90_ep_layer_over_nvshmem_matches_the_all_gather_oracle(runtime, routing: str, dispatch: str) -> None:
    """Uneven T with a zero-token rank; every rank's output against the single-process reference;
    repeat runs bitwise equal, also with rank 0 launching late. Both dispatches (owners pull the rows,
    or sources push them)."""
    reason = _sm90_ep_skip_reason(runtime)
    if reason:
        pytest.skip(reason)
    g = SM90_EP_GEOMETRY
    h, i, k = g["hidden_size"], g["intermediate_size"], g["top_k"]
    e = g["experts_per_rank"] * WORLD
    tokens = [(37 * (r + 3)) % SM90_EP_MAX_TOKENS + 1 for r in range(WORLD)]
    tokens[-1] = 0
    w13, w2, x, ids, w = _global_case(2000 + len(routing), tokens, e, h, i, k, routing)
    dev = runtime.device
    mine = _mine(tokens)
    cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(h, i, e, k, knobs={"dispatch": dispatch})
    layer = _rank_layer(runtime, cfg, w13, w2, SM90_EP_MAX_TOKENS, check_values=False)
    layer.warmup()
    inputs = moe.MoEEpTensors(x[mine].to(dev), ids[mine].to(dev), w[mine].to(dev))
    out = torch.full((tokens[RANK], h), float("nan"), dtype=torch.bfloat16, device=dev)
    dist.barrier(group=runtime.group)
    layer.forward(inputs, output=out)
    layer.check_transport()
    got = _gather_rows(out, tokens, runtime.group)
    want, scale = moe_reference(x, ids, w, w13, w2, return_term_scale=True)
    assert not bool(got.isnan().any())
    mean_err, _ = relative_errors(got, want)
    assert mean_err < 1e-2 and rounding_ulps(got, want, scale) <= 4.0, mean_err
    for run in range(5):  # repeat, rank 0 late on the odd runs
        again = torch.full_like(out, float("nan"))
        dist.barrier(group=runtime.group)
        if RANK == 0 and run % 2:
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU cycles before this rank's kernels
        layer.forward(inputs, output=again)
        layer.check_transport()
        assert torch.equal(again, out), f"run {run} differs on rank {RANK}"
    dist.barrier(group=runtime.group)
    layer.destroy()


@pytest.mark.parametrize("routing, dispatch", [("uniform", "pull"), ("uniform", "push")])
def test_sm90_ep_layer_graph_replays_with_other_live_token_counts(runtime, routing: str, dispatch: str) -> None:
    """One CUDA graph per rank, captured with capacity-row buffers and a device-side live count
    (``MoEEpTensors.num_tokens``), replayed with other uneven counts (a zero-token rank included):
    the live rows match the oracle, the rows past the live count stay untouched, eager still works."""
    reason = _sm90_ep_skip_reason(runtime)
    if reason:
        pytest.skip(reason)
    g = SM90_EP_GEOMETRY
    h, i, k, cap = g["hidden_size"], g["intermediate_size"], g["top_k"], SM90_EP_MAX_TOKENS
    e = g["experts_per_rank"] * WORLD
    dev = runtime.device
    w13, w2, _, _, _ = _global_case(3000, [1] * WORLD, e, h, i, k, routing)
    cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(h, i, e, k, knobs={"dispatch": dispatch})
    layer = _rank_layer(runtime, cfg, w13, w2, cap, check_values=False)
    layer.warmup()
    x_buf = torch.zeros(cap, h, dtype=torch.bfloat16, device=dev)
    ids_buf = torch.zeros(cap, k, dtype=torch.int32, device=dev)
    w_buf = torch.zeros(cap, k, dtype=torch.float32, device=dev)
    live = torch.full((1,), cap, dtype=torch.int32, device=dev)
    out = torch.empty(cap, h, dtype=torch.bfloat16, device=dev)
    static = moe.MoEEpTensors(x_buf, ids_buf, w_buf, num_tokens=live)
    dist.barrier(group=runtime.group)
    layer.forward(static, output=out)  # eager with the live count: every rank, before the capture
    layer.check_transport()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        layer.forward(static, output=out)  # captured: no rank runs anything here
    torch.cuda.synchronize()
    for case, seed in enumerate((3100, 3200, 3300)):
        tokens = [(11 * (r + 1) + 17 * case) % (cap + 1) for r in range(WORLD)]
        tokens[case % WORLD] = 0
        _, _, x, ids, w = _global_case(seed, tokens, e, h, i, k, routing)
        mine = _mine(tokens)
        t = tokens[RANK]
        x_buf.normal_()  # garbage past the live rows: it must not matter
        ids_buf.fill_(-1)
        x_buf[:t], ids_buf[:t], w_buf[:t] = x[mine].to(dev), ids[mine].to(dev), w[mine].to(dev)
        live.fill_(t)
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        dist.barrier(group=runtime.group)
        graph.replay()
        layer.check_transport()
        assert bool(out[t:].isnan().all()), f"case {case}: rows past the live count were written"
        got = _gather_rows(out[:t], tokens, runtime.group)
        want, scale = moe_reference(x, ids, w, w13, w2, return_term_scale=True)
        assert not bool(got.isnan().any()), f"case {case}: live rows not written"
        mean_err, _ = relative_errors(got, want)
        assert mean_err < 1e-2 and rounding_ulps(got, want, scale) <= 4.0, (case, mean_err)
    replayed = out[:t].clone()
    dist.barrier(group=runtime.group)
    eager = layer.forward(moe.MoEEpTensors(x[mine].to(dev), ids[mine].to(dev), w[mine].to(dev)))
    layer.check_transport()
    assert torch.equal(eager, replayed), "eager after the replays differs from the last replay"
    dist.barrier(group=runtime.group)
    del graph
    layer.destroy()


def test_sm90_ep_layer_knobs_auto_over_nvshmem(runtime, tmp_path) -> None:
    """``knobs="auto"``: every rank's warmup tunes in lockstep; all ranks apply the same winner, the
    tuned layer matches the oracle, and rank 0 recorded the winner under this world size."""
    reason = _sm90_ep_skip_reason(runtime)
    if reason:
        pytest.skip(reason)
    from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import ep_tuning
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

    os.environ["FLASHINFER_MOE_EP_KNOB_CACHE"] = str(tmp_path / f"knobs-{RANK}.json")
    g = SM90_EP_GEOMETRY
    h, i, k = g["hidden_size"], g["intermediate_size"], g["top_k"]
    e = g["experts_per_rank"] * WORLD
    tokens = [(23 * (r + 1)) % SM90_EP_MAX_TOKENS + 1 for r in range(WORLD)]
    w13, w2, x, ids, w = _global_case(4000, tokens, e, h, i, k, "uniform")
    dev = runtime.device
    mine = _mine(tokens)
    cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(h, i, e, k, knobs="auto")
    layer = _rank_layer(runtime, cfg, w13, w2, SM90_EP_MAX_TOKENS, check_values=False)
    layer.warmup()  # collective: the autotune
    assert sorted(layer._backend.tune_results) == sorted(b.name for b in layer._backend.buckets)
    winner = {name: drop.ep_knob_dict(fe.knobs) for name, fe in layer._backend.by_bucket.items()}
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, winner, group=runtime.group)
    assert all(gw == winner for gw in gathered), "ranks applied different winners"
    dist.barrier(group=runtime.group)
    out = layer.forward(moe.MoEEpTensors(x[mine].to(dev), ids[mine].to(dev), w[mine].to(dev)))
    layer.check_transport()
    got = _gather_rows(out, tokens, runtime.group)
    want, scale = moe_reference(x, ids, w, w13, w2, return_term_scale=True)
    assert relative_errors(got, want)[0] < 1e-2 and rounding_ulps(got, want, scale) <= 4.0
    if RANK == 0:
        context = ep_tuning.ep_context(torch.device(dev), WORLD, loopback=False)
        for name, fe in layer._backend.by_bucket.items():
            assert ep_tuning.cached_ep_knobs(fe.geometry, context, name) == drop.ep_knob_dict(fe.knobs)
    dist.barrier(group=runtime.group)
    layer.destroy()
    del os.environ["FLASHINFER_MOE_EP_KNOB_CACHE"]


def test_nvshmem_symmetric_buffers_reach_every_peer(runtime) -> None:
    if not runtime.nvshmem:
        pytest.skip("nvshmem4py not installed on this machine")
    import nvshmem.core as nvshmem

    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh

    spec = [kh.SymBufferSpec("flags", (WORLD, 64), "int32")]
    host = kh.SymBufferHost(comm.make_provider("nvshmem", WORLD, RANK, runtime.device), spec)
    host.buffers["flags"].fill_(RANK + 1)
    torch.cuda.synchronize()
    dist.barrier(group=runtime.group)
    table = host.peer_table("flags").tolist()
    assert table[RANK] == host.buffers["flags"].data_ptr()
    for peer in range(WORLD):
        peer_view = nvshmem.get_peer_tensor(host.arena, peer)  # a torch view of the peer's arena
        assert peer_view.data_ptr() == table[peer] - 0  # the flags buffer starts the arena
        got = peer_view[: 4 * WORLD * 64].view(torch.int32)
        assert bool((got == peer + 1).all()), f"rank {RANK} read rank {peer}'s buffer wrong"
    dist.barrier(group=runtime.group)
    host.release()
