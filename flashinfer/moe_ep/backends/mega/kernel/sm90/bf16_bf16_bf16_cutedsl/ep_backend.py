"""The SM90 BF16 backend at ``world_size > 1``: the drop's draft in-kernel EP protocol (docs/ep.md).

Every rank's layer launches one chain of kernels that dispatches tokens to the owners' experts through
symmetric buffers, runs FC1/FC2 there and combines the results back, with deadlines on every
cross-rank wait. A wait that expires sets the rank's abort word; the layer raises
``MoEEpTransportError`` (stage, peer, epoch) on the next ``forward`` or ``check_transport``. Every
rank then calls ``recover_transport()`` (collective) and the next forward runs normally. Not yet: token
buckets, autotune, workspace pooling, CUDA graphs (capture is refused: the cross-rank epoch is a launch
argument, so every replay of a graph would reuse one epoch and its waits would pass on stale flags).
"""

from __future__ import annotations

from typing import Any

import torch

from ......config import MoEEpTensors, MoEWeightPack
from ......errors import MoEEpConfigError, MoEEpTransportError
from ..runtime import load_kernel
from . import tuning
from .backend import Sm90Bf16CutedslBackend

#: loopback group -> {rank: EpRankState}: how one logical rank's recovery sees the others' epochs
_LOOPBACK_STATES: dict[int, dict[int, Any]] = {}


def make_loopback_group(world_size: int, device: torch.device | str) -> Any:
    """A group of ``world_size`` logical ranks in this process on ``device`` (BootstrapConfig.loopback_group)."""
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh

    return kh.LoopbackGroup(world_size, torch.device(device))


class Sm90Bf16EpBackend(Sm90Bf16CutedslBackend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super(Sm90Bf16CutedslBackend, self).__init__(*args, **kwargs)  # the base class only: no token buckets
        from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

        b, c = self.bootstrap, self.config
        self.mode = "loopback" if b.symmetric_memory == "loopback" else "nvshmem"
        if c.knobs is not None and not isinstance(c.knobs, dict):
            raise MoEEpConfigError(
                f"{c.kernel_name} at world_size > 1 takes knobs=None or a dict of {', '.join(drop.EP_TILE_KNOBS)} "
                f"(no autotune of the expert-parallel kernel yet); got {c.knobs!r}"
            )
        geometry = tuning.make_geometry(c, c.num_experts)  # the EP kernel takes the GLOBAL expert count
        ranks_per_gpu = b.world_size if self.mode == "loopback" else 1
        try:
            knobs = drop.default_bf16_ep_knobs(geometry, b.world_size, ranks_per_gpu, c.knobs)
            self.frontend = drop.Bf16EpFrontend(geometry, knobs)
            self.frontend.check()
        except (TypeError, ValueError) as exc:
            raise MoEEpConfigError(f"{c.kernel_name}: {exc}") from None
        self.state: Any = None
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None

    def preprocess_weights(self, weights: MoEWeightPack) -> None:
        self.check_unquantized_weights(weights, torch.bfloat16)
        self.w13, self.w2 = self.frontend.prepare_weights(weights.w13, weights.w2)

    def _provider(self) -> Any:
        from flashinfer.moe_ep.core.runtime.bootstrap import current_runtime
        from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm

        b = self.bootstrap
        if self.mode == "loopback":
            return comm.make_provider("loopback", b.world_size, b.rank, self.device, b.loopback_group)
        rt = current_runtime()
        if rt is None or not rt.nvshmem:
            raise MoEEpConfigError(
                "world_size > 1 with NVSHMEM needs bootstrap_moe_ep_runtime(BootstrapConfig(...)) first "
                "(or symmetric_memory='loopback' for R ranks on one GPU)"
            )
        return comm.make_provider("nvshmem", b.world_size, b.rank, self.device)

    def allocate_workspace(self) -> None:
        from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import EpRankState

        with torch.cuda.device(self.device):
            try:
                self.state = EpRankState(
                    self.frontend, self._provider(), self.bootstrap.rank, self.fleet.max_tokens_per_rank, self.device
                )
            except MemoryError as exc:
                raise MoEEpConfigError(str(exc)) from None
        if self.mode == "loopback":
            _LOOPBACK_STATES.setdefault(id(self.bootstrap.loopback_group), {})[self.bootstrap.rank] = self.state

    def warmup(self) -> None:
        """Loads the kernel only: a forward is collective, so it cannot run one rank alone here."""
        load_kernel(self.frontend)

    def _raise_if_aborted(self, wait: bool) -> None:
        hit = self.state.poll_abort(wait)
        if hit is not None:
            stage, peer, epoch = hit
            b = self.bootstrap
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
        torch.cuda.synchronize(self.device)
        if self.mode == "loopback":
            states = _LOOPBACK_STATES.get(id(self.bootstrap.loopback_group), {})
            top = max(s.epoch for s in states.values())
            for s in states.values():  # one process holds every rank: set them all (idempotent)
                s.resync(top)
            return
        import torch.distributed as dist

        from flashinfer.moe_ep.core.runtime.bootstrap import current_runtime

        epoch = torch.tensor([self.state.epoch], dtype=torch.int64, device=self.device)
        dist.all_reduce(epoch, op=dist.ReduceOp.MAX, group=current_runtime().group)
        self.state.resync(int(epoch.item()))

    def compute(self, staged: MoEEpTensors, output: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            raise MoEEpConfigError(
                f"{self.config.kernel_name} at world_size > 1 cannot be captured in a CUDA graph yet: the "
                "cross-rank epoch is a launch argument, so a replayed graph would reuse it and its waits "
                "would pass on stale flags. Run the expert-parallel layer eagerly."
            )
        self._raise_if_aborted(wait=False)  # a finished earlier forward that aborted (no sync)
        load_kernel(self.frontend)
        timeout_ns = int(self.bootstrap.transport_timeout_s * 1e9)
        # T = 0 still launches: the rank must publish zero counts and take part in every signal.
        return self.state.launch(
            staged.hidden_states, staged.topk_ids, staged.topk_weights, self.w13, self.w2, output, timeout_ns
        )

    def destroy(self) -> None:
        if self.state is not None:
            if self.mode == "loopback":
                _LOOPBACK_STATES.get(id(self.bootstrap.loopback_group), {}).pop(self.bootstrap.rank, None)
            self.state.release()
            self.state = None
        self.w13 = self.w2 = None


__all__ = ["Sm90Bf16EpBackend", "make_loopback_group"]
