"""The block-scaled frontend core (MXFP8 and NVFP4 share it): ``Sm90MegaMoEQuantKernel`` through the
shared frontend core. ``mxfp8.py`` and ``nvfp4.py`` only name their format.

Weights arrive in the layout of ``flashinfer.moe_ep.core.reference_quant.QuantizedExpertWeights``
(data [E, rows, K] or packed [E, rows, K/2], block scales [E, rows, K/block], NVFP4 global scales [E])
and are packed once by :meth:`QuantFrontend.prepare_weights` (gate/up interleave, then per K tile
the rows' data and scale bytes as two TMA-friendly runs, see the drop's ``moe_quant_glu.weights``).
The token buckets of a layer share that layout; ``swap_ab`` (the swap-AB GEMMs) reads it too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from . import kernel_helpers as kh
from .bf16 import widest_tile
from .frontend import Geometry, KernelFrontend, check_glu_geometry

#: the deepest stagger accepted (the swap-AB ring has at most 8 stages; the kernel caps it at half)
MAX_SWAP_STAGGER = 8
#: accumulator and A-fragment words a thread of a four-warpgroup swap-AB CTA holds without spilling
#: (measured on the built libraries: 2 atoms at 32 tokens and 1 atom at 128 fit, 2 atoms at 64 spill)
SWAP_WG4_WORDS = 96


#: the most CTAs a portable cluster holds: ``gemv_pair_cluster`` puts a token's top_k pairs in one
PAIR_CLUSTER_MAX = 8


@dataclass(frozen=True)
class QuantKnobs:
    """Compile-time knobs of the quantized kernel (output-neutral but for ``swap_split_k``'s summation
    order). ``swap_ab``: the swap-AB GEMMs
    (weights dequantized in registers, tokens as WGMMA N); ``tile_m`` is then the token tile,
    ``swap_wg`` the most consumer warpgroups per CTA (1, 2, or 4 with ``swap_atoms`` 2 or 1) and
    ``swap_atoms`` the most WGMMA atoms (64 weight rows) per warpgroup (4, or 2 or 1: fewer rows per
    warpgroup, so more warpgroups or CTAs convert the same weights); ``swap_stagger`` the K tiles (0
    to 8, the kernel caps it at half its ring) by which the second consumer warpgroup of a CTA of two
    trails the first (0: lock step; CTAs of one or four warpgroups ignore it), so the two do not
    convert, multiply and run their epilogues at the same moments. ``swap_narrow`` (``swap_ab``; drop v49; off by
    default, on in the backend's ``swap32`` / ``swap64`` buckets): a token tile whose real tokens fit 64, 32 or 16
    columns runs that narrower WGMMA (each expert's last tile holds its remainder). ``swap_tma_store`` (``swap_ab``,
    world size 1; drops v50-v51; off by default, on in the backend's NVFP4 ``swap128``): FC2's swap-AB epilogue
    stages each 8-token group of a warp's 32 or 64 features in shared memory and writes it with one TMA store (FC1
    keeps the register stores); refused with ``swap_wg`` 4 or ``swap_atoms`` 1 (four 1-atom warpgroups stored
    wrong results on the H200, TUNING.md "Session 38"). ``gather_in_fc1`` (``swap_ab``,
    world size 1): each token's activation row is prepared once and the swap-AB FC1 loads its token
    columns from there through the row map, instead of a prepared copy per pair. ``swap_split_k``
    (``swap_ab``, world size 1; 1, 2 or 4): where that many K parts of every CTA tile of a swap-AB GEMM
    fit one wave of the grid (decoding few tokens) and keep ``SWAP_SPLIT_MIN_K_TILES`` (16) K tiles each,
    each part runs on its own CTA and the last one sums them in part order; else the tiles run whole.
    It changes the fp32 summation order of K where it splits (deterministic for a given T).
    ``fc2_early_weights`` (``swap_ab``, world size 1): the swap-AB FC2 issues its first work unit's
    weight loads before it waits for FC1, and FC1 lets FC2 launch only after its own wait.
    ``fc1_early_weights`` (``swap_ab`` without ``gather_in_fc1``, world size 1): the same for FC1 behind
    the activation gather. ``gather_early_rows`` (world size 1): the activation gather loads and quantizes
    its first items before it waits for the routing. ``gemv`` (``swap_ab`` with 8 or 16-token tiles, world
    size 1): FC1 and FC2 as the drop's expert GEMV (``moe_quant_glu.gemv``: every warp streams its
    weight rows into shared memory with ``cp.async`` and multiplies them with ``mma.sync``; for decode),
    ``gemv_k_warps`` warps per CTA splitting K (2, 4, 8, 16), ``gemv_stages`` the depth of each warp's
    ring (2+; warps times stages are bounded by shared memory); the early-weight knobs apply to it alike.
    ``gemv_fc1_k_warps`` (with ``gemv``; drop v53; None: ``gemv_k_warps``): FC1's warps per GEMV CTA alone, so
    FC1's K chain (H / unit units per CTA, each warp one ``cp.async`` round trip per unit) can be split over more
    warps while FC2's CTAs keep their size and occupancy.
    ``gemv_early_ring`` (with ``gemv`` and ``fc2_early_weights``; drop v54): FC2's GEMV copies its whole ring's
    weights before it waits for FC1 (every stage, not all but the last); the results do not change.
    ``gemv_l2_prefetch`` (with ``gemv``; drop v52; off: 8-14 % slower in ``gemv8``, TUNING.md session 40): every GEMV
    warp requests its later K units' weight rows and scales into L2 with bulk prefetches once it knows its
    expert (FC2 with ``fc2_early_weights`` before it waits for FC1), so the slice streams from DRAM at once;
    the results do not change.
    ``pair_blocks`` (with ``gemv``, world size 1; drop v45): the GEMVs' pair chain for one token: M block b
    is pair b of ``topk_ids``, FC1 prepares its token's row itself (no routing, no gather kernel), so
    FC1 is the layer's first kernel (``fc1_early_weights`` and ``gather_early_rows`` off); it serves
    ``T * top_k <= num_experts`` (the workspace's rows; ``launch_token_limit``). ``pair_combine`` (with
    ``pair_blocks``): FC2 combines the pairs itself (the combine kernel's bits), no combine kernel.
    ``gemv_pair_cluster`` (with ``pair_combine``, ``top_k <= 8``; drop v56): FC2's ``top_k`` CTAs of a token's row
    warp run as one cluster and combine in its rank-0 CTA's shared memory (the same bits; no y rows, counters or
    atomics). ``gemv_row_tma`` (with ``pair_blocks``, BF16 activations; drop v57): FC1 requests its token's BF16 row
    into shared memory with one bulk copy right after its wait, ahead of the ``topk_ids`` read and its weight
    copies, and quantizes it there (the same values). ``gemv_fused`` (with ``pair_combine``; drop v58): the pair
    chain as one persistent launch of ``num_sms`` CTAs of ``gemv_k_warps`` warps and ``gemv_stages``-deep rings, each
    CTA an equal share of FC1's and then FC2's weight items, a grid barrier between them (FC2's first weights
    already in flight); it sums K in another order than the two-kernel chain and serves ``T * top_k <= num_sms``
    (``gemv_fc1_k_warps``, ``gemv_pair_cluster``, ``gemv_row_tma``, ``gemv_l2_prefetch``, ``gemv_early_ring`` and
    ``fc2_early_weights`` do not apply to it and are refused). It is slower than the two-kernel chain (1.4-1.8x its
    time at qwen3-30b-a3b T = 1 on an H100, TUNING.md sessions 52-53), so no bucket uses it."""

    tile_m: int = 128
    fc1_tile_n: int = 256
    fc2_tile_n: int = 256
    fc1_stages: int | None = None
    fc2_stages: int | None = None
    num_sms: int = 132
    swap_ab: bool = False
    swap_wg: int = 2
    swap_atoms: int = 4
    swap_stagger: int = 0
    swap_narrow: bool = False
    swap_tma_store: bool = False
    gather_in_fc1: bool = False
    swap_split_k: int = 1
    fc2_early_weights: bool = False
    fc1_early_weights: bool = False
    gather_early_rows: bool = False
    gemv: bool = False
    gemv_k_warps: int = 4
    gemv_stages: int = 2
    gemv_fc1_k_warps: int | None = None
    gemv_l2_prefetch: bool = False
    gemv_early_ring: bool = False
    pair_blocks: bool = False
    pair_combine: bool = False
    gemv_pair_cluster: bool = False
    gemv_row_tma: bool = False
    gemv_fused: bool = False

    @property
    def grid(self) -> int:
        """CTAs of the persistent GEMM grids (one wave)."""
        return self.num_sms


def default_quant_knobs(geometry: Geometry) -> QuantKnobs:
    return QuantKnobs(fc1_tile_n=widest_tile(geometry.fc1_rows), fc2_tile_n=widest_tile(geometry.hidden))


@dataclass
class PackedQuantWeights:
    """The kernel's weight operands: packed data and scale bytes of both matrices, fp32 global scales
    (ones for MXFP8)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_gscale: torch.Tensor
    w2_gscale: torch.Tensor


class QuantFrontend(KernelFrontend):
    fmt: ClassVar[str]
    #: the combine wires the kernel has (world size 1: none, bf16 y)
    combine_wires: tuple[str, ...] = ("bf16",)

    def __init__(self, geometry: Geometry, knobs: QuantKnobs | None = None, **kw: Any) -> None:
        super().__init__(geometry, knobs or default_quant_knobs(geometry), **kw)

    @property
    def prequantized(self) -> bool:
        """``hidden_states`` arrive as codes and block scales of the format (``Geometry.input_format``)."""
        return self.geometry.input_format == self.fmt

    @property
    def gated(self) -> bool:
        return self.geometry.gated

    @property
    def local_experts(self) -> int:
        """Experts of this rank (the EP frontend splits ``geometry.num_experts`` over the ranks)."""
        return self.geometry.num_experts

    @functools.cached_property
    def fc1_tiles_per_expert(self) -> int | None:
        """CTA tiles of the swap-AB FC1 over one expert's rows (None without ``swap_ab``): its CTAs cover
        ``64 * atoms * warpgroups`` weight rows (``swap_tile_plan``). Cached: the bucket choice reads it
        per forward."""
        k, rows = self.knobs, self.geometry.fc1_rows
        if not k.swap_ab or k.gemv:
            return None
        atoms, wg = kh.swap_tile_plan(rows, self.gated, k.tile_m, k.swap_wg, k.swap_atoms)
        return rows // (64 * atoms * wg)

    def fc1_cta_tiles(self, busy_experts: int) -> int | None:
        """CTA tiles of the swap-AB FC1 when ``busy_experts`` experts hold one token tile each (None
        without ``swap_ab``)."""
        per = self.fc1_tiles_per_expert
        return None if per is None else busy_experts * per

    def fc1_splits_into(self, parts: int) -> bool:
        """Whether the swap-AB FC1's K (H) splits into ``parts`` parts at all: each keeps
        ``SWAP_SPLIT_MIN_K_TILES`` K tiles (the kernel's trace-time rule; shorter K runs whole)."""
        c = kh.constants
        return self.geometry.hidden // c.TILE_K // parts >= c.SWAP_SPLIT_MIN_K_TILES

    def check(self) -> None:
        k = self.knobs
        check_glu_geometry(
            self.geometry, k.fc1_tile_n, k.fc2_tile_n, self.local_experts, self.fmt, ("bf16", self.fmt),
            self.combine_wires,
        )  # fmt: skip
        if k.swap_wg not in (1, 2, 4) or k.swap_atoms not in (1, 2, 4):
            raise ValueError(f"swap_wg must be 1, 2 or 4 and swap_atoms 1, 2 or 4, got {k.swap_wg} and {k.swap_atoms}")
        if k.gemv:  # first: its tile rule differs from the swap-AB GEMMs'
            self._check_gemv()
        self._check_pairs()
        if not 0 <= k.swap_stagger <= MAX_SWAP_STAGGER:
            raise ValueError(f"swap_stagger must be 0 to {MAX_SWAP_STAGGER} K tiles, got {k.swap_stagger}")
        if k.swap_ab and not k.gemv:
            tiles = kh.constants.SWAP_TOKEN_TILES
            if k.tile_m not in tiles:
                raise ValueError(f"with swap_ab, tile_m must be one of {tiles} for {self.fmt}, got {k.tile_m}")
            if self.gated and k.fc1_tile_n != 256:
                raise ValueError(f"swap_ab needs gate/up rows interleaved per 256 (fc1_tile_n=256), got {k.fc1_tile_n}")
            for rows, gated in ((self.geometry.fc1_rows, self.gated), (self.geometry.hidden, False)):
                atoms, wg = kh.swap_tile_plan(rows, gated, k.tile_m, k.swap_wg, k.swap_atoms)
                # Four warpgroups hold 112 registers a thread: the fp32 accumulators (atoms * tile_m / 2)
                # and two A fragments (32 * atoms words) fit 96 of them. The drop's plan allows 2 atoms at
                # 64 and 128 tokens, which spill (stack 32 B / 1.3 KB, 17x slower; TUNING.md session 22).
                if wg == 4 and atoms * k.tile_m // 2 + 32 * atoms > SWAP_WG4_WORDS:
                    raise ValueError(
                        f"four consumer warpgroups with {atoms} WGMMA atoms spill registers at {k.tile_m}-token "
                        f"tiles (at most {SWAP_WG4_WORDS} accumulator and fragment words a thread): use "
                        "swap_atoms=1, or tile_m <= 32 with 2 atoms"
                    )
        elif not k.swap_ab and k.tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128 for the {self.fmt} kernel, got {k.tile_m}")
        if k.gather_in_fc1 and not k.swap_ab:
            raise ValueError("gather_in_fc1 needs the swap-AB GEMMs (swap_ab=True)")
        if k.swap_narrow and not (k.swap_ab and not k.gemv):
            raise ValueError("swap_narrow needs the swap-AB GEMMs (swap_ab=True, gemv=False)")
        if k.swap_tma_store and not (k.swap_ab and not k.gemv):
            raise ValueError("swap_tma_store needs the swap-AB GEMMs (swap_ab=True, gemv=False)")
        if k.swap_tma_store and (k.swap_wg == 4 or k.swap_atoms == 1):
            # TUNING.md "Session 38": four 1-atom warpgroups (16 features a warp: one stmatrix.x2, 32-byte rows)
            # gave wrong FC2 results that varied run to run on the H200; cause not found. Two warpgroups of 2 or 4
            # atoms passed the reference suite and matched the register stores bit for bit.
            raise ValueError(
                "swap_tma_store is refused with four consumer warpgroups or one WGMMA atom (swap_wg=4 or "
                "swap_atoms=1): four 1-atom warpgroups stored wrong FC2 results on the H200; use swap_wg <= 2 with "
                "swap_atoms 2 or 4, or the register stores (swap_tma_store=False)"
            )
        splits = kh.constants.SWAP_SPLIT_FACTORS
        if k.swap_split_k not in splits:
            raise ValueError(f"swap_split_k must be one of {splits}, got {k.swap_split_k}")
        if k.swap_split_k > 1 and not k.swap_ab:
            raise ValueError("swap_split_k needs the swap-AB GEMMs (swap_ab=True)")
        if k.fc2_early_weights and not k.swap_ab:
            raise ValueError("fc2_early_weights needs the swap-AB GEMMs (swap_ab=True)")
        if k.fc1_early_weights and not (k.swap_ab and not k.gather_in_fc1):
            raise ValueError("fc1_early_weights needs the swap-AB GEMMs (swap_ab=True) without gather_in_fc1")
        for n in (k.fc1_tile_n, k.fc2_tile_n):
            if n not in (64, 128, 256):
                raise ValueError(f"N tiles must be 64, 128 or 256, got {n}")

    def _check_gemv(self) -> None:
        k, g = self.knobs, self.geometry
        if not (k.swap_ab and k.tile_m in (8, 16)) or k.gather_in_fc1 or k.swap_split_k != 1:
            raise ValueError("gemv needs swap_ab=True with tile_m 8 or 16, no gather_in_fc1 and swap_split_k=1")
        fc1_k_warps = k.gemv_k_warps if k.gemv_fc1_k_warps is None else k.gemv_fc1_k_warps
        for name, warps in (("gemv_k_warps", k.gemv_k_warps), ("gemv_fc1_k_warps", fc1_k_warps)):
            if warps not in (2, 4, 8, 16):
                raise ValueError(f"{name} must be 2, 4, 8 or 16, got {warps}")
        if k.gemv_stages < 2:
            raise ValueError(f"gemv_stages must be 2 or more, got {k.gemv_stages}")
        # FC2's CTA (token chunks in the ring); FC1's the same, or with pair_blocks the token row (K = H) instead;
        # gemv_fused's one CTA is checked by _check_gemv_fused
        fc1_row = g.hidden if k.pair_blocks else 0
        ctas = (("gemv_k_warps", k.gemv_k_warps, 0), ("gemv_fc1_k_warps", fc1_k_warps, fc1_row))
        for name, warps, row in () if k.gemv_fused else ctas:
            smem = kh.gemv_shared_bytes(self.fmt, k.tile_m, warps, k.gemv_stages, row)
            if smem > kh.SM90_SMEM_BYTES:
                raise ValueError(
                    f"{name}={warps} with {k.tile_m}-token blocks and gemv_stages={k.gemv_stages} needs {smem} bytes "
                    f"of shared memory (at most {kh.SM90_SMEM_BYTES}): use fewer warps or stages"
                )
        if self.gated and (k.fc1_tile_n != 256 or g.fc1_rows % 256):
            raise ValueError("gemv needs gate/up rows interleaved per 256 (fc1_tile_n=256, 2I a multiple of 256)")
        if g.fc1_rows % 64 or g.hidden % 64:
            raise ValueError(f"gemv needs FC1 rows and H multiples of 64, got {g.fc1_rows} and {g.hidden}")
        unit = kh.constants.TILE_K * (2 if self.fmt == "nvfp4" else 1)  # the GEMV's K unit
        if g.hidden % unit or g.intermediate % unit:
            raise ValueError(
                f"gemv ({self.fmt}) needs H and I multiples of {unit}, got {g.hidden} and {g.intermediate}"
            )

    def _check_pairs(self) -> None:
        k = self.knobs
        if k.gemv_l2_prefetch and not k.gemv:
            raise ValueError("gemv_l2_prefetch needs gemv=True (the GEMV's bulk L2 prefetches)")
        if k.gemv_fc1_k_warps is not None and not k.gemv:
            raise ValueError("gemv_fc1_k_warps needs gemv=True (FC1's GEMV warps)")
        if k.pair_blocks and not k.gemv:
            raise ValueError("pair_blocks needs gemv=True (the GEMV's pair chain)")
        if k.gemv_early_ring and not (k.gemv and k.fc2_early_weights):
            raise ValueError("gemv_early_ring needs gemv=True and fc2_early_weights=True (FC2's early weight copies)")
        if k.gemv_pair_cluster and not k.pair_combine:
            raise ValueError("gemv_pair_cluster needs pair_combine=True (FC2's combine of the pairs)")
        if k.gemv_pair_cluster and self.geometry.top_k > PAIR_CLUSTER_MAX:
            raise ValueError(
                f"gemv_pair_cluster: a cluster holds at most {PAIR_CLUSTER_MAX} CTAs, top_k={self.geometry.top_k}"
            )
        if k.gemv_row_tma and not (k.pair_blocks and not self.prequantized):
            raise ValueError(
                "gemv_row_tma needs pair_blocks=True and BF16 activations (it bulk-copies FC1's BF16 token row; "
                "prequantized_input layers prepare theirs from the codes)"
            )
        if k.pair_blocks and (k.fc1_early_weights or k.gather_early_rows):
            raise ValueError(
                "pair_blocks makes FC1 the layer's first kernel (it reads topk_ids after its wait, and there is no "
                "gather): set fc1_early_weights=False and gather_early_rows=False"
            )
        if k.gemv_fused:
            self._check_gemv_fused()
        self.check_pair_blocks()

    def _check_gemv_fused(self) -> None:
        k, g = self.knobs, self.geometry
        if not k.pair_combine:
            raise ValueError("gemv_fused needs pair_combine=True (the GEMV pair chain in one launch)")
        unused = [
            name
            for name, on in (
                ("gemv_fc1_k_warps", k.gemv_fc1_k_warps is not None),
                ("gemv_pair_cluster", k.gemv_pair_cluster),
                ("gemv_row_tma", k.gemv_row_tma),
                ("gemv_l2_prefetch", k.gemv_l2_prefetch),
                ("gemv_early_ring", k.gemv_early_ring),
                ("fc2_early_weights", k.fc2_early_weights),
            )
            if on
        ]
        if unused:
            raise ValueError(
                f"gemv_fused runs FC1 and FC2 in one grid of gemv_k_warps warps a CTA; {', '.join(unused)} do not "
                "apply: leave them unset"
            )
        smem = kh.gemv_fused_shared_bytes(k.gemv_k_warps, k.gemv_stages, g.hidden, g.intermediate)
        if smem > kh.SM90_SMEM_BYTES:
            raise ValueError(
                f"gemv_fused with gemv_k_warps={k.gemv_k_warps} and gemv_stages={k.gemv_stages} needs {smem} bytes of "
                f"shared memory at H={g.hidden}, I={g.intermediate} (at most {kh.SM90_SMEM_BYTES}): use fewer warps "
                "or stages"
            )

    @property
    def launch_token_limit(self) -> tuple[int, str, str] | None:
        """``pair_blocks``' limit; with ``gemv_fused`` also ``T * top_k <= num_sms`` (a CTA's range then spans
        at most two pairs)."""
        k, g = self.knobs, self.geometry
        if k.gemv_fused:
            most = min(self.pair_blocks_max_tokens, k.num_sms // g.top_k)
            return most, "gemv_fused", "T * top_k <= num_experts and <= num_sms"
        return super().launch_token_limit

    def kernel_kwargs(self) -> dict[str, Any]:
        """The constructor keywords of the drop's block-scaled kernels that this frontend fixes (the
        world-size-1 and the EP kernel share them)."""
        k = self.knobs
        return {
            "fmt": self.fmt,
            **self.glu_kwargs(),
            "fc1_stages": k.fc1_stages,
            "fc2_stages": k.fc2_stages,
            "swap_ab": k.swap_ab,
            "swap_wg": k.swap_wg,
            "swap_atoms": k.swap_atoms,
            "swap_stagger": k.swap_stagger,
            "swap_narrow": k.swap_narrow,
            "prequantized": self.prequantized,
        }

    def _export(self, out_dir: Path, function_name: str) -> Path:
        g = self.geometry
        k = self.knobs
        kernel = kh.Sm90MegaMoEQuantKernel(
            **self.kernel_kwargs(),
            gather_in_fc1=k.gather_in_fc1,
            swap_split_k=k.swap_split_k,
            fc2_early_weights=k.fc2_early_weights,
            fc1_early_weights=k.fc1_early_weights,
            gather_early_rows=k.gather_early_rows,
            gemv=k.gemv,
            gemv_k_warps=k.gemv_k_warps,
            gemv_stages=k.gemv_stages,
            pair_blocks=k.pair_blocks,
            pair_combine=k.pair_combine,
            swap_tma_store=k.swap_tma_store,
            gemv_l2_prefetch=k.gemv_l2_prefetch,
            gemv_fc1_k_warps=k.gemv_fc1_k_warps,
            gemv_early_ring=k.gemv_early_ring,
            gemv_pair_cluster=k.gemv_pair_cluster,
            gemv_row_tma=k.gemv_row_tma,
            gemv_fused=k.gemv_fused,
        )
        return kh.export_moe_quant(kernel, g.hidden, g.intermediate, g.num_experts, g.top_k, out_dir, function_name)

    def workspace_spec(self, max_tokens: int) -> list[Any]:
        g, k = self.geometry, self.knobs
        counters = (
            kh.pair_combine_counters(g.num_experts, g.top_k, g.hidden, kh.constants.GEMV_ROW_WARP_ROWS)
            if k.pair_combine
            else 0
        )
        return kh.moe_quant_workspace_spec(
            max_tokens, g.hidden, g.intermediate, g.num_experts, g.top_k, k.tile_m, k.num_sms, k.gather_in_fc1,
            k.swap_split_k, counters, k.gemv_fused,
        )  # fmt: skip

    def prepare_weights(
        self,
        w13: torch.Tensor,
        w13_scale: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
        w13_global_scale: torch.Tensor | None = None,
        w2_global_scale: torch.Tensor | None = None,
    ) -> PackedQuantWeights:
        """Checkpoint layouts (gate rows then up rows) -> the kernel's packed operands."""
        p13, p2 = kh.pack_quantized_weights(w13, w13_scale, w2, w2_scale, self.fmt, self.knobs.fc1_tile_n, self.gated)
        e = w13.shape[0]

        def gscale(g: torch.Tensor | None) -> torch.Tensor:
            if g is None:
                return torch.ones(e, dtype=torch.float32, device=w13.device)
            return g.to(torch.float32).contiguous()

        return PackedQuantWeights(*p13, *p2, gscale(w13_global_scale), gscale(w2_global_scale))

    def launch(
        self,
        x: torch.Tensor,
        x_scale: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        weights: PackedQuantWeights,
        act_gscale: torch.Tensor,
        out: torch.Tensor,
        workspace: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Enqueue the whole layer on the current torch stream (no host sync). ``x``: bf16 [T, H], or for
        a pre-quantized geometry the codes as uint8 ([T, H] E4M3, [T, H/2] E2M1 pairs) with their block
        scales in ``x_scale`` (uint8 [T, H/32] UE8M0, [T, H/16] E4M3); otherwise ``x_scale`` is any
        uint8 tensor (not read). ``act_gscale``: fp32 [2], the NVFP4 global scales of the FC1 and FC2
        inputs (ignored by MXFP8)."""
        self.check_launch_tokens(x.shape[0])
        if self.knobs.gemv_fused:
            self.check_grid_coresident(x, "gemv_fused")
        self.check_workspace_tokens(x.shape[0], workspace)
        fn = self.load()
        fn(
            x,
            x_scale,
            topk_ids,
            topk_weights,
            weights.w13,
            weights.w13_scale,
            weights.w2,
            weights.w2_scale,
            weights.w13_gscale,
            weights.w2_gscale,
            act_gscale,
            out,
            *workspace.values(),
        )
        return out


__all__ = ["PackedQuantWeights", "QuantFrontend", "QuantKnobs", "default_quant_knobs"]
