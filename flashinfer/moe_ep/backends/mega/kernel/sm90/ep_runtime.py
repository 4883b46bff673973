"""What the SM90 expert-parallel backends share (BF16: ``bf16_bf16_bf16_cutedsl/ep_backend.py``,
MXFP8 / NVFP4: ``block_scaled_ep.py``): the rank's symmetric-buffer provider (loopback group or
NVSHMEM), its EP state from the refcounted pool, the launch of one forward through that state, and
the transport errors and their recovery (docs/ep.md).

A backend using ``EpRankRuntime`` sets ``mode`` (``"loopback"`` or ``"nvshmem"``), ``frontend`` (the
frontend whose buffers size the state) and ``distinct_frontends()`` (every kernel sharing it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .....config import MoEEpTensors
from .....errors import MoEEpConfigError, MoEEpTransportError
from .runtime import load_kernel, pool_owner

#: pooled state key without the rank -> {rank: EpRankState} (loopback): how one logical rank's
#: recovery sees the epochs of the other ranks of its workspace
LOOPBACK_STATES: dict[tuple, dict[int, Any]] = {}


def make_loopback_group(world_size: int, device: torch.device | str) -> Any:
    """A group of ``world_size`` logical ranks in this process on ``device`` (BootstrapConfig.loopback_group)."""
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh

    return kh.LoopbackGroup(world_size, torch.device(device))


class EpRankRuntime:
    """Mixin of the SM90 EP backends (see the module docstring)."""

    device_live_tokens = True
    mode: str
    frontend: Any
    state: Any = None
    _pool_key: tuple | None = None

    def distinct_frontends(self) -> list[Any]:
        raise NotImplementedError

    @property
    def ranks_per_gpu(self) -> int:
        return self.bootstrap.world_size if self.mode == "loopback" else 1  # type: ignore[attr-defined]

    def ep_group(self) -> Any:
        """The EP process group over NVSHMEM (None with loopback ranks or before the bootstrap)."""
        from flashinfer.moe_ep.core.runtime.bootstrap import current_runtime

        rt = current_runtime()
        return rt.group if self.mode == "nvshmem" and rt is not None else None

    def make_provider(self) -> Any:
        """This rank's symmetric-buffer provider (loopback group, or NVSHMEM after the bootstrap)."""
        from flashinfer.moe_ep.core.runtime.bootstrap import current_runtime
        from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm

        b = self.bootstrap  # type: ignore[attr-defined]
        if self.mode == "loopback":
            return comm.make_provider("loopback", b.world_size, b.rank, self.device, b.loopback_group)  # type: ignore[attr-defined]
        rt = current_runtime()
        if rt is None or not rt.nvshmem:
            raise MoEEpConfigError(
                "world_size > 1 with NVSHMEM needs bootstrap_moe_ep_runtime(BootstrapConfig(...)) first "
                "(or symmetric_memory='loopback' for R ranks on one GPU)"
            )
        return comm.make_provider("nvshmem", b.world_size, b.rank, self.device)  # type: ignore[attr-defined]

    def _peers_key(self) -> tuple:
        """Pool key of the rank's EP state, less the rank: same kernels, capacity, device, EP group."""
        b = self.bootstrap  # type: ignore[attr-defined]
        group = ("loopback", id(b.loopback_group)) if self.mode == "loopback" else ("nvshmem",)
        kernels = tuple(fe.key.digest() for fe in self.distinct_frontends())
        return ("ep", kernels, self.fleet.max_tokens_per_rank, str(self.device), group, pool_owner(self))  # type: ignore[attr-defined]

    def allocate_workspace(self) -> None:
        """The rank's EP state from the pool (a collective allocation the first time: every rank
        builds its layers in the same order, so they share, or allocate, in step)."""
        from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import EpRankState, comm

        rank = self.bootstrap.rank  # type: ignore[attr-defined]
        key = (*self._peers_key(), rank)
        device, capacity = self.device, self.fleet.max_tokens_per_rank  # type: ignore[attr-defined]

        def make() -> Any:
            others = tuple(fe for fe in self.distinct_frontends() if fe is not self.frontend)
            with torch.cuda.device(device):
                return EpRankState(self.frontend, self.make_provider(), rank, capacity, device, others, self.ep_group())

        try:
            self.state = comm.WORKSPACES.acquire(key, make)
        except MemoryError as exc:
            raise MoEEpConfigError(str(exc)) from None
        self._pool_key = key
        if self.mode == "loopback":
            LOOPBACK_STATES.setdefault(self._peers_key(), {})[rank] = self.state

    def release_state(self) -> None:
        """Give the rank's EP state back to the pool (the last layer using it frees it)."""
        if self.state is None:
            return
        from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm

        last = comm.WORKSPACES.release(self._pool_key, lambda state: state.release())
        if last and self.mode == "loopback":
            peers = LOOPBACK_STATES.get(self._peers_key(), {})
            peers.pop(self.bootstrap.rank, None)  # type: ignore[attr-defined]
            if not peers:
                LOOPBACK_STATES.pop(self._peers_key(), None)
        self.state = None
        self._pool_key = None

    def launch_forward(
        self, frontend: Any, operands: Sequence[Any], staged: MoEEpTensors, output: torch.Tensor
    ) -> torch.Tensor:
        """One forward of ``frontend``'s kernel through the rank's state. T = 0 still launches: the rank
        must publish zero counts and take part in every signal."""
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing:
            self._raise_if_aborted(wait=False)  # a finished earlier forward that aborted (no sync)
        elif not frontend.is_loaded():
            raise MoEEpConfigError(
                f"{self.config.kernel_name}: call warmup() on every rank before capturing a CUDA graph "  # type: ignore[attr-defined]
                "(loading the kernel library inside a capture would stall the other ranks)"
            )
        fn = load_kernel(frontend)
        timeout_ns = int(self.bootstrap.transport_timeout_s * 1e9)  # type: ignore[attr-defined]
        return self.state.launch(fn, operands, output, timeout_ns, staged.num_tokens)

    def _raise_if_aborted(self, wait: bool) -> None:
        hit = self.state.poll_abort(wait)
        if hit is not None:
            stage, peer, epoch = hit
            b = self.bootstrap  # type: ignore[attr-defined]
            raise MoEEpTransportError(
                f"rank {b.rank} of {b.world_size}: the cross-rank wait '{self.state.describe_stage(stage)}' on "
                f"rank {peer} timed out after {b.transport_timeout_s:g} s in forward #{epoch}; that forward's "
                "output is invalid. Call recover_transport() on every rank, then forward again."
            )

    def check_transport(self) -> None:
        """Wait for the last forward and raise ``MoEEpTransportError`` if a cross-rank wait expired."""
        self._raise_if_aborted(wait=True)

    def recover_transport(self) -> None:
        """Collective (every rank calls it, after a ``MoEEpTransportError``): wait for this rank's work,
        then agree on the largest epoch any rank reached, so that the next forward's flags are newer than
        anything a failed forward left behind, also on a rank that never ran it."""
        from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import resync_states

        if self.mode == "loopback":  # one process holds every rank: set them all (idempotent)
            resync_states(list(LOOPBACK_STATES.get(self._peers_key(), {}).values()))
        else:
            resync_states([self.state], self.ep_group())


__all__ = ["LOOPBACK_STATES", "EpRankRuntime", "make_loopback_group"]
