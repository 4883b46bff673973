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
from flashinfer.moe_ep.core.inputs import make_expert_weights, make_hidden_states, make_topk, relative_errors
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


@pytest.mark.parametrize("routing", ["uniform", "skewed", "one_expert"])
def test_reference_backend_over_nccl_matches_the_all_gather_oracle(runtime, routing: str) -> None:
    e, h, i, k = 8 * WORLD, 256, 128, 4
    seed = 1000 + len(routing)
    tokens = [(37 * (r + 1)) % 50 for r in range(WORLD)]
    tokens[-1] = 0  # a zero-token rank
    w13, w2, x, ids, w = _global_case(seed, tokens, e, h, i, k, routing)
    dev = runtime.device
    e_local = e // WORLD
    mine = slice(sum(tokens[:RANK]), sum(tokens[: RANK + 1]))
    experts = slice(RANK * e_local, (RANK + 1) * e_local)
    layer = moe.MoEEpLayer(
        moe.BootstrapConfig(world_size=WORLD, rank=RANK, device=dev, process_group=runtime.group),
        moe.FleetParams(e, 64, h),
        moe.MoEWeightPack(w13[experts].contiguous().to(dev), w2[experts].contiguous().to(dev)),
        backend=moe.MegaConfig(moe.ReferenceMegaMoeConfig(h, i, e, k)),
    )
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
