"""BF16 expert-parallel frontend: ``Sm90MegaMoEBf16EpKernel`` (the draft in-kernel EP protocol, see
docs/ep.md) through the shared frontend core, plus the per-rank state one EP layer needs (symmetric
arena, pointer tables, local workspace, abort word, epochs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import comm
from . import kernel_helpers as kh
from .bf16 import Bf16Frontend, widest_tile
from .frontend import Geometry

_TORCH = {"int32": torch.int32, "bfloat16": torch.bfloat16, "float32": torch.float32, "int64": torch.int64}


@dataclass(frozen=True)
class Bf16EpKnobs:
    """Compile-time knobs of the EP kernel. ``ranks_per_gpu``: R for loopback (all ranks on one GPU),
    1 otherwise; every grid is ``num_sms // ranks_per_gpu`` so all ranks' kernels fit at once."""

    world_size: int
    ranks_per_gpu: int = 1
    tile_m: int = 64
    fc1_tile_n: int = 128
    fc2_tile_n: int = 128
    num_sms: int = 132


#: the EP knobs a config may set (``world_size``, ``ranks_per_gpu`` come from the bootstrap, the grid
#: from the device)
EP_TILE_KNOBS = ("tile_m", "fc1_tile_n", "fc2_tile_n")


def default_bf16_ep_knobs(
    geometry: Geometry, world_size: int, ranks_per_gpu: int, overrides: dict[str, int] | None = None
) -> Bf16EpKnobs:
    """64-row M tiles and N tiles up to 128 wide (the shapes the loopback tests ran; not tuned: EP
    performance needs several GPUs), with ``overrides`` (a subset of ``EP_TILE_KNOBS``) applied.
    Raises ValueError on another knob name; the values are checked by ``Bf16EpFrontend.check``."""
    unknown = sorted(set(overrides or {}) - set(EP_TILE_KNOBS))
    if unknown:
        raise ValueError(f"unknown EP knob(s) {', '.join(unknown)}; known: {', '.join(EP_TILE_KNOBS)}")
    gated = geometry.activation in kh.constants.GATED_ACTIVATIONS
    fc1_n = 2 * geometry.intermediate if gated else geometry.intermediate
    base = {"fc1_tile_n": widest_tile(fc1_n, 128), "fc2_tile_n": widest_tile(geometry.hidden, 128)}
    return Bf16EpKnobs(world_size=world_size, ranks_per_gpu=ranks_per_gpu, **{**base, **(overrides or {})})


class Bf16EpFrontend(Bf16Frontend):
    """``geometry.num_experts`` is the GLOBAL expert count here (the kernel splits it over ranks).
    Shares the GLU rules and the weight layout (``prepare_weights``) with the world-size-1 frontend."""

    kernel_family = "moe_bf16_ep"

    def check(self) -> None:
        g, k = self.geometry, self.knobs
        if g.num_experts % k.world_size:
            raise ValueError(f"{g.num_experts} experts do not split over {k.world_size} ranks")
        self.check_glu_problem(g.num_experts // k.world_size)
        self.check_tiles()
        if k.num_sms // k.ranks_per_gpu < 1:
            raise ValueError(f"ranks_per_gpu={k.ranks_per_gpu} leaves no SM per rank")

    def _export(self, out_dir: Path, function_name: str) -> Path:
        g, k = self.geometry, self.knobs
        kernel = kh.Sm90MegaMoEBf16EpKernel(
            activation=g.activation,
            limit=g.activation_limit,
            tile_m=k.tile_m,
            fc1_tile_n=k.fc1_tile_n,
            fc2_tile_n=k.fc2_tile_n,
            num_sms=k.num_sms,
            world_size=k.world_size,
            ranks_per_gpu=k.ranks_per_gpu,
        )
        return kh.export_moe_bf16_ep(kernel, g.hidden, g.intermediate, g.num_experts, g.top_k, out_dir, function_name)

    def symmetric_specs(self, max_tokens: int) -> list[Any]:
        g, k = self.geometry, self.knobs
        return kh.ep_workspace.ep_symmetric_specs(max_tokens, g.hidden, g.num_experts, g.top_k, k.tile_m, k.world_size)

    def workspace_spec(self, max_tokens: int) -> list[Any]:
        g, k = self.geometry, self.knobs
        return [
            kh.BufferSpec(name, shape, dtype)
            for name, shape, dtype in kh.ep_workspace.ep_local_specs(
                max_tokens, g.hidden, g.intermediate, g.num_experts, g.top_k, k.tile_m, k.world_size, k.num_sms,
                k.ranks_per_gpu,
            )
        ]  # fmt: skip


class EpRankState:
    """One rank's EP state: symmetric arena + tables, local workspace, abort word, epochs.

    ``provider``: a symmetric-buffer provider (``comm.make_provider``). Construct every rank's state
    before any rank's first forward (the flags must be zero before anyone signals).
    """

    def __init__(self, frontend: Bf16EpFrontend, provider: Any, rank: int, max_tokens: int, device: torch.device):
        self.frontend, self.rank, self.device = frontend, rank, device
        self.sym_specs = frontend.symmetric_specs(max_tokens)
        try:
            self.host = kh.SymBufferHost(provider, self.sym_specs)
        except (RuntimeError, MemoryError) as exc:
            raise MemoryError(comm.heap_too_small_message(self.sym_specs, frontend.knobs.world_size, exc)) from exc
        self.host.buffers["flags"].zero_()
        self.local = [
            torch.zeros(s.shape, dtype=_TORCH[s.dtype], device=device) for s in frontend.workspace_spec(max_tokens)
        ]
        self.abort = torch.zeros(kh.ep_workspace.ABORT_LEN, dtype=torch.int32, device=device)
        self.abort_host = torch.zeros(kh.ep_workspace.ABORT_LEN, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.abort_event: torch.cuda.Event | None = None
        self.epoch = 0
        self.prev_epoch = 0  # 0: skip the buffer-reuse wait (first forward, or after a host sync)
        self._tables: list[torch.Tensor] | None = None

    def tables(self) -> list[torch.Tensor]:
        if self._tables is None:  # resolvable once every rank has allocated
            self._tables = [self.host.peer_table(buf) for _, buf in kh.ep_workspace.EP_TABLES]
        return self._tables

    def launch(self, x, topk_ids, topk_weights, w13, w2, out, timeout_ns: int) -> torch.Tensor:
        """Enqueue one forward on the current stream; the abort word is copied back asynchronously."""
        fn = self.frontend.load()
        self.epoch += 1
        self.abort.zero_()
        sym = [self.host.buffers[s.name] for s in self.sym_specs]
        fn(x, topk_ids, topk_weights, w13, w2, out, *sym, *self.tables(), *self.local, self.abort, self.rank,
           self.epoch, self.prev_epoch, timeout_ns)  # fmt: skip
        self.abort_host.copy_(self.abort, non_blocking=True)
        self.abort_event = torch.cuda.Event()
        self.abort_event.record()
        self.prev_epoch = self.epoch
        return out

    def poll_abort(self, wait: bool) -> tuple[int, int, int] | None:
        """(stage, peer, epoch) if the last forward aborted; None if it did not (or, without ``wait``,
        if it has not finished yet). After an abort the next forward skips the buffer-reuse wait."""
        if self.abort_event is None:
            return None
        if wait:
            self.abort_event.synchronize()
        elif not self.abort_event.query():
            return None
        self.abort_event = None
        flag, stage, peer, epoch = (int(v) for v in self.abort_host.tolist())
        if flag == 0:
            return None
        self.prev_epoch = 0
        return stage, peer, epoch

    def resync(self, epoch: int) -> None:
        """After a failed forward (host synchronized): continue from ``epoch``, the largest epoch of any
        rank, so the next forward's flags (epoch + 1) are newer than anything the failed one wrote."""
        self.epoch = epoch
        self.prev_epoch = 0  # every rank is idle now: nobody still reads our buffers
        self.abort_event = None

    @staticmethod
    def describe_stage(stage: int) -> str:
        return kh.ep_workspace.ABORT_STAGES.get(stage, f"stage {stage}")

    def release(self) -> None:
        self.host.release()
        self.local = []


__all__ = ["EP_TILE_KNOBS", "Bf16EpFrontend", "Bf16EpKnobs", "EpRankState", "default_bf16_ep_knobs"]
