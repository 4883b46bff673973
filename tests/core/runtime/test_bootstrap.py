from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.core.runtime.bootstrap import (
    bootstrap_moe_ep_runtime,
    current_runtime,
    finalize_moe_ep_runtime,
    nvshmem_available,
)
from flashinfer.moe_ep.core.runtime.local_ranks import run_on_local_ranks


def test_world_one_outside_torchrun_is_refcounted(monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rt = bootstrap_moe_ep_runtime(moe.BootstrapConfig(device="cpu"), nvshmem=False)
    assert rt.owns_process_group and dist.is_initialized() and rt.refcount == 1
    assert bootstrap_moe_ep_runtime(moe.BootstrapConfig(device="cpu"), nvshmem=False) is rt
    with pytest.raises(moe.MoEEpConfigError, match="cannot bootstrap again"):
        bootstrap_moe_ep_runtime(moe.BootstrapConfig(world_size=2, rank=1, device="cpu"))
    assert not finalize_moe_ep_runtime()
    assert finalize_moe_ep_runtime() and current_runtime() is None and not dist.is_initialized()
    assert not finalize_moe_ep_runtime()


def test_world_two_without_a_group_says_what_to_do(monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(moe.MoEEpConfigError, match="torchrun"):
        bootstrap_moe_ep_runtime(moe.BootstrapConfig(world_size=2, rank=0, device="cpu"), nvshmem=False)
    assert current_runtime() is None


def test_nvshmem_requested_but_missing() -> None:
    if nvshmem_available():
        pytest.skip("nvshmem4py is installed here")
    with pytest.raises(moe.MoEEpConfigError, match="nvshmem4py is not installed"):
        bootstrap_moe_ep_runtime(moe.BootstrapConfig(device="cpu"), nvshmem=True)
    assert not dist.is_initialized()


def _rank(rank: int, world: int) -> tuple[int, int, bool]:
    rt = bootstrap_moe_ep_runtime(moe.BootstrapConfig(world_size=world, rank=rank, device="cpu"), nvshmem=False)
    out = (rt.rank, rt.world_size, rt.owns_process_group)
    assert finalize_moe_ep_runtime()
    assert dist.is_initialized()  # the caller's group is left alone
    return out


def test_existing_group_is_used_at_world_three() -> None:
    assert run_on_local_ranks(_rank, 3) == [(0, 3, False), (1, 3, False), (2, 3, False)]


@pytest.mark.gpu
def test_nvshmem_world_one_on_the_gpu(monkeypatch) -> None:
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh

    monkeypatch.delenv("RANK", raising=False)
    rt = bootstrap_moe_ep_runtime(moe.BootstrapConfig(device="cuda:0"), nvshmem=True)
    try:
        host = kh.SymBufferHost(
            comm.make_provider("nvshmem", 1, 0, rt.device), [kh.SymBufferSpec("x", (128,), "int32")]
        )
        host.buffers["x"].copy_(torch.arange(128, dtype=torch.int32, device="cuda"))
        assert host.peer_table("x").tolist() == [host.buffers["x"].data_ptr()]
        assert host.buffers["x"].sum().item() == 127 * 128 // 2
        host.release()
    finally:
        assert finalize_moe_ep_runtime()
