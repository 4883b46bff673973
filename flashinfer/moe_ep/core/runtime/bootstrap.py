"""Process runtime for expert parallelism: torch.distributed, then NVSHMEM (nvshmem4py), refcounted.

``bootstrap_moe_ep_runtime(BootstrapConfig)`` brings up, in order:

1. torch.distributed: the given ``process_group``; else the default group if one is initialized; else
   a group from the torchrun environment (``RANK``/``WORLD_SIZE``; NCCL on GPU, gloo on CPU); else, for
   ``world_size == 1`` only, a private gloo group over a ``HashStore`` (no rendezvous, no ports).
2. NVSHMEM through nvshmem4py (when asked, or by default when the device is CUDA and nvshmem4py is
   importable): rank 0 of the EP group makes the unique id, its bytes are broadcast over the EP group,
   every rank calls ``nvshmem.core.init(..., initializer_method="uid")``.

Every call returns the one runtime of this process and takes a reference; ``finalize_moe_ep_runtime``
drops one, and the last one tears down (collectively: a barrier first, then NVSHMEM, then the
process group if this module created it). ``core`` never imports a kernel drop; nvshmem4py is
imported only here, lazily.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...config import BootstrapConfig
from ...errors import MoEEpConfigError, MoEEpTransportError


@dataclass
class MoEEpRuntime:
    world_size: int
    rank: int
    local_rank: int
    device: torch.device
    group: Any  # the EP process group
    nvshmem: bool
    owns_process_group: bool
    refcount: int = 0


_lock = threading.Lock()
_runtime: MoEEpRuntime | None = None


def nvshmem_available() -> bool:
    return importlib.util.find_spec("nvshmem") is not None


def current_runtime() -> MoEEpRuntime | None:
    return _runtime


def _init_process_group(cfg: BootstrapConfig, device: torch.device) -> tuple[Any, bool]:
    if cfg.process_group is not None:
        return cfg.process_group, False
    if dist.is_initialized():
        return dist.group.WORLD, False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        return dist.group.WORLD, True
    if cfg.world_size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return dist.group.WORLD, True
    raise MoEEpConfigError(
        f"world_size={cfg.world_size} needs a process group: run under torchrun, call "
        "torch.distributed.init_process_group first, or pass BootstrapConfig(process_group=...)"
    )


def _init_nvshmem(rt: MoEEpRuntime) -> None:
    import numpy as np
    import nvshmem.core as nvshmem
    from cuda.core import Device  # cuda-core: a dependency of nvshmem4py

    uid = nvshmem.get_unique_id(empty=rt.rank != 0)
    raw = uid._data.view(np.uint8)  # the id's bytes (nvshmem4py keeps them in a numpy array)
    buf = torch.from_numpy(raw.copy())
    if rt.world_size > 1:
        on = buf.to(rt.device) if dist.get_backend(rt.group) == "nccl" else buf
        dist.broadcast(on, src=dist.get_global_rank(rt.group, 0), group=rt.group)
        raw[:] = on.cpu().numpy()
    dev = Device(rt.device.index if rt.device.index is not None else rt.local_rank)
    dev.set_current()
    nvshmem.init(device=dev, uid=uid, rank=rt.rank, nranks=rt.world_size, initializer_method="uid")


def bootstrap_moe_ep_runtime(cfg: BootstrapConfig, *, nvshmem: bool | None = None) -> MoEEpRuntime:
    """Bring up (or take another reference on) this process's EP runtime; see the module docstring."""
    global _runtime
    device = cfg.resolved_device()
    with _lock:
        if _runtime is not None:
            if (_runtime.world_size, _runtime.rank) != (cfg.world_size, cfg.rank):
                raise MoEEpConfigError(
                    f"this process already runs the EP runtime as rank {_runtime.rank} of {_runtime.world_size}; "
                    f"cannot bootstrap again as rank {cfg.rank} of {cfg.world_size}"
                )
            _runtime.refcount += 1
            return _runtime
        want_nvshmem = nvshmem if nvshmem is not None else (device.type == "cuda" and nvshmem_available())
        if want_nvshmem and not nvshmem_available():
            raise MoEEpConfigError(
                "NVSHMEM was asked for but nvshmem4py is not installed (pip install nvshmem4py-cu13)"
            )
        group, owns = _init_process_group(cfg, device)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (cfg.world_size, cfg.rank):
            if owns:
                dist.destroy_process_group()
            raise MoEEpConfigError(
                f"BootstrapConfig says rank {cfg.rank} of {cfg.world_size}, the process group is rank {rank} of {size}"
            )
        local_rank = cfg.local_rank if cfg.local_rank is not None else int(os.environ.get("LOCAL_RANK", 0))
        rt = MoEEpRuntime(cfg.world_size, cfg.rank, local_rank, device, group, want_nvshmem, owns, refcount=1)
        if want_nvshmem:
            try:
                _init_nvshmem(rt)
            except Exception as exc:
                if owns:
                    dist.destroy_process_group()
                raise MoEEpTransportError(f"NVSHMEM initialization failed on rank {rt.rank}: {exc}") from exc
        _runtime = rt
        return rt


def finalize_moe_ep_runtime() -> bool:
    """Drop one reference; the last one tears the runtime down (collective). Returns True if it did."""
    global _runtime
    with _lock:
        rt = _runtime
        if rt is None:
            return False
        rt.refcount -= 1
        if rt.refcount > 0:
            return False
        if rt.world_size > 1:
            dist.barrier(group=rt.group)
        if rt.nvshmem:
            import nvshmem.core as nvshmem

            nvshmem.finalize()
        if rt.owns_process_group:
            dist.destroy_process_group()
        _runtime = None
        return True


__all__ = [
    "MoEEpRuntime",
    "bootstrap_moe_ep_runtime",
    "current_runtime",
    "finalize_moe_ep_runtime",
    "nvshmem_available",
]
