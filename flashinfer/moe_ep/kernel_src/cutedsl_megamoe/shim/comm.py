"""Communication plumbing: symmetric-buffer providers and the shared workspace pool.

Providers (from ``src/src/symm_buffers.py``): ``device`` (world size 1), ``nvshmem`` (one PE per GPU,
NVSHMEM initialized by ``core.runtime.bootstrap``), ``loopback`` (R logical ranks in one process).

Workspace pool: layers with one geometry (same kernel key and capacity, same device and provider)
share one workspace, refcounted, so a 60-layer model pays for one workspace, not 60. Sharing is safe
because the layers of one model run one after another on one stream; two layers that may run
concurrently must not share (``MegaKernelConfig(share_workspace=False)`` keeps a layer private).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

from . import kernel_helpers as kh

HEAP_ENV = "NVSHMEM_SYMMETRIC_SIZE"


def make_provider(kind: str, world_size: int, rank: int, device: torch.device, loopback: Any = None) -> Any:
    if kind == "device":
        if world_size != 1:
            raise ValueError("the plain device-memory provider serves world size 1 only")
        return kh.DeviceMemoryProvider(device)
    if kind == "nvshmem":
        return kh.NvshmemProvider(world_size, rank, device)
    if kind == "loopback":
        if loopback is None:
            raise ValueError("the loopback provider needs its LoopbackGroup")
        return loopback.provider(rank)
    raise ValueError(f"unknown symmetric-buffer provider {kind!r} (device, nvshmem, loopback)")


def heap_too_small_message(specs: list[Any], world_size: int, err: BaseException) -> str:
    """The error text when the symmetric heap cannot hold a workspace: the formula and what to set."""
    need = kh.arena_bytes(specs)
    lines = [f"the NVSHMEM symmetric heap cannot hold this layer's workspace ({need / 2**20:.1f} MiB per rank): {err}"]
    lines.append("workspace = sum over buffers of round_up(bytes, 256):")
    lines += [f"  {s.name} {list(s.shape)} {s.dtype}: {s.nbytes} bytes" for s in specs]
    suggest = int(need * 1.25) + (64 << 20)
    lines.append(f"set {HEAP_ENV}={suggest // 2**20}M (or larger) in every rank's environment before starting")
    return "\n".join(lines)


#: NVSHMEM grows its heap in chunks of physical memory (``NVSHMEM_CUMEM_GRANULARITY``, 512 MiB by default)
HEAP_CHUNK = 512 << 20


def all_reduce_int(value: int, op: Any, group: Any, device: torch.device) -> int:
    """``value`` reduced over the ranks of ``group`` with ``op`` (a ``torch.distributed.ReduceOp``):
    through ``device`` on NCCL, through the CPU otherwise (gloo)."""
    import torch.distributed as dist

    on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    box = torch.tensor([value], dtype=torch.int64, device=on)
    dist.all_reduce(box, op=op, group=group)
    return int(box.item())


def reserve_device_room(specs: list[Any], device: torch.device, group: Any, local_bytes: int = 0) -> None:
    """Before a collective NVSHMEM allocation of ``specs``: the heap maps physical GPU memory at
    allocation time, outside torch's caching allocator, so release torch's cached blocks and check on
    every rank of ``group`` (an all-reduce MIN) that the arena fits. A rank without room then raises
    MemoryError on every rank, instead of one rank failing inside NVSHMEM (seen on two H200s:
    ``cuMemCreate failed``, then an illegal memory access in NVSHMEM's barrier). ``local_bytes``: the
    rank's other allocations that come with it (its local workspace)."""
    import torch.distributed as dist

    need = kh.arena_bytes(specs) + HEAP_CHUNK + local_bytes  # + the heap chunk the allocation may open
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    short = -all_reduce_int(free - need, dist.ReduceOp.MIN, group, device)
    if short > 0:
        raise MemoryError(
            f"a rank lacks {short / 2**20:.0f} MiB of free GPU memory for the symmetric workspace "
            f"({kh.arena_bytes(specs) / 2**20:.1f} MiB per rank, one {HEAP_CHUNK >> 20} MiB heap chunk and "
            f"{local_bytes / 2**20:.1f} MiB of local workspace): "
            "free memory on every rank (fewer token buckets or max_tokens_per_rank, other allocations) first"
        )


class WorkspacePool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[Hashable, list[Any]] = {}  # key -> [object, refcount]

    def acquire(self, key: Hashable, factory: Callable[[], Any]) -> Any:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                item = self._items[key] = [factory(), 0]
            item[1] += 1
            return item[0]

    def release(self, key: Hashable, finalizer: Callable[[Any], None] | None = None) -> bool:
        """Drop one reference; returns True when the last one released the workspace."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return False
            item[1] -= 1
            if item[1] > 0:
                return False
            del self._items[key]
        if finalizer is not None:
            finalizer(item[0])
        return True

    def refcount(self, key: Hashable) -> int:
        item = self._items.get(key)
        return 0 if item is None else item[1]


#: the process-wide pool used by the backends
WORKSPACES = WorkspacePool()

__all__ = ["HEAP_ENV", "WORKSPACES", "WorkspacePool", "heap_too_small_message", "make_provider"]
