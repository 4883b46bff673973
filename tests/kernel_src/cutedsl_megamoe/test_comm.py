"""Symmetric buffers (device and loopback providers on the CPU), the workspace pool, the heap error."""

from __future__ import annotations

import pytest
import torch

from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm
from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh


def _specs():
    return [kh.SymBufferSpec("x", (7, 64), "bfloat16"), kh.SymBufferSpec("flags", (4,), "int32")]


def test_device_provider_world_one() -> None:
    host = kh.SymBufferHost(comm.make_provider("device", 1, 0, torch.device("cpu")), _specs())
    assert host.buffers["x"].shape == (7, 64) and host.buffers["flags"].dtype == torch.int32
    assert host.peer_table("flags").tolist() == [host.buffers["flags"].data_ptr()]
    assert (host.buffers["flags"].data_ptr() - host.arena.data_ptr()) % 256 == 0  # offsets inside the arena
    with pytest.raises(ValueError, match="world size 1 only"):
        comm.make_provider("device", 2, 0, torch.device("cpu"))


def test_loopback_tables_point_at_each_ranks_own_buffers() -> None:
    group = kh.LoopbackGroup(4, torch.device("cpu"))
    hosts = [kh.SymBufferHost(comm.make_provider("loopback", 4, r, group.device, group), _specs()) for r in range(4)]
    own = [h.buffers["x"].data_ptr() for h in hosts]
    for h in hosts:
        assert h.peer_table("x").tolist() == own  # every rank sees the same table
    # writing through a peer address lands in that rank's buffer
    hosts[2].buffers["flags"].fill_(7)
    assert hosts[0].peer_table("flags")[2].item() == hosts[2].buffers["flags"].data_ptr()


def test_loopback_needs_every_rank_allocated() -> None:
    group = kh.LoopbackGroup(2, torch.device("cpu"))
    first = kh.SymBufferHost(group.provider(0), _specs())
    with pytest.raises(RuntimeError, match="has not made allocation"):
        first.peer_table("x")


def test_workspace_pool_shares_and_refcounts() -> None:
    pool = comm.WorkspacePool()
    made = []
    a = pool.acquire("k", lambda: made.append(1) or object())
    b = pool.acquire("k", lambda: made.append(1) or object())
    assert a is b and made == [1] and pool.refcount("k") == 2
    freed = []
    assert not pool.release("k", freed.append)
    assert pool.release("k", freed.append) and freed == [a] and pool.refcount("k") == 0


def test_heap_error_states_formula_and_setting() -> None:
    msg = comm.heap_too_small_message(_specs(), 8, MemoryError("out of heap"))
    assert "NVSHMEM_SYMMETRIC_SIZE=" in msg and "x [7, 64] bfloat16: 896 bytes" in msg


def test_device_room_check_raises_on_every_rank_before_the_collective_allocation(monkeypatch, gloo_group) -> None:
    """``reserve_device_room``: the free GPU memory of every rank is all-reduced (MIN) before an NVSHMEM
    allocation, so a rank without room raises a MemoryError naming the shortfall instead of failing
    inside NVSHMEM; here on a one-rank gloo group with the free-memory query stubbed."""
    need = kh.arena_bytes(_specs()) + comm.HEAP_CHUNK
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need + 1, 1 << 40))
    comm.reserve_device_room(_specs(), torch.device("cpu"), gloo_group)  # fits
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need - (300 << 20), 1 << 40))
    with pytest.raises(MemoryError, match="lacks 300 MiB of free GPU memory"):
        comm.reserve_device_room(_specs(), torch.device("cpu"), gloo_group)
