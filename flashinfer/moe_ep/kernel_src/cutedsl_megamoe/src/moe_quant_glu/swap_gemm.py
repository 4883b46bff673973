"""Grouped GEMM with block-scaled weights, swap-AB: weights dequantized in registers. Same routing,
M-block map and packed weights as ``dequant_gemm``.

The shared-memory dequantization of ``dequant_gemm`` (convert into a BF16 tile, fence, barrier, then
WGMMA) puts the conversion on every warpgroup's critical path and costs shared-memory bandwidth (the
converted tile is written, then read by both warpgroups). Here the weights are the A operand (64
weight rows per WGMMA atom, ``M``) and the tokens the B operand (``N = tok_tile``, 16 to 128; few
tokens per expert at decode, where the time is the weight stream; 64 and 128 for larger batches):

- producer warp: per K tile (64), one TMA box of the packed weight data of the CTA's rows, one of
  their scale bytes, and the ``tok_tile x 64`` BF16 activation tile of the M block;
- ``gather_b`` (FC1 at world size 1): the activation tile comes straight from the token rows
  ``x_rows`` (the tokens quantized-dequantized once each, not once per pair) through ``row_token``,
  so no per-pair copy of the activations is written and read back. The whole producer warpgroup
  loads it with 16-byte ``cp.async`` into the 128-byte-swizzled B stage, as the BF16 kernel's
  ``grouped_gemm`` does for its A rows (``gather_a``); padding columns are not loaded (their
  outputs are never read);
- consumer warpgroups (one, two or four, each owning ``64 * atoms`` weight rows; four hold 112
  registers a thread, ``host_utils.SWAP_WG_REGS``, so 2 or 1 atoms): ``ldmatrix`` of the
  packed data straight into the lane layout of a WGMMA A fragment (``weights.SEGMENT_ORDER``),
  dequantized in registers to BF16 (the same exact conversion as ``dequant_gemm``), then WGMMA
  with A from registers. Two fragments alternate: K tile k is converted while WGMMA k-1 runs;
  ``wait_group(1)`` after WGMMA k frees fragment k-1 and its ring stage. No barrier between the
  warpgroups, no shared-memory round trip.
- staggered consumers (``stagger`` > 0, two warpgroups): both warpgroups read every ring stage (the
  same tokens, their own weight rows), so in lock step they convert, multiply and run their
  epilogues at the same moments. The second one starts ``stagger`` K tiles behind the first (one
  named barrier, once per CTA); the ring keeps that lag from tile to tile. Measured (TUNING.md,
  session 16): it pays where the conversion's instructions and their latency bound the GEMM (NVFP4,
  16-token tiles: the two warpgroups' conversions no longer contend for the same issue slots at the
  same moments), not at prefill, where the epilogue competes for those slots rather than leaving
  tensor-core time to fill.

Narrow tiles (``narrow``): an M block's real tokens come first in its token tile, and an expert's last
block holds its remainder (at 128-token tiles and 256 +- 16 pairs per expert, about half the experts
have a third tile of some 13 tokens). Such a tile runs the narrowest WGMMA of 64, 32 or 16 columns that
holds its real tokens (one choice per tile, the same in every thread), over the first rows of its
token stage and the first accumulators of each atom: a WGMMA's fragment of N columns is the prefix of
the one of 2N. The conversion, the loads and the epilogue do not change. Each width's branch holds its
own ``commit_group`` (see ``_wgmma_at_width``).

Early weights (``early_w``, FC2): the weight data and scales do not depend on FC1, so the producer
warp issues their loads for its first work unit's first ring stages before ``griddepcontrol.wait``,
and the token tile (FC1's output) after it, as the BF16 ``grouped_gemm``'s ``early_b`` does; FC1 then
triggers its dependents after its own wait (``trigger_after_wait``), so the routing's block map read
before the wait is complete.

Split K (``split_k`` 2 or 4): at decode the CTA tiles (weight rows x one token tile) are fewer than
the SMs, and each CTA's serial K loop, not the weight bytes, bounds the GEMM (TUNING.md, session 19).
When ``s * tiles`` fits the grid (checked at run time, s = ``split_k`` or 2) and each part keeps
``SWAP_SPLIT_MIN_K_TILES`` K tiles (checked at trace time), each tile is cut into s K ranges, one per
CTA. Every part stores its fp32 accumulators to ``split_ws`` (slot = work unit, at most one per CTA:
the split only runs in one wave), then counts itself in ``split_count`` (one counter per tile and
warpgroup); the last to arrive sums the s parts in part order (so the result does not depend on
which part finishes last), zeroes the counter for the next call and runs the epilogue. No CTA waits
for another, so no co-scheduling is assumed. Otherwise the tile runs whole, as without the knob.

The epilogue runs per group of 8 token columns (per 4 groups where the requantization's amax
crosses warps: one exchange through shared memory for the 4), and only for groups that hold a real
row of the M block (``m_block_expert``'s row count): at decode a 16-token tile holds one or a few
tokens, so the activation, requantization and stores of its padding columns are skipped (their
outputs are never read: FC2's padding columns, like ``gather_b``'s, see stale rows, which no real
column mixes with).

Which weight rows a thread holds is free (``ldmatrix`` takes a row address per lane), so the
tiling uses the packed layout of the prefill kernel unchanged and picks rows for the epilogue:

- gated FC1 (gate/up interleaved per 256 rows, ``weights.pack_quantized_weights``): the 128
  features of a 256-row block go to ``4 / atoms`` warpgroups (4 atoms: one; 2: two of 64 features;
  1: four of 32); atom a / row half h / lane row i of warp w reads gate (h = 0) or up (h = 1) of the
  warpgroup's feature ``(w * atoms + a) * 8 + i``, so the activation pairs up in-thread;
- otherwise (FC2, relu2): output feature = row ``(w * 2 * atoms + 2a + h) * 8 + i``.

Each warp thus owns 8-row groups of output features (``atoms`` per gated warp, ``2 * atoms``
otherwise). The requantization amax of a block (MXFP8 32 features, NVFP4 16: 4 or 2 groups) is
in-thread over the groups, then over the 8 lanes of a column (shuffles 4, 8, 16); where a block is
wider than a warp's groups (gated MXFP8 with 2 atoms: two warps; gated with 1 atom: four for MXFP8,
two for NVFP4) the warps trade their partial amax
through shared memory (one named barrier per warpgroup). Results are stored from registers, two
features per 32-bit store (lanes i and i ^ 1 swap one column).

Staged stores (``tma_store``, the plain epilogue: a warp's ``8 * groups`` output features, 16 to 64, are one
row of S = 32 to 128 bytes per token): a column group's 8 tokens x the warp's features go from registers to a
buffer of the warp (8 S bytes) by transposing ``stmatrix`` (each 8 x 8 matrix of the accumulator fragment is
a feature row x token pair; ``.trans`` writes token rows), in the TMA swizzle of S bytes (16-byte chunk c of
row r at chunk ``c ^ ((r S / 128) % (S / 16))``), and one TMA store per group writes them to C. Each warp owns
``EPI_TMA_BUFS`` buffers and waits for the store that last read a buffer before it writes it again; no barrier
between warps. Instead of a shuffle and a 32-bit store per feature pair (a warp store: 8 token rows x 16
bytes), ``groups / 4`` ``stmatrix.x4`` (x2 for 2 groups) and one TMA store of whole rows per column group.
"""

# No `from __future__ import annotations`: cute.struct reads its annotations as objects.

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..common import constants
from ..common.host_utils import SWAP_WG_REGS, swap_tile_plan
from ..moe_bf16_glu.grouped_gemm import cp_async_16
from ..src import activations
from ..src import block_quant as bq
from .dequant_gemm import box_inner, packed_view, ring_state

EPI_PLAIN = "plain"
EPI_AMAX_CHUNK = 4  # column groups (8 tokens each) whose cross-warp amax is exchanged at once
STAGGER_BARRIER = 3  # named barrier of the consumer stagger (1 + wg: the amax exchange and the split-K count)
EPI_TMA_BUFS = 2  # tma_store: staging buffers per warp (8 tokens x the warp's features each)


def pack_bf16x2(lo: cutlass.Float32, hi: cutlass.Float32) -> cutlass.Uint32:
    """``lo`` and ``hi`` rounded to BF16 (to nearest even) in one word, ``lo`` in the low half."""
    return cute.arch.inline_ptx(
        "cvt.rn.bf16x2.f32 {$w0}, {$r1}, {$r0};", write_only_types=[cutlass.Uint32], read_only_args=[lo, hi]
    )


def stmatrix_x4_trans(addr: cutlass.Int32, w0, w1, w2, w3) -> None:
    """Four 8 x 8 bf16 matrices to shared memory, transposed: lane t holds row t // 4, columns 2 (t % 4) and
    + 1 of each (word m: matrix m); lanes 8m..8m+7 give the addresses of the stored rows of matrix m (16 bytes
    each: column r of the held matrix)."""
    cute.arch.inline_ptx(
        "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[addr, w0, w1, w2, w3],
    )


def stmatrix_x2_trans(addr: cutlass.Int32, w0, w1) -> None:
    """``stmatrix_x4_trans`` for two matrices (lanes 0-15 give the addresses)."""
    cute.arch.inline_ptx(
        "stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [{$r0}], {{$r1}, {$r2}};", read_only_args=[addr, w0, w1]
    )


class SwapDequantGemmSm90:
    """One grouped GEMM stage (FC1 or FC2) for few tokens per expert; compile-time knobs only."""

    def __init__(
        self,
        fmt: str,
        tok_tile: int,
        epilogue: str,
        limit: float | None,
        num_sms: int,
        ab_stages: int | None = None,
        requant: bool = False,
        gscale_index: int = 0,
        max_wg: int = 2,
        max_atoms: int = 4,
        stagger: int = 0,
        gather_b: bool = False,
        split_k: int = 1,
        early_w: bool = False,
        trigger_after_wait: bool = False,
        narrow: bool = False,
        tma_store: bool = False,
    ) -> None:
        self.tma_store_request = tma_store
        self.tma_store = False  # where the tile plan allows it, set by _setup (the GEMV subclass keeps it off)
        if early_w and gather_b:
            raise ValueError("early_w needs TMA-loaded token tiles (gather_b=False)")
        self.early_w = early_w
        self.trigger_after_wait = trigger_after_wait
        if fmt not in constants.QUANT_FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        if tok_tile not in constants.SWAP_TOKEN_TILES:
            raise ValueError(f"tok_tile must be one of {constants.SWAP_TOKEN_TILES}, got {tok_tile}")
        self.fmt = fmt
        self.tok_tile = tok_tile
        self.epilogue = epilogue
        self.gated = epilogue in constants.GATED_ACTIVATIONS
        if tma_store and not self.gated and (max_wg == 4 or max_atoms == 1):
            # four 1-atom warpgroups stored wrong, run-dependent values (TUNING.md, session 38); four 2-atom
            # warpgroups and one atom in two warpgroups were never validated
            raise ValueError(
                f"tma_store is refused with max_wg={max_wg}, max_atoms={max_atoms}: it takes 1 or 2 consumer "
                "warpgroups of 2 or 4 WGMMA atoms"
            )
        self.limit = limit
        self.num_sms = num_sms
        self.ab_stages_override = ab_stages
        self.requant = requant
        self.gscale_index = gscale_index
        self.max_wg = max_wg
        self.max_atoms = max_atoms
        if stagger < 0:
            raise ValueError(f"stagger must be >= 0 K tiles, got {stagger}")
        self.stagger_request = stagger
        self.gather_b = gather_b
        if split_k not in constants.SWAP_SPLIT_FACTORS:
            raise ValueError(f"split_k must be one of {constants.SWAP_SPLIT_FACTORS}, got {split_k}")
        self.split_k = split_k
        # narrow: WGMMA widths below the token tile, for tiles whose real tokens fit them (halving to 16)
        self.narrow_widths = tuple(w for w in (64, 32, 16) if w < tok_tile) if narrow else ()
        self.tile_k = constants.TILE_K
        self.data_bytes = constants.QUANT_DATA_BYTES[fmt]
        self.scales_per_tile = constants.QUANT_SCALES_PER_TILE[fmt]
        self.segs = self.data_bytes // constants.QUANT_SEGMENT_BYTES
        self.threads_per_wg = 128
        self.acc_dtype = cutlass.Float32
        self.smem_capacity = utils.get_smem_capacity_in_bytes("sm_90")

    # ---------------------------------------------------------------- host-side setup (traced)
    def _setup(self, rows: int) -> None:
        self.atoms, self.num_wg = swap_tile_plan(rows, self.gated, self.tok_tile, self.max_wg, self.max_atoms)
        self.wg_rows = 64 * self.atoms
        self.cta_rows = self.num_wg * self.wg_rows
        self.groups = self.atoms if self.gated else 2 * self.atoms  # 8-feature groups per warp
        self.wg_out = self.wg_rows // 2 if self.gated else self.wg_rows  # output features per warpgroup
        # Row of (atom a, half h) relative to the warpgroup's first row, beyond w * groups * 8 + i.
        self.atom_stride = 8 if self.gated else 16
        self.half_stride = constants.SWAP_GATE_UP_BLOCK // 2 if self.gated else 8
        # Warps whose 8-feature groups make one requantization block (1, or 2 for a gated MXFP8 FC1
        # with 2 atoms): their partial amax meet in shared memory.
        self.block_warps = max(1, constants.QUANT_BLOCK[self.fmt] // 8 // self.groups) if self.requant else 1
        self.amax_bytes = 4 * self.tok_tile * 4 * self.num_wg if self.block_warps > 1 else 0
        # Column groups per amax exchange (two named barriers each) where blocks span warps, else 1.
        self.epi_chunk = min(EPI_AMAX_CHUNK, self.tok_tile // 8) if self.block_warps > 1 else 1
        self.num_threads = (1 + self.num_wg) * self.threads_per_wg
        self.producer_regs, self.consumer_regs = SWAP_WG_REGS[self.num_wg]
        # tma_store in the plain epilogue (a warp's features: 16, 32 or 64 in 2, 4 or 8 groups); gated: register stores
        self.tma_store = self.tma_store_request and not self.gated
        self.epi_feats = self.groups * 8  # a warp's output features, one row of 2 * epi_feats bytes per token
        self.epi_buf_bytes = 8 * self.epi_feats * 2
        self.epi_buffers = 4 * self.num_wg * EPI_TMA_BUFS if self.tma_store else 0

        self.tiled_mma = self._make_mma(self.tok_tile)
        data_bytes = self.cta_rows * self.data_bytes
        scale_bytes = self.cta_rows * self.scales_per_tile
        b_bytes = self.tok_tile * self.tile_k * 2
        if self.ab_stages_override is not None:
            self.ab_stages = self.ab_stages_override
        else:
            free = self.smem_capacity - 4096 - self.amax_bytes - self.epi_buffers * self.epi_buf_bytes
            self.ab_stages = min(8, free // (data_bytes + scale_bytes + b_bytes))
        # The lag leaves the leading warpgroup half the ring at least (its loads in flight).
        self.stagger = min(self.stagger_request, self.ab_stages // 2) if self.num_wg == 2 else 0
        self.data_inner = box_inner(self.cta_rows, self.data_bytes)
        self.scale_inner = box_inner(self.cta_rows, self.scales_per_tile)
        self.data_smem_layout = cute.make_layout((self.data_inner, data_bytes // self.data_inner, self.ab_stages))
        self.scale_smem_layout = cute.make_layout((self.scale_inner, scale_bytes // self.scale_inner, self.ab_stages))
        self.b_smem_layout = sm90_utils.make_smem_layout_b(
            utils.LayoutEnum.ROW_MAJOR, (self.wg_rows, self.tok_tile, self.tile_k), cutlass.BFloat16, self.ab_stages
        )
        self.data_stage_bytes = data_bytes
        self.scale_stage_bytes = scale_bytes
        # tma_store: the warps' staging buffers, (8 tokens, the warp's features) each in the swizzle of its rows
        self.epi_smem_layout = sm90_utils.make_smem_layout_epi(
            cutlass.BFloat16, utils.LayoutEnum.ROW_MAJOR, (8, self.epi_feats), max(1, self.epi_buffers)
        )

    def _make_mma(self, width: int) -> cute.TiledMma:
        """The warpgroup's WGMMA: 64 weight rows (A from registers) x ``width`` tokens (B in shared memory)."""
        return sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16,
            cutlass.BFloat16,
            utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            self.acc_dtype,
            (1, 1, 1),
            tiler_mn=(64, width),
            a_source=warpgroup.OperandSource.RMEM,
        )

    def launch(
        self,
        act: cute.Tensor,  # (M_cap, K) bf16: the permuted activations (B operand)
        w_data: cute.Tensor,  # [E, K/64, N, D] uint8 (weights.pack_quantized_matrix)
        w_scale: cute.Tensor,  # [E, K/64, N, S] uint8
        c: cute.Tensor,  # (M_cap, N_out) bf16
        m_block_expert: cute.Tensor,
        meta: cute.Tensor,
        w_gscale: cute.Tensor,  # (E,) fp32 (NVFP4 weight global scales; unused for MXFP8)
        act_gscale: cute.Tensor,  # (2,) fp32
        stream,
        use_pdl: bool = False,
        x_rows: cute.Tensor | None = None,
        row_token: cute.Tensor | None = None,
        split_ws: cute.Tensor | None = None,
        split_count: cute.Tensor | None = None,
    ) -> None:
        """Trace-time: TMA descriptors, then the persistent kernel on ``stream``. With ``gather_b``,
        ``act`` only sets the operand type: the B rows come from ``x_rows`` [T, K] through ``row_token``
        [M_cap] int32 (no TMA descriptor over ``x_rows``: T may be 0). With ``split_k`` > 1:
        ``split_ws`` fp32 and ``split_count`` int32 as ``common.host_utils.swap_split_workspace`` sizes
        them (``split_count`` zero before the first call; every call leaves it zero)."""
        if cutlass.const_expr(self.split_k > 1):
            if split_ws is None or split_count is None:
                raise ValueError("split_k > 1 needs the split_ws and split_count workspaces")
        else:
            split_ws, split_count = c, meta  # unused placeholders
        self._setup(w_data.shape[2])
        data_one = cute.slice_(self.data_smem_layout, (None, None, 0))
        scale_one = cute.slice_(self.scale_smem_layout, (None, None, 0))
        b_one = cute.slice_(self.b_smem_layout, (None, None, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_w, tma_tensor_w = cpasync.make_tiled_tma_atom(
            g2s, packed_view(w_data, self.data_inner), data_one, cute.shape(data_one)
        )
        tma_s, tma_tensor_s = cpasync.make_tiled_tma_atom(
            g2s, packed_view(w_scale, self.scale_inner), scale_one, cute.shape(scale_one)
        )
        tma_b, tma_tensor_b = cpasync.make_tiled_tma_atom(g2s, act, b_one, (self.tok_tile, self.tile_k))
        self.tma_bytes = self.data_stage_bytes + self.scale_stage_bytes
        epi_one = cute.slice_(self.epi_smem_layout, (None, None, 0))
        if cutlass.const_expr(self.tma_store):
            tma_c, tma_tensor_c = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), c, epi_one, (8, self.epi_feats)
            )
        else:
            tma_c, tma_tensor_c = tma_w, tma_tensor_w  # unused placeholders
        if cutlass.const_expr(not self.gather_b):
            self.tma_bytes += cute.size_in_bytes(cutlass.BFloat16, b_one)
            x_rows, row_token = act, meta  # unused placeholders

        # (token column, warp, warpgroup) partial amax of the cross-warp requantization (one slot if unused)
        self.amax_shape = (self.tok_tile, 4, self.num_wg) if self.amax_bytes else 1

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.b_smem_layout)], 1024]
            sData: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.data_smem_layout)], 1024]
            sScale: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.scale_smem_layout)], 128]
            sAmax: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.size(self.amax_shape)], 16]
            # the split-K count, per consumer warpgroup
            sSplit: cute.struct.MemRange[cutlass.Int32, constants.SWAP_SPLIT_COUNTERS]
            # tma_store: the warps' staging buffers (one unused element otherwise)
            sEpi: cute.struct.Align[
                cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.epi_smem_layout) if self.tma_store else 8],
                1024 if self.tma_store else 16,
            ]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_w,
            tma_tensor_w,
            tma_s,
            tma_tensor_s,
            tma_b,
            tma_tensor_b,
            tma_c,
            tma_tensor_c,
            c,
            m_block_expert,
            meta,
            x_rows,
            row_token,
            split_ws,
            split_count,
            w_gscale,
            act_gscale,
            self.tiled_mma,
            self.data_smem_layout,
            self.scale_smem_layout,
            self.b_smem_layout,
            self.epi_smem_layout,
        ).launch(
            grid=[self.num_sms, 1, 1],
            block=[self.num_threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=use_pdl,
        )

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def kernel(
        self,
        tma_w: cute.CopyAtom,
        mW: cute.Tensor,
        tma_s: cute.CopyAtom,
        mS: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_c: cute.CopyAtom,
        mCt: cute.Tensor,
        mC: cute.Tensor,
        m_block_expert: cute.Tensor,
        meta: cute.Tensor,
        mX: cute.Tensor,
        row_token: cute.Tensor,
        split_ws: cute.Tensor,
        split_count: cute.Tensor,
        w_gscale: cute.Tensor,
        act_gscale: cute.Tensor,
        tiled_mma: cute.TiledMma,
        data_smem_layout: cute.Layout,
        scale_smem_layout: cute.Layout,
        b_smem_layout: cute.ComposedLayout,
        epi_smem_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_w)
            cpasync.prefetch_descriptor(tma_s)
            if cutlass.const_expr(not self.gather_b):
                cpasync.prefetch_descriptor(tma_b)
            if cutlass.const_expr(self.tma_store):
                cpasync.prefetch_descriptor(tma_c)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # Full barrier: warp 0's arrive.expect_tx, plus with gather_b one cp.async arrive per producer thread.
        producers = 1 + self.threads_per_wg if self.gather_b else 1
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_wg * 4),
            tx_count=self.tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sData = storage.sData.get_tensor(data_smem_layout)
        sScale = storage.sScale.get_tensor(scale_smem_layout)
        sAmax = storage.sAmax.get_tensor(cute.make_layout(self.amax_shape))

        # (inner, rows, 1, RestN, RestK, E) twice / (tok, bK, RestM, RestK)
        gW = cute.local_tile(mW, cute.shape(cute.slice_(data_smem_layout, (None, None, 0))), (None, None, None, None))
        gS = cute.local_tile(mS, cute.shape(cute.slice_(scale_smem_layout, (None, None, 0))), (None, None, None, None))
        gB = cute.local_tile(mB, (self.tok_tile, self.tile_k), (None, None))
        tWsW, tWgW = cpasync.tma_partition(
            tma_w, 0, cute.make_layout(1), cute.group_modes(sData, 0, 2), cute.group_modes(gW, 0, 2)
        )
        tSsS, tSgS = cpasync.tma_partition(
            tma_s, 0, cute.make_layout(1), cute.group_modes(sScale, 0, 2), cute.group_modes(gS, 0, 2)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        k_tiles = cute.size(gB, mode=[3])
        n_tiles = cute.size(gW, mode=[3])

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        if cutlass.const_expr(self.early_w):
            if warp_idx == 0:
                self._early_w_loads(ab_pipe, tma_w, tWgW, tWsW, tma_s, tSgS, tSsS, m_block_expert, meta, n_tiles,
                                    k_tiles, bidx, grid_x)  # fmt: skip
        if cutlass.const_expr(not self.trigger_after_wait):
            cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(self.trigger_after_wait):
            cute.arch.griddepcontrol_launch_dependents()
        num_tiles = meta[0] * n_tiles
        splits = self._splits(num_tiles, grid_x, k_tiles)
        num_units = num_tiles * splits  # work units: (tile, K part)

        if wg_idx == 0:
            # ------------------------------------------------------------ producer warpgroup
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if cutlass.const_expr(self.gather_b):
                self._gather_producer(
                    ab_pipe, tma_w, tWgW, tWsW, tma_s, tSgS, tSsS, storage, mX, row_token, m_block_expert,
                    num_units, splits, n_tiles, k_tiles, tidx, warp_idx, bidx, grid_x,
                )  # fmt: skip
            elif warp_idx == 0:
                prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                unit = bidx
                while unit < num_units:
                    _tile, m_blk, n_blk, k0, kn = self._unit(unit, splits, n_tiles, k_tiles)
                    expert = m_block_expert[m_blk] & 0xFFFF
                    for k in cutlass.range(k0, k0 + kn, unroll=1):
                        late = True  # early_w: the first unit's first stages hold their weights already
                        if cutlass.const_expr(self.early_w):
                            late = (unit != bidx) | (k - k0 >= self.ab_stages)
                        if late:
                            ab_pipe.producer_acquire(prod_state)
                        bar = ab_pipe.producer_get_barrier(prod_state)
                        stage = prod_state.index
                        if late:
                            cute.copy(tma_w, tWgW[(None, 0, n_blk, k, expert)], tWsW[(None, stage)], tma_bar_ptr=bar)
                            cute.copy(tma_s, tSgS[(None, 0, n_blk, k, expert)], tSsS[(None, stage)], tma_bar_ptr=bar)
                        cute.copy(tma_b, tBgB[(None, m_blk, k)], tBsB[(None, stage)], tma_bar_ptr=bar)
                        ab_pipe.producer_commit(prod_state)
                        prod_state.advance()
                    unit += grid_x
                ab_pipe.producer_tail(prod_state)
        else:
            # ------------------------------------------------------------ consumer warpgroups
            cute.arch.setmaxregister_increase(self.consumer_regs)
            wg = wg_idx - 1
            ctid = tidx - wg_idx * self.threads_per_wg
            warp = ctid // 32
            lane = ctid - warp * 32
            thr_mma = tiled_mma.get_slice(ctid)
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.wg_rows, self.tok_tile)), self.acc_dtype)
            # (tiled MMA, B fragment, accumulator) per width: the token tile, then with `narrow` each narrower
            # width w: its WGMMA over the first w token rows of every B stage and the first w / 2 accumulators of
            # each atom (a WGMMA's fragment of w columns is the prefix of the wider one's)
            mmas = [(tiled_mma, tCrB, acc)]
            for w in self.narrow_widths:
                mma_w = self._make_mma(w)
                sB_w = cute.flat_divide(sB, (w, self.tile_k))[(None, None, 0, 0, None)]
                acc_w = cute.make_tensor(
                    acc.iterator,
                    cute.make_layout(((2, 2, w // 8), self.atoms, 1), stride=((1, 2, 4), self.tok_tile // 2, 0)),
                )
                mma_w.set(warpgroup.Field.ACCUMULATE, True)
                mmas.append((mma_w, mma_w.make_fragment_B(mma_w.get_slice(ctid).partition_B(sB_w)), acc_w))
            a_shape = thr_mma.partition_shape_A((self.wg_rows, self.tile_k))
            frags = [cute.make_rmem_tensor(a_shape, cutlass.BFloat16) for _ in range(2)]
            words = [cute.recast_tensor(f, cutlass.Uint32) for f in frags]

            data_base = bq.smem_addr(storage.sData.data_ptr())
            scale_base = bq.smem_addr(storage.sScale.data_ptr())
            offsets = self._lane_offsets(wg, warp, lane)
            # tma_store: the warp's staging buffers and the TMA view of C in (8 tokens, the warp's features) boxes
            epi = None
            if cutlass.const_expr(self.tma_store):
                sEpi = storage.sEpi.get_tensor(epi_smem_layout.outer, swizzle=epi_smem_layout.inner)
                gCt = cute.local_tile(mCt, (8, self.epi_feats), (None, None))  # (8, F, M_cap / 8, N / F)
                bSG_sC, bSG_gC = cpasync.tma_partition(
                    tma_c, 0, cute.make_layout(1), cute.group_modes(sEpi, 0, 2), cute.group_modes(gCt, 0, 2)
                )
                warp_u = cute.arch.make_warp_uniform(warp)
                epi = (tma_c, bSG_sC, bSG_gC, bq.smem_addr(storage.sEpi.data_ptr()), warp_u)
            epi_count = cutlass.Int32(0)  # tma_store: the warp's staged column groups so far
            consumed = cutlass.Int32(0)  # K tiles taken from the ring so far
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            lag = min(self.stagger, k_tiles // self.split_k)  # a K part is k_tiles // split_k tiles at least
            if cutlass.const_expr(lag > 0):
                if wg == 1:
                    if bidx < num_units:  # start `lag` K tiles behind the first warpgroup
                        cute.arch.barrier(barrier_id=STAGGER_BARRIER, number_of_threads=2 * self.threads_per_wg)
            unit = bidx
            while unit < num_units:
                tile, m_blk, n_blk, _k0, kn = self._unit(unit, splits, n_tiles, k_tiles)
                block = m_block_expert[m_blk]
                expert = block & 0xFFFF
                valid_rows = block >> 16
                width = cutlass.Int32(0)  # narrow: the narrowest WGMMA width (index in mmas) holding the real tokens
                for i in cutlass.range_constexpr(len(self.narrow_widths)):
                    if valid_rows <= self.narrow_widths[i]:
                        width = cutlass.Int32(i + 1)
                # loaded before the K loop: off the epilogue's path
                alpha = self._alpha(expert, w_gscale, act_gscale)
                out_gs = self._out_gscale(act_gscale)
                acc.fill(0.0)
                # Two fragments alternate (registers are not indexable at run time): K tiles in pairs.
                for k2 in cutlass.range(kn // 2, unroll=1):
                    for par in cutlass.range_constexpr(2):
                        n = consumed + 2 * k2 + par
                        self._k_step(ab_pipe, n, mmas, width, frags[par], words[par], data_base, scale_base, offsets)
                        if n > 0:  # WGMMA n-1 is done: free its stage (the previous tile's last, at k = 0)
                            ab_pipe.consumer_release(self._ring_state(n - 1))
                        self._stagger_release(lag, n, wg)
                if cutlass.const_expr(self.split_k == 1):
                    if cutlass.const_expr(k_tiles % 2 == 1):
                        self._last_odd_step(ab_pipe, consumed + kn - 1, lag, wg, mmas, width, frags, words,
                                            data_base, scale_base, offsets)  # fmt: skip
                elif kn % 2 == 1:
                    self._last_odd_step(ab_pipe, consumed + kn - 1, lag, wg, mmas, width, frags, words,
                                        data_base, scale_base, offsets)  # fmt: skip
                warpgroup.wait_group(0)  # the tile's last stage is freed by the next tile's first step
                consumed += kn
                if cutlass.const_expr(self.split_k > 1):
                    finish = cutlass.Boolean(True)
                    if splits > 1:
                        finish = self._split_reduce(acc, split_ws, split_count, storage, unit, tile, splits, wg, ctid)
                    if finish:
                        epi_count = self._epilogue(acc, mC, m_blk, n_blk, wg, warp, lane, valid_rows, alpha, out_gs,
                                                   sAmax, epi, epi_count)  # fmt: skip
                else:
                    epi_count = self._epilogue(acc, mC, m_blk, n_blk, wg, warp, lane, valid_rows, alpha, out_gs, sAmax,
                                               epi, epi_count)  # fmt: skip
                unit += grid_x
            if consumed > 0:
                ab_pipe.consumer_release(self._ring_state(consumed - 1))
            if cutlass.const_expr(self.tma_store):
                cute.arch.cp_async_bulk_wait_group(0)  # the warp's stores are done before its CTA exits

    def _ring_state(self, n):
        return ring_state(self.ab_stages, n)

    @cute.jit
    def _last_odd_step(self, ab_pipe, n, lag, wg, mmas, width, frags, words, data_base, scale_base, offsets):
        """The last K tile of an odd count (fragment 0)."""
        self._k_step(ab_pipe, n, mmas, width, frags[0], words[0], data_base, scale_base, offsets)
        if n > 0:
            ab_pipe.consumer_release(self._ring_state(n - 1))
        self._stagger_release(lag, n, wg)

    def _splits(self, num_tiles, grid_x, k_tiles: int):
        """K parts per tile of this call: the largest of 2 .. ``split_k`` whose parts keep
        ``SWAP_SPLIT_MIN_K_TILES`` K tiles and whose work units fit one wave of the grid, else 1 (the
        same in every thread: it depends on the grid and ``meta`` only)."""
        if cutlass.const_expr(self.split_k == 1):
            return 1
        splits = cutlass.Int32(1)
        for s in constants.SWAP_SPLIT_FACTORS:
            if s > 1 and s <= self.split_k and k_tiles // s >= constants.SWAP_SPLIT_MIN_K_TILES:
                splits = cutlass.select_(s * num_tiles <= grid_x, cutlass.Int32(s), splits)
        return splits

    def _unit(self, unit, splits, n_tiles, k_tiles):
        """Work unit -> (tile, M block, N block, first K tile, K tiles): part p of s takes K tiles
        ``[p * k_tiles // s, (p + 1) * k_tiles // s)``."""
        if cutlass.const_expr(self.split_k == 1):
            tile = unit
            k0, kn = 0, k_tiles
        else:
            tile = unit // splits
            part = unit - tile * splits
            k0 = part * k_tiles // splits
            kn = (part + 1) * k_tiles // splits - k0
        m_blk = tile // n_tiles
        return tile, m_blk, tile - m_blk * n_tiles, k0, kn

    @cute.jit
    def _split_reduce(self, acc, split_ws, split_count, storage, unit, tile, splits, wg, ctid) -> cutlass.Boolean:
        """Split K: store this part's accumulators (slot = ``unit``, coalesced: element i of thread t at
        ``i * 128 + t``), count the part in, and if it is the last of the tile's ``splits`` parts, sum the
        parts in part order into ``acc`` and zero the counter. Returns whether this warpgroup goes on to
        the epilogue. One named barrier of the warpgroup orders the stores before the count; a second
        shares the count."""
        n_acc = cute.size(acc)
        per_wg = n_acc * self.threads_per_wg
        ws = split_ws.iterator
        mine = (unit * self.num_wg + wg) * per_wg + ctid
        for i in cutlass.range_constexpr(n_acc):
            cute.arch.store((ws + mine + i * self.threads_per_wg).llvm_ptr, cutlass.Float32(acc[i]), cop="cg")
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=1 + wg, number_of_threads=self.threads_per_wg)
        flag = storage.sSplit.get_tensor(cute.make_layout(constants.SWAP_SPLIT_COUNTERS))
        counter = (split_count.iterator + tile * constants.SWAP_SPLIT_COUNTERS + wg).llvm_ptr
        if ctid == 0:
            flag[wg] = cute.arch.atomic_add(counter, cutlass.Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.barrier(barrier_id=1 + wg, number_of_threads=self.threads_per_wg)
        last = flag[wg] == splits - 1
        if last:
            cute.arch.fence_acq_rel_gpu()
            if ctid == 0:
                cute.arch.store(counter, cutlass.Int32(0))
            first = (tile * splits * self.num_wg + wg) * per_wg + ctid
            step = self.num_wg * per_wg  # from one part's slot to the next
            for i in cutlass.range_constexpr(n_acc):
                v = cute.arch.load((ws + first + i * self.threads_per_wg).llvm_ptr, cutlass.Float32, cop="cg")
                for p in cutlass.range_constexpr(1, self.split_k):
                    if p < splits:
                        addr = ws + first + p * step + i * self.threads_per_wg
                        v = v + cute.arch.load(addr.llvm_ptr, cutlass.Float32, cop="cg")
                acc[i] = v
        return last

    @cute.jit
    def _gather_producer(
        self, ab_pipe, tma_w, tWgW, tWsW, tma_s, tSgS, tSsS, storage, mX, row_token, m_block_expert,
        num_units, splits, n_tiles, k_tiles, tidx, warp_idx, bidx, grid_x,
    ) -> None:  # fmt: skip
        """``gather_b``: warp 0 loads the weight data and scales (TMA), all four warps the token rows
        (``cp.async``). Eight consecutive threads take the eight 16-byte chunks of a row's K tile; thread
        group g = tidx // 8 takes token columns g + 16 j (the same row % 8, so one swizzle)."""
        cols_pt = self.tok_tile // 16
        chunk = tidx % 8
        group = tidx // 8
        swz = (chunk ^ (group % 8)) << 4
        b_smem = storage.sB.data_ptr().toint()
        x_base = mX.iterator.toint()
        row_bytes = cute.size(mX, mode=[1]) * 2
        stage_bytes = self.tok_tile * self.tile_k * 2
        k_bytes = self.tile_k * 2
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        unit = bidx
        while unit < num_units:
            _tile, m_blk, n_blk, k0, kn = self._unit(unit, splits, n_tiles, k_tiles)
            expert = m_block_expert[m_blk] & 0xFFFF
            valid_rows = m_block_expert[m_blk] >> 16
            tok = []  # the token of each of this thread's columns (-1: padding, not loaded)
            for j in cutlass.range_constexpr(cols_pt):
                t = cutlass.Int32(-1)
                if group + 16 * j < valid_rows:
                    t = row_token[m_blk * self.tok_tile + group + 16 * j]
                tok.append(t)
            for k in cutlass.range(k0, k0 + kn, unroll=1):
                ab_pipe.sync_object_empty.wait(prod_state.index, prod_state.phase)
                if warp_idx == 0:
                    ab_pipe.producer_acquire(prod_state)
                    bar = ab_pipe.producer_get_barrier(prod_state)
                    stage = prod_state.index
                    cute.copy(tma_w, tWgW[(None, 0, n_blk, k, expert)], tWsW[(None, stage)], tma_bar_ptr=bar)
                    cute.copy(tma_s, tSgS[(None, 0, n_blk, k, expert)], tSsS[(None, stage)], tma_bar_ptr=bar)
                dst = b_smem + prod_state.index * stage_bytes + group * 128 + swz
                col = k * k_bytes + chunk * 16
                for j in cutlass.range_constexpr(cols_pt):
                    if tok[j] >= 0:
                        cp_async_16(dst + j * 16 * 128, x_base + cutlass.Int64(tok[j]) * row_bytes + col)
                cute.arch.cp_async_mbarrier_arrive_noinc(ab_pipe.producer_get_barrier(prod_state))
                prod_state.advance()
            unit += grid_x
        if warp_idx == 0:
            ab_pipe.producer_tail(prod_state)

    @cute.jit
    def _early_w_loads(
        self,
        ab_pipe,
        tma_w,
        tWgW,
        tWsW,
        tma_s,
        tSgS,
        tSsS,
        m_block_expert,
        meta,
        n_tiles,
        k_tiles: cutlass.Constexpr,
        bidx,
        grid_x,
    ) -> None:
        """``early_w``, warp 0 before ``griddepcontrol.wait``: acquire the first ring stages of this CTA's
        first work unit (as many as the ring holds) and issue their weight data and scale loads; the
        stage's full barrier then waits for the token tile, loaded after the wait. The routing's outputs
        are read with ld.relaxed.gpu (not through L1)."""
        blocks = cute.arch.load(meta.iterator.llvm_ptr, cutlass.Int32, sem="relaxed", scope="gpu")
        num_tiles = blocks * n_tiles
        splits = self._splits(num_tiles, grid_x, k_tiles)
        if bidx < num_tiles * splits:
            _tile, m_blk, n_blk, k0, kn = self._unit(bidx, splits, n_tiles, k_tiles)
            entry_ptr = (m_block_expert.iterator + m_blk).llvm_ptr
            expert = cute.arch.load(entry_ptr, cutlass.Int32, sem="relaxed", scope="gpu") & 0xFFFF
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
            for k in cutlass.range(k0, k0 + cutlass.min(kn, self.ab_stages), unroll=1):
                ab_pipe.producer_acquire(state)
                bar = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_w, tWgW[(None, 0, n_blk, k, expert)], tWsW[(None, state.index)], tma_bar_ptr=bar)
                cute.copy(tma_s, tSgS[(None, 0, n_blk, k, expert)], tSsS[(None, state.index)], tma_bar_ptr=bar)
                state.advance()

    @cute.jit
    def _stagger_release(self, lag: cutlass.Constexpr, n: cutlass.Int32, wg: cutlass.Int32) -> None:
        """The first warpgroup, after its ``lag``-th K tile: let the second one start."""
        if cutlass.const_expr(lag > 0):
            if wg == 0:
                if n == lag - 1:
                    cute.arch.barrier_arrive(barrier_id=STAGGER_BARRIER, number_of_threads=2 * self.threads_per_wg)

    def _k_step(self, ab_pipe, n, mmas, width, frag, frag_words, data_base, scale_base, offsets):
        """K tile number ``n`` of the ring: convert into ``frag`` (its previous reader, WGMMA n-2, is
        done: ``wait_group(1)`` after WGMMA n-1), WGMMA from registers (``mmas[width]``), then wait for
        WGMMA n-1."""
        state = self._ring_state(n)
        ab_pipe.consumer_wait(state)
        if cutlass.const_expr(self.gather_b):
            # The B stage was written by cp.async (generic proxy); WGMMA reads it through the async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
        self._load_fragment(
            data_base + state.index * self.data_stage_bytes,
            scale_base + state.index * self.scale_stage_bytes,
            frag_words,
            offsets,
        )
        if cutlass.const_expr(len(mmas) == 1):
            self._wgmma_batch(mmas[0], frag, state.index)
        else:
            self._wgmma_at_width(mmas, width, frag, state.index)
        warpgroup.wait_group(1)

    def _wgmma_batch(self, mma, frag, stage) -> None:
        """One K tile's WGMMAs of ring stage ``stage`` with ``mma`` = (tiled MMA, B fragment, accumulator), as one
        committed batch."""
        tiled_mma, tCrB, acc = mma
        warpgroup.fence()
        for kb in range(self.tile_k // 16):
            cute.gemm(tiled_mma, acc, frag[(None, None, kb)], tCrB[(None, None, kb, stage)], acc)
        warpgroup.commit_group()

    @cute.jit
    def _wgmma_at_width(self, mmas, width, frag, stage) -> None:
        """``_wgmma_batch`` with ``mmas[width]`` (the same in every thread of the CTA). Each branch commits its own
        batch: with the commit after the join, ptxas closes every batch with an empty one there (so the
        ``wait_group(1)`` after it would wait for the batch just issued)."""
        for i in cutlass.range_constexpr(len(mmas)):
            if width == i:
                self._wgmma_batch(mmas[i], frag, stage)

    def _lane_offsets(self, wg, warp, lane):
        """Per-thread shared-memory offsets, constant over the kernel.

        ``ldmatrix``: lane l addresses row ``l % 8`` of matrix ``l // 8``; matrix m is row half
        ``m % 2`` and data segment ``seg0 + m // 2`` (MXFP8 seg0 = 2p for the p-th load of an atom,
        NVFP4 seg0 = 0). Rows of one matrix are 8 consecutive rows from a multiple of 8, so the
        segment swizzle (``weights.segment_swizzle``) depends on ``l % 8`` only.
        Scales: the lane's own fragment rows (row ``lane // 4`` of each 8-row group)."""
        d = self.data_bytes
        row_in = lane & 7
        mat = lane >> 3
        if cutlass.const_expr(self.gated):
            # the warpgroup's first gate row: its features start at wg * wg_out, 128 per 256-row block
            half = constants.SWAP_GATE_UP_BLOCK // 2
            f0 = wg * self.wg_out
            wrow = (f0 // half) * constants.SWAP_GATE_UP_BLOCK + f0 % half + warp * (self.groups * 8)
        else:
            wrow = wg * self.wg_rows + warp * (self.groups * 8)
        ld_row = wrow + row_in + (mat & 1) * self.half_stride
        swz = (row_in // (128 // d)) % self.segs
        loads = 2 if self.fmt == constants.FMT_MXFP8 else 1
        seg0 = [2 * p if loads == 2 else 0 for p in range(loads)]
        ld_base = [ld_row * d + ((s + (mat >> 1)) ^ swz) * constants.QUANT_SEGMENT_BYTES for s in seg0]
        scale_row = (wrow + (lane >> 2)) * self.scales_per_tile
        return ld_base, scale_row

    def _load_fragment(self, data_stage, scale_stage, frag_words, offsets) -> None:
        """Packed data and scales of one K tile -> the BF16 A fragment (as 32-bit words: word
        ``((0, h, v2), a, kb)`` holds row half h, K pair v2 of atom a, K16 block kb)."""
        ld_base, scale_row = offsets
        d, spt = self.data_bytes, self.scales_per_tile
        for a in range(self.atoms):
            mult = []  # mult[h][block]: BF16 multipliers of the lane's two rows
            for h in range(2):
                roff = (a * self.atom_stride + h * self.half_stride) * spt
                if cutlass.const_expr(self.fmt == constants.FMT_MXFP8):
                    sc = bq.ld_shared_u16(scale_stage + scale_row + roff)
                    mult.append([bq.ue8m0_multiplier(sc & cutlass.Uint32(0xFF)), bq.ue8m0_multiplier(sc >> 8)])
                else:
                    mult.append(bq.nvfp4_scale_multipliers(bq.ld_shared_b32(scale_stage + scale_row + roff), 4))
            aoff = a * self.atom_stride * d
            if cutlass.const_expr(self.fmt == constants.FMT_MXFP8):
                for p in range(2):  # K16 blocks 2p, 2p+1 (one 32-block: scale p)
                    regs = bq.ldmatrix_x4(data_stage + ld_base[p] + aoff)
                    for m in range(4):
                        h, kb = m % 2, 2 * p + m // 2
                        lo, hi = bq.e4m3x4_to_bf16x4(regs[m], mult[h][p])
                        frag_words[((0, h, 0), a, kb)] = lo
                        frag_words[((0, h, 1), a, kb)] = hi
            else:
                regs = bq.ldmatrix_x4(data_stage + ld_base[0] + aoff)
                for m in range(4):
                    h, s = m % 2, m // 2  # segment s = K16 blocks 2s, 2s+1 = scale blocks 2s, 2s+1
                    out = bq.e2m1x8_to_bf16x8(regs[m], mult[h][2 * s], mult[h][2 * s + 1])
                    for byte in range(4):  # byte = (K16 block 2s + byte // 2, K pair v2 = byte % 2)
                        frag_words[((0, h, byte % 2), a, 2 * s + byte // 2)] = out[byte]

    def _alpha(self, expert, w_gscale: cute.Tensor, act_gscale: cute.Tensor):
        """The accumulator's scale for ``expert``: NVFP4 the two global scales (loaded), MXFP8 a constant."""
        if cutlass.const_expr(self.fmt == constants.FMT_NVFP4):
            return act_gscale[self.gscale_index] * w_gscale[expert] * bq.NVFP4_ACC_SCALE
        return cutlass.Float32(bq.MXFP8_ACC_SCALE)

    def _out_gscale(self, act_gscale: cute.Tensor):
        """The NVFP4 global scale of the requantized output (``act_gscale[1]``, loaded once per tile, not
        once per column group); a constant where there is none."""
        if cutlass.const_expr(self.requant and self.fmt == constants.FMT_NVFP4):
            return act_gscale[1]
        return cutlass.Float32(1.0)

    @cute.jit
    def _epilogue(self, acc, mC, m_blk, n_blk, wg, warp, lane, valid_rows, alpha, out_gs, sAmax, epi=None, epi_count=0):
        """Accumulator -> activation -> (requantization) -> bf16 stores, for each group of 8 token columns
        that holds a real row (``valid_rows`` of the M block: the same in every thread of the CTA, so
        the amax exchange's named barriers stay collective). Where a requantization block spans warps,
        ``epi_chunk`` groups at a time share one amax exchange (their padding columns are computed,
        not stored). ``epi`` (``tma_store``): the warp's staging state (``_stage_columns``), else None; returns
        ``epi_count``, the warp's staged column groups, advanced by this tile's.

        Accumulator mode 0 is ((2, 2, tok/8)): v0 = column pair, v1 = row half h, j = column group;
        mode 1 is the atom. Column (token) ``8j + 2q + v0`` with q = lane % 4; lane row i = lane // 4."""
        pair = cute.make_rmem_tensor((1, 2), cutlass.BFloat16)
        pair_f32 = cute.make_rmem_tensor((1, 2), cutlass.Float32)
        rq = None  # the NVFP4 requantization's per-tensor constants
        if cutlass.const_expr(self.requant and self.fmt == constants.FMT_NVFP4):
            rq = bq.nvfp4_global(out_gs)
        n = self.epi_chunk
        for c in cutlass.range_constexpr(self.tok_tile // 8 // n):
            if 8 * n * c < valid_rows:
                cols = self._chunk_values(acc, c * n, alpha, rq, sAmax, wg, warp, lane)
                for jj in cutlass.range_constexpr(n):
                    if cutlass.const_expr(self.tma_store):  # plain epilogue: n == 1
                        epi_count = self._stage_columns(cols[jj], c * n + jj, m_blk, n_blk, wg, lane, epi, epi_count)
                    elif cutlass.const_expr(n == 1):
                        self._store_columns(cols[jj], c * n + jj, mC, m_blk, n_blk, wg, warp, lane, pair, pair_f32)
                    elif 8 * (c * n + jj) < valid_rows:
                        self._store_columns(cols[jj], c * n + jj, mC, m_blk, n_blk, wg, warp, lane, pair, pair_f32)
        return epi_count

    def _chunk_values(self, acc, j0: int, alpha, rq, sAmax, wg, warp, lane) -> list:
        """cols[jj][v0][g]: the lane's output value of its feature group g in token column
        ``8 (j0 + jj) + 2q + v0``, for the ``epi_chunk`` column groups from ``j0``: activation, then the
        requantization (the cross-warp amax of the whole chunk in one exchange)."""
        cols = [[self._column_values(acc, j, v0, alpha) for v0 in range(2)] for j in range(j0, j0 + self.epi_chunk)]
        if cutlass.const_expr(self.requant):
            amax = self._block_amax(cols, sAmax, wg, warp, lane, j0)
            cols = [[self._requant(cols[jj][v0], amax[jj][v0], rq) for v0 in range(2)] for jj in range(len(cols))]
        return cols

    def _store_columns(self, cols: list, j: int, mC, m_blk, n_blk, wg, warp, lane, pair, pair_f32) -> None:
        """Column group ``j``'s values (``cols[v0][g]``) as bf16 pairs of features. Lanes i and i ^ 1
        (lane ^ 4) trade one column: the even lane stores column v0 = 0 of features (i, i + 1), the odd
        lane column v0 = 1."""
        q = lane & 3
        i = lane >> 2
        odd_i = i & 1
        odd = odd_i == 1
        feat0 = (n_blk * self.num_wg + wg) * self.wg_out + warp * (self.groups * 8) + (i & 6)
        row = m_blk * self.tok_tile + 8 * j + 2 * q + odd_i
        for g in range(self.groups):
            send = cutlass.Float32(cutlass.select_(odd, cols[0][g], cols[1][g]))
            got = cute.arch.shuffle_sync_bfly(send, 4)
            pair_f32[0, 0] = cutlass.Float32(cutlass.select_(odd, got, cols[0][g]))
            pair_f32[0, 1] = cutlass.Float32(cutlass.select_(odd, cols[1][g], got))
            pair.store(pair_f32.load().to(cutlass.BFloat16))
            cute.autovec_copy(pair, cute.local_tile(mC, (1, 2), (row, (feat0 + g * 8) // 2)))

    @cute.jit
    def _stage_columns(self, cols: list, j: int, m_blk, n_blk, wg, lane, epi: tuple, count):
        """``tma_store``: column group ``j``'s values (``cols[v0][g]``: the lane's feature ``8 g + lane // 4`` of
        the warp's, tokens ``8 j + 2 (lane % 4) + v0``) through the warp's next staging buffer to C; returns
        ``count + 1`` (the warp's staged groups). Every step is warp-uniform: the whole warp waits, writes,
        fences, stores and commits."""
        tma_c, bSG_sC, bSG_gC, epi_base, warp = epi
        buf = (wg * 4 + warp) * EPI_TMA_BUFS + count % EPI_TMA_BUFS
        if count >= EPI_TMA_BUFS:  # the store that last read this buffer is done reading it
            cute.arch.cp_async_bulk_wait_group(EPI_TMA_BUFS - 1, read=True)
        # bf16 pairs (token 2q in the low half): word g is the lane's part of the feature row x token pair matrix g
        words = [pack_bf16x2(cols[0][g], cols[1][g]) for g in range(self.groups)]
        # stmatrix .trans: lane 8m + r gives the address of row r (token r) of matrix m (features 8m..8m+7): chunk m
        # of the S-byte row, swizzled as TMA reads it
        span = 2 * self.epi_feats  # S
        r = lane & 7
        row = epi_base + buf * self.epi_buf_bytes + r * span
        swz = ((r * span) >> 7) & (span // 16 - 1)
        if cutlass.const_expr(self.groups == 2):
            m = (lane >> 3) & 1  # lanes 16-31 repeat lanes 0-15's addresses (x2 reads those of lanes 0-15)
            stmatrix_x2_trans(row + ((m ^ swz) << 4), words[0], words[1])
        else:
            for half in cutlass.range_constexpr(self.groups // 4):
                m = (lane >> 3) + 4 * half
                stmatrix_x4_trans(row + ((m ^ swz) << 4), *words[4 * half : 4 * half + 4])
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        row_tile = m_blk * (self.tok_tile // 8) + j
        col_tile = ((n_blk * self.num_wg + wg) * self.wg_out) // self.epi_feats + warp
        cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, row_tile, col_tile)])
        cute.arch.cp_async_bulk_commit_group()
        return count + 1

    def _column_values(self, acc, j: int, v0: int, alpha) -> list:
        """The lane's value of each 8-feature group in column (j, v0): scaled by ``alpha``, then the
        activation."""
        vals = []
        for a in range(self.atoms):
            if cutlass.const_expr(self.gated):
                g = acc[((v0, 0, j), a, 0)] * alpha
                u = acc[((v0, 1, j), a, 0)] * alpha
                vals.append(activations.gated_act(self.epilogue, g, u, self.limit))
            else:
                for h in range(2):
                    v = acc[((v0, h, j), a, 0)] * alpha
                    if cutlass.const_expr(self.epilogue != EPI_PLAIN):
                        v = activations.plain_act(self.epilogue, v)
                    vals.append(v)
        return vals

    def _block_amax(self, cols: list, sAmax: cute.Tensor, wg, warp, lane, j0: int = 0) -> list:
        """amax[j][v0][b]: the amax of requantization block b of the lane's groups in column (j0 + j, v0).

        In-thread over the block's groups, then over the 8 lanes of the column (shuffles 4, 8, 16);
        with ``block_warps`` > 1 (a block spans warps, each holding one part of it) over those warps
        too: every lane writes its column's partial amax, a named barrier of the warpgroup, every lane
        reads its partners', a second barrier frees the slots for the next tile."""
        per_block = max(1, constants.QUANT_BLOCK[self.fmt] // 8 // self.block_warps)  # groups per block and warp
        amax = []
        for j in range(len(cols)):
            row = []
            for v0 in range(2):
                vals = cols[j][v0]
                blocks = []
                for b in range(len(vals) // per_block):
                    m = bq.block_amax(vals[b * per_block : (b + 1) * per_block])
                    for x in (4, 8, 16):
                        m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, x))
                    blocks.append(m)
                row.append(blocks)
            amax.append(row)
        if cutlass.const_expr(self.block_warps > 1):
            q = lane & 3
            for j in range(len(cols)):  # the 8 lanes of a column hold the same value: all write it
                for v0 in range(2):
                    sAmax[8 * (j0 + j) + 2 * q + v0, warp, wg] = amax[j][v0][0]
            cute.arch.barrier(barrier_id=1 + wg, number_of_threads=self.threads_per_wg)
            first = warp - warp % self.block_warps
            for j in range(len(cols)):
                for v0 in range(2):
                    m = amax[j][v0][0]
                    for p in range(self.block_warps):
                        m = cute.arch.fmax(m, sAmax[8 * (j0 + j) + 2 * q + v0, first + p, wg])
                    amax[j][v0][0] = m
            cute.arch.barrier(barrier_id=1 + wg, number_of_threads=self.threads_per_wg)
        return amax

    def _requant(self, vals: list, amax: list, rq) -> list:
        """Quantize-dequantize one column's group values along the features, block b of the lane's
        groups with ``amax[b]`` (``_block_amax``); NVFP4 with the constants ``rq`` (``bq.nvfp4_global``)."""
        per_block = len(vals) // len(amax)
        out = []
        for b in range(len(amax)):
            blk = vals[b * per_block : (b + 1) * per_block]
            if cutlass.const_expr(self.fmt == constants.FMT_MXFP8):
                out.extend(bq.mxfp8_qdq(blk, amax[b]))
            else:
                out.extend(bq.nvfp4_qdq(blk, amax[b], rq))
        return out
