"""BF16 frontend: ``Sm90MegaMoEBf16Kernel`` (world size 1) through the shared frontend core."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import kernel_helpers as kh
from .frontend import Geometry, KernelFrontend, check_glu_geometry


@dataclass(frozen=True)
class Bf16Knobs:
    """Compile-time knobs of the BF16 kernel (all output-neutral: tiles, stages, grid, clusters).

    ``cluster_m=2`` pairs two CTAs on two M tiles (the drop's pair table, v7: with few tiles per
    expert an expert's tiles in pairs and odd last tiles of neighbouring experts together, else
    adjacent tiles); when both tiles belong to one expert they share each weight tile (TMA
    multicast), otherwise each loads its own.

    ``fc1_tiled`` (a layout knob, default on): w13 is stored tiled, every (fc1_tile_n x 64) weight tile
    one contiguous block of memory, so each TMA load of FC1 reads one run of memory instead of
    fc1_tile_n runs of 128 bytes one row pitch apart (measured on H200: 1.5-3 % faster at decode,
    10 % on deepseek-v3 at T = 1; TUNING.md, drop v14).

    ``gather_in_fc1`` (default on): FC1 loads its activation rows from ``x`` itself instead of from a
    copy gathered by a separate kernel (drop v18; measured on H200: 2-11 % faster from T = 128 to 1024,
    4-10 % on qwen3-30b-a3b prefill, even at T = 1, 1-2.4 % slower on deepseek-v3 at T >= 4096;
    TUNING.md, "Session 10"). On drop v46 also faster on deepseek-v3 prefill: the gathered copy took 1.5-10.5 %
    longer at T = 4096 and 16384 on the three bench contracts (H100, TUNING.md, "Session 34").

    ``fc1_split_n``: FC1 N tiles of 128 over the 256-wide weight layout (twice the FC1 CTAs; gated
    activations, ``fc1_tile_n=256``, ``cluster_m=1``). The ``single`` token bucket (T = 1) turns it on
    where it doubles FC1's CTAs within the grid (``split_fc1_pays``; measured on H200: qwen3-30b-a3b
    T = 1 8 % faster, 1-3 % slower at T >= 2 and where FC1 already fills the SMs; TUNING.md).

    ``decode_fused``: the whole layer in one launch (the drop's ``moe_bf16_glu.decode``: routing in every CTA,
    FC1 and FC2 as GEMVs on every SM, a grid barrier between them, the combine inside FC2) for a few tokens:
    ``T * top_k <= 256`` (``decode_max_tokens``), checked before each launch; ``decode_warps`` (8, 16),
    ``decode_stages`` (its per-warp ring depth, 2+) and ``decode_k_warps`` (1, 2, 4, 8, 16, at most
    ``decode_warps``: warps splitting one FC1 unit's K loop; None, the default: all of them) shape it. Its grid
    of ``num_sms`` CTAs must be co-resident, so ``num_sms`` may not exceed the device's SM count (checked at the
    first launch); it is launched as a cooperative grid (drop v40), so the driver runs all its CTAs at once even
    beside kernels on other streams. Off in every token bucket's defaults: measured on H200 (TUNING.md, session
    26, drops v39-v40) it ties with the chain of kernels per layer in CUDA graphs at T = 1-4 on the three bench
    contracts (0.96-1.06x), takes 1.1-1.2x its time at T = 16, and eager calls back to back were even or faster
    in three runs (one launch instead of four: qwen3-30b-a3b T = 1 31-34 against 32-42 us per layer; a lone,
    host-bound call either way); autotune times it in the ``single`` bucket (``tuner.candidates``) and keeps it
    where it wins.

    ``pair_blocks`` (needs ``gather_in_fc1`` and ``cluster_m=1``): the chain without its routing kernel: M block
    b of the GEMMs is pair b of ``topk_ids`` (its expert, one row), the combine reads row ``b * tile_m``. Every
    pair reads its expert's weights alone, so it is meant for one token; it serves ``T * top_k <= num_experts``
    (the workspace's rows; ``pair_blocks_max_tokens``), checked before each launch. On in the ``single`` bucket
    (``tuner.bf16_refine``): session 29 timed it at 0.94 / 0.97 / 0.98x the chain's time at T = 1 (qwen3-30b-a3b
    / qwen3-235b-a22b / deepseek-v3, one-call graph replays), outputs bitwise equal; at T = 4 it read each
    shared expert's weights once per pair and took up to 1.11x.

    ``pair_combine`` (needs ``pair_blocks``): FC2 does the combine itself (the last of a token's ``top_k`` pairs
    to finish an N tile sums the tile's k rows in k order, the combine kernel's arithmetic: the same bits), so
    the layer is two kernels; its arrival counters are ``expert_count``'s tail in the workspace
    (``pair_combine_counters``, zero between calls). Drop v44, on with ``pair_blocks`` in the ``single`` bucket
    (``tuner.bf16_refine``): session 30 timed the layer without it at 1.037-1.055 / 1.002-1.013 / 1.004-1.005x
    its time at T = 1 (qwen3-30b-a3b / qwen3-235b-a22b / deepseek-v3, one-call graph replays, two runs), outputs
    bitwise equal.

    ``fc2_early_weights`` (default on; it applies with ``cluster_m=1``, and has no effect with clusters):
    FC2 issues its first tile's weight loads before it waits for FC1 (its CTAs that start beside FC1's
    tail stream weights then), and FC1 lets FC2 launch only after its own wait for the routing has
    returned (drop v34; measured on H200: 0-3.6 % faster at T = 1 to 1024, outputs bitwise equal;
    TUNING.md, "Session 23").

    ``mma_overlap`` (default on; drop v47): the grouped GEMMs issue a K tile's WGMMAs before they wait for the
    previous tile's, as they were written to; off, each tile's WGMMAs are waited for before the next stage is
    taken, which is what drops up to v46 did in effect (a branch around the WGMMAs made ptxas close each batch
    with an empty one). Output-neutral. TUNING.md, "Session 35".
    """

    tile_m: int = 128
    fc1_tile_n: int = 256
    fc2_tile_n: int = 256
    fc1_stages: int | None = None
    fc2_stages: int | None = None
    num_sms: int = 132
    cluster_m: int = 1
    fc1_tiled: bool = True
    gather_in_fc1: bool = True
    fc1_split_n: bool = False
    fc2_early_weights: bool = True
    decode_fused: bool = False
    decode_warps: int = 16
    decode_stages: int = 4
    decode_k_warps: int | None = None
    pair_blocks: bool = False
    pair_combine: bool = False
    mma_overlap: bool = True


def widest_tile(n: int, widest: int = 256) -> int:
    """The widest N tile (of 256, 128, 64, at most ``widest``) that divides ``n``."""
    return next(t for t in (256, 128, 64) if t <= widest and n % t == 0)


def default_bf16_knobs(geometry: Geometry) -> Bf16Knobs:
    """The widest N tiles (256, 128, 64) that divide the problem, with 128-row M tiles: the fastest
    prefill shape measured on the H200 (TUNING.md); other knobs at their defaults."""
    return Bf16Knobs(fc1_tile_n=widest_tile(geometry.fc1_rows), fc2_tile_n=widest_tile(geometry.hidden))


def split_fc1_pays(geometry: Geometry, knobs: Bf16Knobs) -> bool:
    """Whether ``fc1_split_n`` pays at T = 1 (whether it is valid is ``Bf16Frontend.check``'s): one token
    touches ``top_k`` experts, so FC1 runs ``top_k * N1 / fc1_tile_n`` CTAs; the split pays while twice
    that still fits the persistent grid (qwen3-30b-a3b: 48 -> 96 of 132; qwen3-235b-a22b 96 and
    deepseek-v3 128 do not double)."""
    return 2 * geometry.top_k * (2 * geometry.intermediate // knobs.fc1_tile_n) <= knobs.num_sms


#: the hidden size from which the prefill bucket waits for each WGMMA batch (``mma_overlap=False``)
SERIAL_MMA_MIN_HIDDEN = 7168


def mma_overlap_pays(geometry: Geometry) -> bool:
    """Whether the prefill GEMMs keep a WGMMA batch in flight (``mma_overlap``). Measured (TUNING.md,
    session 35, H100, outputs bitwise equal, three runs): on qwen3-30b-a3b and qwen3-235b-a22b 0.3-5 % faster
    at T = 1024-16384; on deepseek-v3 (H = 7168, the only contract that large, power-capped there) 3-34 %
    slower at T = 4096-16384, equal at 2048. A measured split of the contracts, not a model."""
    return geometry.hidden < SERIAL_MMA_MIN_HIDDEN


class Bf16Frontend(KernelFrontend):
    #: the combine wires the kernel has (world size 1: none, bf16 y)
    combine_wires: tuple[str, ...] = ("bf16",)
    kernel_family = "moe_bf16_glu"

    def __init__(self, geometry: Geometry, knobs: Bf16Knobs | None = None, **kw: Any) -> None:
        super().__init__(geometry, knobs or default_bf16_knobs(geometry), **kw)

    @property
    def gated(self) -> bool:
        return self.geometry.gated

    def check_glu_problem(self, local_experts: int) -> None:
        """Rules of every BF16 GLU kernel (world size 1 and EP): activation, sizes, N tiles."""
        k = self.knobs
        check_glu_geometry(
            self.geometry, k.fc1_tile_n, k.fc2_tile_n, local_experts, "BF16", combine_wires=self.combine_wires
        )

    def check_tiles(self) -> None:
        """The M tile rules of the grouped GEMM (world size 1 and EP); N tiles: ``check_glu_problem``."""
        k = self.knobs
        if k.tile_m not in (64, 128, 256):
            raise ValueError(f"tile_m must be 64, 128 or 256, got {k.tile_m}")
        if k.tile_m == 256 and 256 in (k.fc1_tile_n, k.fc2_tile_n):
            raise ValueError("tile_m=256 with a 256-wide N tile spills registers (5x slower); use a 128-wide N tile")

    def check(self) -> None:
        k = self.knobs
        self.check_glu_problem(self.geometry.num_experts)
        self.check_tiles()
        if k.cluster_m not in (1, 2):
            raise ValueError(f"cluster_m must be 1 or 2, got {k.cluster_m}")
        if k.fc1_split_n and not (self.gated and k.fc1_tile_n == 256 and k.cluster_m == 1):
            raise ValueError("fc1_split_n needs a gated activation, fc1_tile_n=256 and cluster_m=1")
        if k.decode_warps not in kh.constants.DECODE_WARPS:
            raise ValueError(f"decode_warps must be one of {kh.constants.DECODE_WARPS}, got {k.decode_warps}")
        if k.decode_k_warps is not None and (
            k.decode_k_warps not in kh.constants.DECODE_K_WARPS or k.decode_k_warps > k.decode_warps
        ):
            raise ValueError(
                f"decode_k_warps must be one of {kh.constants.DECODE_K_WARPS} and at most decode_warps="
                f"{k.decode_warps}, got {k.decode_k_warps} (None: all of them)"
            )
        if k.decode_stages < 2:
            raise ValueError(f"decode_stages must be 2 or more, got {k.decode_stages}")
        if k.pair_blocks and not (k.gather_in_fc1 and k.cluster_m == 1):
            raise ValueError("pair_blocks needs gather_in_fc1=True and cluster_m=1")
        self.check_pair_blocks()
        smem = kh.decode_shared_bytes(k.decode_warps, k.decode_stages, self.geometry.top_k)
        if smem > kh.SM90_SMEM_BYTES:
            raise ValueError(
                f"decode_warps={k.decode_warps} with decode_stages={k.decode_stages} needs {smem} bytes of shared "
                f"memory (at most {kh.SM90_SMEM_BYTES}): fewer stages"
            )
        if k.decode_fused and self.decode_max_tokens < 1:
            raise ValueError(
                f"decode_fused takes T * top_k <= {kh.constants.DECODE_MAX_PAIRS}; top_k={self.geometry.top_k}"
            )

    @property
    def launch_token_limit(self) -> tuple[int, str, str] | None:
        """``decode_fused``'s pair limit, else ``pair_blocks``' workspace rows (``KernelFrontend``)."""
        if self.knobs.decode_fused:
            return self.decode_max_tokens, "decode_fused", f"T * top_k <= {kh.constants.DECODE_MAX_PAIRS}"
        return super().launch_token_limit

    @property
    def decode_max_tokens(self) -> int:
        """The most tokens a ``decode_fused`` launch takes (``T * top_k <= DECODE_MAX_PAIRS``)."""
        return kh.constants.DECODE_MAX_PAIRS // self.geometry.top_k

    def _export(self, out_dir: Path, function_name: str) -> Path:
        g, k = self.geometry, self.knobs
        kernel = kh.Sm90MegaMoEBf16Kernel(
            **self.glu_kwargs(),
            fc1_stages=k.fc1_stages,
            fc2_stages=k.fc2_stages,
            cluster_m=k.cluster_m,
            fc1_tiled=k.fc1_tiled,
            gather_in_fc1=k.gather_in_fc1,
            fc1_split_n=k.fc1_split_n,
            fc2_early_weights=k.fc2_early_weights,
            decode_fused=k.decode_fused,
            decode_warps=k.decode_warps,
            decode_stages=k.decode_stages,
            decode_k_warps=k.decode_k_warps,
            pair_blocks=k.pair_blocks,
            pair_combine=k.pair_combine,
            mma_overlap=k.mma_overlap,
        )
        return kh.export_moe_bf16(kernel, g.hidden, g.intermediate, g.num_experts, g.top_k, out_dir, function_name)

    def workspace_spec(self, max_tokens: int) -> list[Any]:
        g = self.geometry
        k = self.knobs
        counters = kh.pair_combine_counters(g.num_experts, g.top_k, g.hidden, k.fc2_tile_n) if k.pair_combine else 0
        return kh.moe_bf16_workspace_spec(
            max_tokens, g.hidden, g.intermediate, g.num_experts, g.top_k, k.tile_m, k.num_sms, k.cluster_m, counters
        )

    @property
    def fc1_tiled(self) -> bool:
        """w13 is stored tiled (``Bf16Knobs.fc1_tiled``)."""
        return self.knobs.fc1_tiled

    def prepare_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Natural layouts in (``w13`` gate rows then up rows) -> the kernel's layouts: w13 gate/up
        interleaved per FC1 tile, and with ``fc1_tiled`` tiled ([E, N/tile, H/64, tile, 64])."""
        if self.gated:
            w13 = kh.interleave_gate_up(w13, self.knobs.fc1_tile_n)
        if self.fc1_tiled:
            w13 = kh.tile_weights(w13, self.knobs.fc1_tile_n, kh.constants.TILE_K)
        return w13.contiguous(), w2.contiguous()

    def launch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        out: torch.Tensor,
        workspace: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Enqueue the whole layer on the current torch stream (no host sync)."""
        self._check_launch(x)
        self.check_workspace_tokens(x.shape[0], workspace)
        fn = self.load()
        fn(x, topk_ids, topk_weights, w13, w2, out, *workspace.values())
        return out

    def _check_launch(self, x: torch.Tensor) -> None:
        """T within the knob set's per-launch limit (``launch_token_limit``); ``decode_fused``: its grid
        co-resident (a grid barrier)."""
        self.check_launch_tokens(x.shape[0])
        if self.knobs.decode_fused:
            self.check_grid_coresident(x, "decode_fused")


__all__ = ["Bf16Frontend", "Bf16Knobs", "default_bf16_knobs"]
