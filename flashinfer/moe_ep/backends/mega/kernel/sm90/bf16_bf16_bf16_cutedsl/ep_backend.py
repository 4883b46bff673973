"""The SM90 BF16 backend at ``world_size > 1``: the drop's in-kernel EP protocol (docs/ep.md).

Every rank's layer launches one chain of kernels that dispatches tokens to the owners' experts through
symmetric buffers, runs FC1/FC2 there and combines the results back, with deadlines on every
cross-rank wait. A wait that expires sets the rank's abort word; the layer raises
``MoEEpTransportError`` (stage, peer, epoch) on the next ``forward`` or ``check_transport``. Every
rank then calls ``recover_transport()`` (collective) and the next forward runs normally.

CUDA graphs: the epoch of the cross-rank flags lives on the device and the live token count is read
there (``MoEEpTensors.num_tokens``), so a forward captured after ``warmup()`` replays correctly with any
live count up to the captured rows. A replay does not run Python: call ``check_transport()`` after
replays to learn whether a wait expired.

Workspace pooling: the rank's EP state (symmetric arena, local workspace, device epoch, abort word)
is shared by every layer of one geometry (same kernel, capacity, device, EP group, rank) through the
drop's refcounted pool, unless ``share_workspace=False``: the layers of a model run one after another
on one stream, so their forwards simply continue one epoch sequence.

Knobs, per token bucket of the global T (``ep_tuning``): ``None`` (the knob cache, else the defaults),
a dict of tile knobs (every bucket), or ``"auto"``: ``warmup()`` (on every rank) tunes every bucket
collectively (with loopback ranks the first rank's warmup tunes the whole group) and records the
winners. Every bucket's kernel uses the rank's one EP state.
"""

from __future__ import annotations

from typing import Any

import torch

from ......config import MoEEpTensors, MoEWeightPack
from ......errors import MoEEpConfigError
from ..ep_runtime import EpRankRuntime, make_loopback_group
from ..runtime import load_kernel
from . import ep_tuning, tuning
from .backend import Sm90Bf16CutedslBackend

#: loopback group -> {rank: backend} of the layers waiting for ``knobs="auto"`` (tuned together)
_LOOPBACK_AUTO: dict[int, dict[int, Any]] = {}


class Sm90Bf16EpBackend(EpRankRuntime, Sm90Bf16CutedslBackend):
    """The rank runtime (provider, pooled EP state, launch, transport errors): ``ep_runtime``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super(Sm90Bf16CutedslBackend, self).__init__(*args, **kwargs)  # the base class only: no token buckets
        from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

        b, c = self.bootstrap, self.config
        self.mode = "loopback" if b.symmetric_memory == "loopback" else "nvshmem"
        auto = c.knobs == tuning.AUTO
        if c.knobs is not None and not auto and not isinstance(c.knobs, dict):
            raise MoEEpConfigError(
                f"{c.kernel_name} at world_size > 1 takes knobs=None, {tuning.AUTO!r} or a dict of "
                f"{', '.join(drop.EP_KNOBS)}; got {c.knobs!r}"
            )
        geometry = tuning.make_geometry(c, c.num_experts)  # the EP kernel takes the GLOBAL expert count
        self.context = ep_tuning.ep_context(self.device, b.world_size, self.mode == "loopback")
        self.buckets = ep_tuning.ep_buckets(b.world_size, self.fleet.max_tokens_per_rank)
        tiles, self.knob_sources = ep_tuning.layer_tiles(
            geometry, self.context, b.world_size, self.ranks_per_gpu, self.buckets, c.knobs
        )
        try:
            self._set_profiles(geometry, tiles)
        except (TypeError, ValueError) as exc:
            if isinstance(c.knobs, dict):
                raise MoEEpConfigError(f"{c.kernel_name}: {exc}") from None
            self._set_profiles(geometry, {name: {} for name in tiles})  # stale cache entries: the defaults
            self.knob_sources = dict.fromkeys(tiles, "defaults")
        if self.mode == "nvshmem":
            self._agree_on_knobs()
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self._natural: tuple[torch.Tensor, torch.Tensor] | None = None  # kept for knobs="auto"
        self.auto_pending = auto
        self.tune_results: dict[str, Any] = {}
        if auto and self.mode == "loopback":
            _LOOPBACK_AUTO.setdefault(id(b.loopback_group), {})[b.rank] = self

    def _set_profiles(self, geometry: Any, tiles: dict[str, dict[str, int]]) -> None:
        """One frontend per bucket (``ep_tuning.bucket_frontends``); ``frontend`` is the largest bucket's."""
        b = self.bootstrap
        self.by_bucket = ep_tuning.bucket_frontends(geometry, b.world_size, self.ranks_per_gpu, self.buckets, tiles)
        self.frontend = self.by_bucket[self.buckets[-1].name]

    def distinct_frontends(self) -> list[Any]:
        return tuning.distinct(self.by_bucket.values())

    def _agree_on_knobs(self) -> None:
        """Every rank takes rank 0's knobs: the symmetric buffers they size must match on every rank,
        and each node's knob cache may hold other entries (a broadcast over the EP group)."""
        import torch.distributed as dist

        from flashinfer.moe_ep.core.runtime.bootstrap import current_runtime
        from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

        rt = current_runtime()
        if rt is None or rt.group is None:
            return  # no runtime yet: allocate_workspace raises the error that says what to do
        mine = {name: drop.ep_knob_dict(fe.knobs) for name, fe in self.by_bucket.items()}
        box = [(mine, self.knob_sources)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(rt.group, 0), group=rt.group)
        theirs, self.knob_sources = box[0]
        if theirs != mine:
            self._set_profiles(self.frontend.geometry, theirs)

    def preprocess_weights(self, weights: MoEWeightPack) -> None:
        self.check_unquantized_weights(weights, torch.bfloat16)
        if self.auto_pending:
            self._natural = (weights.w13, weights.w2)
        self.w13, self.w2 = self.frontend.prepare_weights(weights.w13, weights.w2)

    def natural_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's weights in natural layouts (kept until ``knobs="auto"`` has been tuned)."""
        if self._natural is None:
            raise MoEEpConfigError("the natural-layout weights are kept only for knobs='auto'")
        return self._natural

    def warmup(self) -> None:
        """Loads every bucket's kernel (a forward is collective, so it cannot run one rank alone here);
        with ``knobs="auto"`` first tunes them (collective: every rank calls warmup)."""
        if self.auto_pending:
            self._autotune()
        for fe in self.distinct_frontends():
            load_kernel(fe)

    def _autotune(self) -> None:
        b = self.bootstrap
        if self.mode == "loopback":
            peers = _LOOPBACK_AUTO.get(id(b.loopback_group), {})
            if sorted(peers) != list(range(b.world_size)):
                raise MoEEpConfigError(
                    f"knobs='auto' with loopback ranks tunes every rank together: construct all {b.world_size} "
                    f"ranks' layers before the first warmup() (found ranks {sorted(peers)})"
                )
            group = [peers[r] for r in range(b.world_size)]
            results = ep_tuning.autotune_ep(group)
            for be in group:  # in rank order: the loopback provider pairs the ranks' allocations
                be._apply_tuned(results)
            _LOOPBACK_AUTO.pop(id(b.loopback_group), None)
        else:
            from flashinfer.moe_ep.core.runtime.bootstrap import current_runtime

            results = ep_tuning.autotune_ep([self], group=current_runtime().group)
            self._apply_tuned(results)
        if b.rank == 0:
            for name, (result, tokens) in results.items():
                ep_tuning.record_ep_knobs(self.frontend.geometry, self.context, name, result.winner,
                                          result.winner_ms, tokens)  # fmt: skip

    def _apply_tuned(self, results: dict[str, Any]) -> None:
        """Rebuild kernels, weights and EP state for the winners (collective allocation, in lockstep)."""
        from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

        natural = self.natural_weights()
        self.destroy()
        self._set_profiles(self.frontend.geometry, {n: drop.ep_knob_dict(r.winner) for n, (r, _) in results.items()})
        self.w13, self.w2 = self.frontend.prepare_weights(*natural)
        self.allocate_workspace()
        self.tune_results = {n: r for n, (r, _) in results.items()}
        self.knob_sources = dict.fromkeys(results, "autotune")
        self.auto_pending, self._natural = False, None

    def compute(self, staged: MoEEpTensors, output: torch.Tensor) -> torch.Tensor:
        # the bucket of the rows given (a host shape; under a graph the captured rows, whatever num_tokens)
        frontend = self.by_bucket[ep_tuning.bucket_of(self.world_size, staged.hidden_states.shape[0])]
        operands = (staged.hidden_states, staged.topk_ids, staged.topk_weights, self.w13, self.w2)
        return self.launch_forward(frontend, operands, staged, output)

    def destroy(self) -> None:
        _LOOPBACK_AUTO.get(id(self.bootstrap.loopback_group), {}).pop(self.bootstrap.rank, None)
        self.release_state()
        self.w13 = self.w2 = None


__all__ = ["Sm90Bf16EpBackend", "make_loopback_group"]
