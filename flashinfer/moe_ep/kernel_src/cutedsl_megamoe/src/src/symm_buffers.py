"""Symmetric buffers: one allocation per rank, plus the table of every rank's address of it.

Kernels read tokens and write results through a pointer table (one entry per rank) passed by value,
so the same kernel serves world size 1 (one entry), many GPUs (NVSHMEM), and R logical ranks inside
one process on one GPU (loopback, for testing the cross-rank protocol on a single device).

Providers allocate collectively in the same order on every rank (as NVSHMEM requires), which is what
lets the loopback provider pair up "the same" allocation across its logical ranks.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

ALIGN = 256  # bytes; every buffer in an arena starts on this boundary (TMA needs 16, 128 for swizzle)

_DTYPES = {"int32": torch.int32, "int64": torch.int64, "bfloat16": torch.bfloat16, "float32": torch.float32,
           "uint8": torch.uint8}  # fmt: skip


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class SymBufferSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = _DTYPES[self.dtype].itemsize
        for s in self.shape:
            n *= s
        return n


def arena_bytes(specs: list[SymBufferSpec]) -> int:
    """Bytes of one rank's symmetric arena for ``specs`` (each buffer aligned to ``ALIGN``)."""
    return sum(_round_up(max(s.nbytes, 1), ALIGN) for s in specs)


class SymmetricProvider(abc.ABC):
    """Allocates this rank's copy of a symmetric allocation and knows every peer's address of it."""

    kind: str = ""

    def __init__(self, world_size: int, rank: int, device: torch.device) -> None:
        self.world_size, self.rank, self.device = world_size, rank, device

    @abc.abstractmethod
    def allocate(self, nbytes: int) -> torch.Tensor:
        """Collective: this rank's uint8 copy of a new symmetric allocation."""

    @abc.abstractmethod
    def peer_addresses(self, local: torch.Tensor) -> list[int]:
        """Device addresses of every rank's copy of ``local``, usable from this rank's kernels."""

    def free(self, local: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Collective: release an allocation."""


class DeviceMemoryProvider(SymmetricProvider):
    """World size 1: plain device memory."""

    kind = "device"

    def __init__(self, device: torch.device) -> None:
        super().__init__(1, 0, device)

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def peer_addresses(self, local: torch.Tensor) -> list[int]:
        return [local.data_ptr()]


class NvshmemProvider(SymmetricProvider):
    """Multi-process, one PE per GPU: allocations on the NVSHMEM symmetric heap (NVSHMEM initialized)."""

    kind = "nvshmem"

    def allocate(self, nbytes: int) -> torch.Tensor:
        import nvshmem.core as nvshmem

        return nvshmem.tensor((nbytes,), dtype=torch.uint8)

    def peer_addresses(self, local: torch.Tensor) -> list[int]:
        import nvshmem.core as nvshmem

        return [nvshmem.get_peer_tensor(local, pe).data_ptr() for pe in range(self.world_size)]

    def free(self, local: torch.Tensor) -> None:
        import nvshmem.core as nvshmem

        nvshmem.free_tensor(local)


class LoopbackGroup:
    """R logical ranks in one process on one GPU, each with its own allocations.

    ``provider(r)`` is rank r's provider. Allocation number i of every rank forms one symmetric
    allocation; a peer address is resolvable once every rank has made its i-th allocation.
    """

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size, self.device = world_size, device
        self._allocs: list[list[torch.Tensor]] = [[] for _ in range(world_size)]

    def provider(self, rank: int) -> LoopbackProvider:
        return LoopbackProvider(self, rank)


class LoopbackProvider(SymmetricProvider):
    kind = "loopback"

    def __init__(self, group: LoopbackGroup, rank: int) -> None:
        super().__init__(group.world_size, rank, group.device)
        self.group = group

    def allocate(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.group._allocs[self.rank].append(t)
        return t

    def peer_addresses(self, local: torch.Tensor) -> list[int]:
        mine = self.group._allocs[self.rank]
        index = next((i for i, t in enumerate(mine) if t.data_ptr() == local.data_ptr()), None)
        if index is None:
            raise ValueError("not an allocation of this loopback rank")
        out = []
        for peer in range(self.world_size):
            theirs = self.group._allocs[peer]
            if index >= len(theirs):
                raise RuntimeError(
                    f"loopback rank {peer} has not made allocation #{index} yet (allocate on every rank first)"
                )
            if theirs[index].numel() != local.numel():
                raise RuntimeError(f"loopback allocation #{index} differs in size between ranks {self.rank} and {peer}")
            out.append(theirs[index].data_ptr())
        return out


class SymBufferHost:
    """One rank's symmetric workspace: named buffers carved from one arena, and their pointer tables.

    ``buffers[name]`` is this rank's tensor; ``peer_table(name)`` is an int64 device tensor [R] of
    every rank's address of that buffer (entry ``rank`` is this rank's own).
    """

    def __init__(self, provider: SymmetricProvider, specs: list[SymBufferSpec]) -> None:
        self.provider = provider
        self.specs = list(specs)
        self.arena = provider.allocate(arena_bytes(self.specs))
        self.buffers: dict[str, torch.Tensor] = {}
        self._offsets: dict[str, int] = {}
        offset = 0
        for s in self.specs:
            self._offsets[s.name] = offset
            view = self.arena[offset : offset + s.nbytes].view(_DTYPES[s.dtype]).view(s.shape)
            self.buffers[s.name] = view
            offset += _round_up(max(s.nbytes, 1), ALIGN)
        self._tables: dict[str, torch.Tensor] = {}

    def peer_table(self, name: str) -> torch.Tensor:
        if name not in self._tables:
            bases = self.provider.peer_addresses(self.arena)
            addrs = [b + self._offsets[name] for b in bases]
            self._tables[name] = torch.tensor(addrs, dtype=torch.int64, device=self.provider.device)
        return self._tables[name]

    def release(self) -> None:
        self.buffers.clear()
        self._tables.clear()
        self.provider.free(self.arena)


__all__ = [
    "ALIGN",
    "DeviceMemoryProvider",
    "LoopbackGroup",
    "LoopbackProvider",
    "NvshmemProvider",
    "SymBufferHost",
    "SymBufferSpec",
    "SymmetricProvider",
    "arena_bytes",
]
