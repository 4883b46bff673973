"""BF16 expert-parallel frontend: ``Sm90MegaMoEBf16EpKernel`` (the in-kernel EP protocol, see
docs/ep.md) through the shared frontend core, plus the per-rank state one EP layer needs (symmetric
arena, pointer tables, local workspace, abort word, epochs)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from . import comm
from . import kernel_helpers as kh
from .bf16 import Bf16Frontend, widest_tile
from .frontend import Geometry, check_token_capacity

_TORCH = {"int32": torch.int32, "bfloat16": torch.bfloat16, "float32": torch.float32, "int64": torch.int64}


@dataclass(frozen=True)
class Bf16EpKnobs:
    """Compile-time knobs of the EP kernel. ``ranks_per_gpu``: R for loopback (all ranks on one GPU),
    1 otherwise; the routing and GEMM grids are ``num_sms // ranks_per_gpu`` so all ranks' kernels fit
    at once. ``cluster_m``: 2 pairs GEMM CTAs along M (adjacent M blocks share weight tiles; needs an
    even grid). ``dispatch``: ``"pull"`` (owners read the rows) or ``"push"`` (sources write them)."""

    world_size: int
    ranks_per_gpu: int = 1
    tile_m: int = 64
    fc1_tile_n: int = 128
    fc2_tile_n: int = 128
    num_sms: int = 132
    cluster_m: int = 1
    dispatch: str = "pull"

    @property
    def grid(self) -> int:
        return max(1, self.num_sms // self.ranks_per_gpu)


#: the EP knobs a config may set and the knob cache records (``world_size``, ``ranks_per_gpu`` come
#: from the bootstrap, the grid from the device)
EP_KNOBS = ("tile_m", "fc1_tile_n", "fc2_tile_n", "cluster_m", "dispatch")
#: the knob-cache family of the EP kernel (its buckets: ``tuner.EP_TOKEN_BUCKETS`` over the global T)
EP_KNOB_FAMILY = "moe_bf16_ep"
#: autotune value sets (every valid combination is a candidate)
EP_TILE_M_VALUES = (64, 128)
EP_TILE_N_VALUES = (64, 128, 256)
EP_CLUSTER_M_VALUES = (1, 2)
EP_DISPATCH_VALUES = ("pull", "push")
#: per token bucket of the global T: (tile_m, widest FC1 N tile, widest FC2 N tile, cluster_m, dispatch);
#: autotune varies the tiles and cluster_m, the dispatch stays the bucket's. Measured on two H200s
#: (TUNING.md, session 5): push dispatch moved deepseek-v3's rows 10 % faster than pull at 8192 tokens
#: per rank (1.55 vs 1.72 ms, two runs) and the layer 1-2 % faster from 2048 tokens per rank on; below,
#: no consistent difference, so pull (two signal/wait rounds fewer). A layer uses one dispatch in every
#: bucket, its largest bucket's (ranks of one forward may sit in different buckets; the backend's
#: ``ep_tuning.bucket_frontends`` pins it).
EP_BUCKET_DEFAULTS = {
    "decode": (64, 256, 128, 1, "pull"),
    "mid": (128, 256, 256, 1, "pull"),
    "prefill": (128, 256, 256, 2, "push"),
}


def default_bf16_ep_knobs(
    geometry: Geometry,
    world_size: int,
    ranks_per_gpu: int,
    overrides: dict[str, int] | None = None,
    bucket: str = "prefill",
) -> Bf16EpKnobs:
    """The defaults of token ``bucket`` (``EP_BUCKET_DEFAULTS``: the world-size-1 defaults, which won
    or came within a few percent of the EP autotune winners on two H200s, TUNING.md), N tiles narrowed
    to what divides the problem and ``cluster_m`` to 1 on an odd grid, with ``overrides`` (a subset of
    ``EP_KNOBS``) applied. Raises ValueError on another knob name or bucket; the values are
    checked by ``Bf16EpFrontend.check``."""
    unknown = sorted(set(overrides or {}) - set(EP_KNOBS))
    if unknown:
        raise ValueError(f"unknown EP knob(s) {', '.join(unknown)}; known: {', '.join(EP_KNOBS)}")
    if bucket not in EP_BUCKET_DEFAULTS:
        raise ValueError(f"unknown token bucket {bucket!r}; known: {', '.join(EP_BUCKET_DEFAULTS)}")
    tile_m, fc1_widest, fc2_widest, cluster_m, dispatch = EP_BUCKET_DEFAULTS[bucket]
    grid = Bf16EpKnobs(world_size, ranks_per_gpu).grid
    base = {
        "tile_m": tile_m,
        "fc1_tile_n": widest_tile(geometry.fc1_rows, fc1_widest),
        "fc2_tile_n": widest_tile(geometry.hidden, fc2_widest),
        "cluster_m": cluster_m if grid % cluster_m == 0 else 1,
        "dispatch": dispatch,
    }
    return Bf16EpKnobs(world_size=world_size, ranks_per_gpu=ranks_per_gpu, **{**base, **(overrides or {})})


def ep_candidates(
    geometry: Geometry, world_size: int, ranks_per_gpu: int, bucket: str = "prefill"
) -> list[Bf16EpKnobs]:
    """Every valid EP knob combination (``Bf16EpFrontend.check``), ``bucket``'s defaults first (the
    incumbent)."""
    out = [default_bf16_ep_knobs(geometry, world_size, ranks_per_gpu, bucket=bucket)]
    for tile_m in EP_TILE_M_VALUES:
        for fc1 in EP_TILE_N_VALUES:
            for fc2 in EP_TILE_N_VALUES:
                for cluster_m in EP_CLUSTER_M_VALUES:
                    tiles = {"tile_m": tile_m, "fc1_tile_n": fc1, "fc2_tile_n": fc2, "cluster_m": cluster_m}
                    knobs = default_bf16_ep_knobs(geometry, world_size, ranks_per_gpu, tiles, bucket)
                    if knobs in out:
                        continue
                    try:
                        Bf16EpFrontend(geometry, knobs).check()
                    except ValueError:
                        continue
                    out.append(knobs)
    return out


def ep_knob_dict(knobs: Bf16EpKnobs) -> dict[str, int | str]:
    """The tunable part of ``knobs`` (what the knob cache records)."""
    return {name: getattr(knobs, name) for name in EP_KNOBS}


class EpFrontendMixin:
    """What every EP frontend shares (BF16 and block-scaled): the expert split over the ranks and the
    EP buffers (``ep_workspace``: symmetric specs, local workspace). ``geometry.num_experts`` is the
    GLOBAL expert count; the knobs carry ``world_size``, ``ranks_per_gpu``, ``num_sms``, ``tile_m``,
    ``cluster_m`` and ``dispatch``."""

    geometry: Geometry
    knobs: Any
    #: the combine wires of the EP kernels (``geometry.combine_dtype``)
    combine_wires: tuple[str, ...] = ("bf16", "mxfp8")

    @property
    def local_experts(self) -> int:
        return self.geometry.num_experts // self.knobs.world_size

    def build_world_size(self) -> int:
        return self.knobs.world_size

    def build_knobs(self) -> dict[str, Any]:
        """The knobs a config sets (the placement, ``world_size`` and ``ranks_per_gpu``, comes from the
        bootstrap, the grid from the device)."""
        placement = ("world_size", "ranks_per_gpu", "num_sms")
        return {k: v for k, v in asdict(self.knobs).items() if k not in placement}

    def build_command(self) -> str:
        cmd = super().build_command()  # type: ignore[misc]
        if self.knobs.ranks_per_gpu > 1:  # loopback ranks: the build command serves one GPU per rank
            cmd += "  (loopback ranks: build with scripts/gpu_session.py build --only ep, or let the layer compile)"
        return cmd

    def check_ep(self) -> None:
        """The EP rules (ValueError): experts split evenly, at most one routing block of global experts,
        an SM per rank, a known dispatch."""
        g, k = self.geometry, self.knobs
        if g.num_experts % k.world_size:
            raise ValueError(f"{g.num_experts} experts do not split over {k.world_size} ranks")
        most = kh.constants.ROUTING_THREADS
        if g.num_experts > most:
            raise ValueError(f"the EP kernels route at most {most} experts, got {g.num_experts}")
        if k.num_sms // k.ranks_per_gpu < 1:
            raise ValueError(f"ranks_per_gpu={k.ranks_per_gpu} leaves no SM per rank")
        if k.dispatch not in EP_DISPATCH_VALUES:
            raise ValueError(f"dispatch must be one of {', '.join(EP_DISPATCH_VALUES)}, got {k.dispatch!r}")

    def symmetric_specs(self, max_tokens: int) -> list[Any]:
        g, k = self.geometry, self.knobs
        return kh.ep_workspace.ep_symmetric_specs(
            max_tokens, g.hidden, g.num_experts, g.top_k, k.tile_m, k.world_size, k.cluster_m
        )

    def workspace_spec(self, max_tokens: int) -> list[Any]:
        g, k = self.geometry, self.knobs
        return [
            kh.BufferSpec(name, shape, dtype)
            for name, shape, dtype in kh.ep_workspace.ep_local_specs(
                max_tokens, g.hidden, g.intermediate, g.num_experts, g.top_k, k.tile_m, k.world_size, k.num_sms,
                k.ranks_per_gpu, k.cluster_m,
            )
        ]  # fmt: skip


class Bf16EpFrontend(EpFrontendMixin, Bf16Frontend):
    """``geometry.num_experts`` is the GLOBAL expert count here (the kernel splits it over ranks).
    Shares the GLU rules and the weight layout (``prepare_weights``) with the world-size-1 frontend."""

    kernel_family = "moe_bf16_ep"

    @property
    def fc1_tiled(self) -> bool:
        """The EP kernel reads w13 untiled (``fc1_tiled`` is a world-size-1 knob)."""
        return False

    def check(self) -> None:
        k = self.knobs
        self.check_ep()
        self.check_glu_problem(self.local_experts)
        self.check_tiles()
        if k.cluster_m not in (1, 2) or k.grid % k.cluster_m:
            raise ValueError(f"cluster_m must be 1 or 2 and divide the grid ({k.grid} CTAs), got {k.cluster_m}")

    def _export(self, out_dir: Path, function_name: str) -> Path:
        g, k = self.geometry, self.knobs
        kernel = kh.Sm90MegaMoEBf16EpKernel(
            **self.glu_kwargs(),
            world_size=k.world_size,
            ranks_per_gpu=k.ranks_per_gpu,
            cluster_m=k.cluster_m,
            dispatch=k.dispatch,
            combine_dtype=g.combine_dtype,
        )
        return kh.export_moe_bf16_ep(kernel, g.hidden, g.intermediate, g.num_experts, g.top_k, out_dir, function_name)


def merge_specs(spec_lists: list[list[Any]]) -> list[Any]:
    """Buffer specs that serve every list: same names in the first list's order, each extent the
    largest of any list (kernels of several token buckets share one state; a larger buffer is fine)."""
    merged = list(spec_lists[0])
    for specs in spec_lists[1:]:
        by_name = {s.name: s for s in specs}
        if set(by_name) != {s.name for s in merged}:
            raise ValueError("EP kernels with different buffer sets cannot share one state")
        for i, s in enumerate(merged):
            o = by_name[s.name]
            if o.dtype != s.dtype or len(o.shape) != len(s.shape):
                raise ValueError(f"buffer {s.name!r} differs in dtype or rank between EP kernels")
            merged[i] = replace(s, shape=tuple(max(a, b) for a, b in zip(s.shape, o.shape, strict=True)))
    return merged


class EpRankState:
    """One rank's EP state: symmetric arena + tables, local workspace (with the device-side epoch
    state ``ep_state``), abort word and its host copy.

    ``provider``: a symmetric-buffer provider (``comm.make_provider``). Construct every rank's state
    before any rank's first forward (the flags must be zero before anyone signals). Nothing of a
    forward lives on the host, so ``launch`` may be captured in a CUDA graph and replayed. ``others``:
    more frontends (token buckets) whose kernels use this state too (buffers sized for all).
    ``group``: the EP process group; over NVSHMEM every rank first checks for GPU memory room
    (``comm.reserve_device_room``, collective).
    """

    def __init__(
        self,
        frontend: EpFrontendMixin,
        provider: Any,
        rank: int,
        max_tokens: int,
        device: torch.device,
        others: tuple[EpFrontendMixin, ...] = (),
        group: Any = None,
    ):
        self.frontend, self.rank, self.device = frontend, rank, device
        fronts = [frontend, *others]
        self.sym_specs = merge_specs([f.symmetric_specs(max_tokens) for f in fronts])
        specs = merge_specs([f.workspace_spec(max_tokens) for f in fronts])
        if provider.kind == "nvshmem" and group is not None:  # raises MemoryError on every rank
            local_bytes = sum(math.prod(s.shape) * _TORCH[s.dtype].itemsize for s in specs)
            comm.reserve_device_room(self.sym_specs, device, group, local_bytes)
        # the local workspace first: a rank that fails here has not entered the collective allocation
        self.local = [torch.zeros(s.shape, dtype=_TORCH[s.dtype], device=device) for s in specs]
        try:
            self.host = kh.SymBufferHost(provider, self.sym_specs)
        except (RuntimeError, MemoryError) as exc:
            raise MemoryError(comm.heap_too_small_message(self.sym_specs, frontend.knobs.world_size, exc)) from exc
        self.host.buffers["flags"].zero_()
        self.ep_state = self.local[[s.name for s in specs].index("ep_state")]
        self.abort = torch.zeros(kh.ep_workspace.ABORT_LEN, dtype=torch.int32, device=device)
        self.abort_host = torch.zeros(kh.ep_workspace.ABORT_LEN, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.abort_event: torch.cuda.Event | None = None
        self.captured = False  # a launch was captured: replays update abort_host without an event
        # live_tokens when the caller gives none: row t holds t (a view, so no launch per forward)
        self.max_tokens = max_tokens
        self.counts = torch.arange(max(1, max_tokens) + 1, dtype=torch.int32, device=device)
        self._state_args: tuple[Any, ...] | None = None

    def state_args(self) -> tuple[Any, ...]:
        """The state part of the kernel call, in ``ep_workspace.EP_ARGS`` order (symmetric buffers,
        peer tables, local workspace, abort word, rank): the same for every forward, built once (the
        tables resolve once every rank has allocated, i.e. at the first launch)."""
        if self._state_args is None:
            sym = [self.host.buffers[s.name] for s in self.sym_specs]
            tables = [self.host.peer_table(buf) for _, buf in kh.ep_workspace.EP_TABLES]
            self._state_args = (*sym, *tables, *self.local, self.abort, self.rank)
        return self._state_args

    def launch(
        self,
        fn: Any,
        operands: Sequence[Any],
        out: torch.Tensor,
        timeout_ns: int,
        live_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Enqueue one forward with ``fn`` (the loaded kernel of a frontend sharing this state) on the
        current stream (capturable); the abort word is copied back asynchronously. ``operands``: the
        kernel's arguments before ``out`` (BF16: ``x, topk_ids, topk_weights, w13, w2``; block-scaled:
        ``QuantEpFrontend.operands``). ``live_tokens``: int32 [1] device tensor, default all
        ``out.shape[0]`` rows."""
        check_token_capacity(out.shape[0], self.max_tokens, "this EP rank state")
        if live_tokens is None:
            live_tokens = self.counts[out.shape[0] : out.shape[0] + 1]
        fn(*operands, out, live_tokens, *self.state_args(), timeout_ns)
        self.abort_host.copy_(self.abort, non_blocking=True)
        if torch.cuda.is_current_stream_capturing():
            self.captured, self.abort_event = True, None
        else:
            self.abort_event = torch.cuda.Event()
            self.abort_event.record()
        return out

    def poll_abort(self, wait: bool) -> tuple[int, int, int] | None:
        """(stage, peer, epoch) if the last forward aborted; None if it did not (or, without ``wait``,
        if it has not finished yet). After a captured launch, ``wait`` synchronizes the device (the
        last replay wrote ``abort_host``)."""
        if self.abort_event is None:
            if not (wait and self.captured):
                return None
            torch.cuda.synchronize(self.device)
        elif wait:
            self.abort_event.synchronize()
        elif not self.abort_event.query():
            return None
        self.abort_event = None
        flag, stage, peer, epoch = (int(v) for v in self.abort_host.tolist())
        if flag == 0:
            return None
        return stage, peer, epoch

    def device_epoch(self) -> int:
        """The epoch of the last forward begun on this rank (reads the device)."""
        return int(self.ep_state[kh.ep_workspace.STATE_EPOCH].item())

    def resync(self, epoch: int) -> None:
        """After a failed forward, with every rank idle: continue after ``epoch`` (the largest epoch of
        any rank) and skip the next reuse wait (``ep_workspace.resync_state``)."""
        state = kh.ep_workspace.resync_state(epoch)
        self.ep_state.copy_(torch.tensor(state, dtype=torch.int32))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.abort_host.zero_()
        self.abort_event = None

    @staticmethod
    def describe_stage(stage: int) -> str:
        return kh.ep_workspace.ABORT_STAGES.get(stage, f"stage {stage}")

    def release(self) -> None:
        self.host.release()
        self.local = []
        self._state_args = None


def resync_states(states: Sequence[EpRankState], group: Any = None) -> int:
    """With every rank idle (after a failed forward, or between autotune candidates): every state
    continues after the largest epoch any rank reached, its next reuse wait skipped, so the next
    forward's flags are newer than anything an earlier one left. ``states``: the ranks of this process
    (every rank of a loopback group, or this rank's one state); ``group``: the EP process group when
    the ranks are processes (an all-reduce MAX; every rank calls this), else None. Returns the epoch."""
    for s in states:
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
    top = max(s.device_epoch() for s in states)
    if group is not None:
        import torch.distributed as dist

        top = comm.all_reduce_int(top, dist.ReduceOp.MAX, group, states[0].device)
    for s in states:
        s.resync(top)
    return top


__all__ = [
    "EP_KNOB_FAMILY",
    "EP_KNOBS",
    "Bf16EpFrontend",
    "Bf16EpKnobs",
    "EpFrontendMixin",
    "EpRankState",
    "default_bf16_ep_knobs",
    "ep_candidates",
    "ep_knob_dict",
    "resync_states",
    "merge_specs",
]
