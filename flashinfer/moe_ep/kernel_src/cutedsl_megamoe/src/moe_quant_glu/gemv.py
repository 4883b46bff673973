"""Block-scaled expert GEMV for decode: few tokens per expert, every warp streaming its own weight rows.

At T = 1 the swap-AB GEMMs (``swap_gemm``) are bound by the latency of each CTA's serial K loop
(TMA ring, mbarriers, one CTA per 256-512 weight rows: TUNING.md, sessions 19-22), not by the weight
bytes: their NVFP4 GEMMs run at 16 % of the DRAM rate there. This kernel has no warp specialization,
no TMA and no mbarrier: every warp copies its own weight words with 16-byte ``cp.async`` into a ring of
its own in shared memory, converts them in registers (the same exact conversions, ``block_quant``) and
multiplies them with ``mma.sync`` (m16n8k16, BF16, fp32 accumulators), tokens as N (8 per MMA).
Measured on H200 (TUNING.md, session 24): the layer 7-14 % faster than with the swap-AB GEMMs at
qwen3-30b-a3b T = 1, not faster at larger T or on the larger models:

- work unit = one M block of the routing (``m_block_expert``: one expert, up to ``tok_tile`` of its
  pairs) times one *row warp*: 64 weight rows, as four 16-row MMA atoms. Gated FC1: the 32 features
  ``32 W .. 32 W + 31`` of row warp W, atom a holding the gate rows of features ``8a + i`` in its
  first 8 rows and their up rows (128 rows further, ``SWAP_GATE_UP_BLOCK``) in its last 8, so the
  activation pairs up in-thread. Otherwise 64 consecutive output rows, atom a rows ``16a .. 16a + 15``.
  This is the row assignment of a ``swap_gemm`` warp with four atoms, so its epilogue is reused
  unchanged (activation, requantization, stores of the real token columns only).
- one CTA per unit (a grid of ``max_blocks * row warps``; units past the routing's block count
  exit), ``k_warps`` warps splitting K: warp w takes K units ``w, w + k_warps, ...`` (a unit is 64 K
  for MXFP8, 128 for NVFP4); the partial accumulators meet in shared memory and warp 0 sums them in
  warp order (deterministic) and runs the epilogue. Many small CTAs, not a persistent grid: the
  hardware starts the next unit on an SM while its other CTAs still stream.
- the ring: ``stages`` deep per warp; unit j + stages - 1 is copied while unit j is converted and
  multiplied (one ``cp.async`` group per unit, ``cp.async.wait_group``). Every lane reads back only the
  bytes it copied itself, so the ring needs no barrier, and a stage is refilled only after the lane's
  reads of it have been consumed by its MMAs.
- the K order inside a unit is relabeled so that a lane loads whole 16-byte segments of the packed
  rows (``weights.SEGMENT_ORDER``): lane ``(i, q)`` (``i = lane // 4``, ``q = lane % 4``) loads
  segment ``q`` (MXFP8: K16 block q of the K tile) or segment ``q % 2`` of K tile ``q // 2`` (NVFP4:
  two K tiles per unit) of its rows, and word ``q'`` of that segment feeds MMA ``q'`` (NVFP4: MMAs
  ``(q', 0)`` and ``(q', 1)``, the segment's two K16 blocks). The token operand follows the same
  relabeling: lane ``(n, q)`` loads K elements ``16 q .. 16 q + 15`` (NVFP4 ``32 q .. 32 q + 31``) of
  the unit from token column n's row. Every product is the same as in ``swap_gemm``; only the fp32
  summation order differs.

``early_w``: the first ``stages - 1`` K units' weight words and scales are copied before
``griddepcontrol.wait`` (they join the first unit's ``cp.async`` group)
(the block map read with ld.relaxed.gpu: the kernel before must trigger its dependents after its own
wait, as for ``swap_gemm``'s ``early_w``). ``early_ring``: every stage's, the first ``stages`` units (a warp
of at most ``stages`` units then has all of its weights in flight before the wait); the K loop's first step
then copies only its unit's token chunks, the weights having joined the first group too.

``l2_prefetch``: as soon as the CTA knows its expert (with ``early_w`` before ``griddepcontrol.wait``,
otherwise right after it), the lanes of every warp issue one bulk L2 prefetch
(``cp.async.bulk.prefetch.L2``) per K tile and row range of the warp's units past the ring's first
stages: the weight rows of a row warp are contiguous in each K tile's plane of the packed layout (one
range of 64 rows, or for gated FC1 the 32 gate rows and the 32 up rows), and so are their scales. The
ring then finds its later units in L2: the whole slice is requested from DRAM at once instead of one
unit ahead, and FC2 (``early_w``) requests all of its weights while FC1 still runs. The values and
the summation order do not change (only where the bytes come from).

The pair chain (``pair_blocks``, for one token; the BF16 kernel's ``pair_blocks`` / ``pair_combine``
for this GEMV): M block b is pair b of ``topk_ids`` (its expert, one real token column: token
``b // top_k``), so no routing kernel runs before FC1, and

- ``gather_x`` (FC1, the layer's first kernel): the CTA prepares its token's activation row itself,
  after ``griddepcontrol.wait``: every warp quantizes-dequantizes (or, ``prequantized``, dequantizes)
  items of it with the gather's own functions (``aux_kernels.qdq_slot`` / ``dequant_slot``, so the
  same BF16 values) into a row in shared memory, while the first units' weight copies are in flight;
  a CTA barrier, then every lane takes its token fragments from that row (all eight token columns
  the same row: the padding columns compute copies that are never read). No gather kernel runs.
  ``row_tma`` (BF16 rows only): one thread requests the token's BF16 row into that shared row with a bulk copy
  (the TMA unit, completing on an mbarrier) right after ``griddepcontrol.wait``, before the ``topk_ids`` read and
  the weight copies; the warps then quantize-dequantize it in place from shared memory (the same functions, so
  the same values). The row's bytes travel outside the SM's ``cp.async`` queue, where its loads otherwise wait
  behind the first weight copies (TUNING.md, session 44).
- ``pair_combine`` (FC2): after warp 0's epilogue has stored the pair's y row, the last of the
  token's ``top_k`` units of a row warp sums the token's k rows of those 64 columns into ``out``
  (``src.pair_combine``: the combine kernel's bits), with a counter per (token, row warp) in
  ``counters[E + 1:]``. No combine kernel runs.
- ``pair_cluster`` (with ``pair_combine``): the token's ``top_k`` units of a row warp run as one cluster of
  ``top_k`` CTAs (CTA rank k: pair ``t * top_k + k``). Each stores its pair's 64 BF16 y values of the real
  token column into a slot of the rank-0 CTA's shared memory (``st.shared::cluster``) instead of its y row;
  after a cluster barrier rank 0 sums the slots in k order (``src.pair_combine.combine_words``: the same bits).
  No y row, counter, fence or atomic: one barrier instead of the global round trips of store, count, reload.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from ..common import constants
from ..common.host_utils import SM90_SMEM_BYTES, gemv_shared_bytes
from ..src import block_quant as bq
from ..src.pair_combine import combine_word, combine_words, count_in, publish_stores, reset_counter, st_cluster_b32
from ..src.warp_ring import bulk_copy_g2s, cp_async, cp_async_commit, cp_async_wait, mma_bf16_16816, prefetch_l2
from .aux_kernels import ITEM, TOKEN_LANES, dequant_slot, item_bytes, qdq_slot
from .swap_gemm import EPI_PLAIN, SwapDequantGemmSm90, pack_bf16x2

ROW_WARP_ROWS = constants.GEMV_ROW_WARP_ROWS  # weight rows per row warp (four 16-row MMA atoms)
GEMV_K_WARPS = (2, 4, 8, 16)
GEMV_TOKEN_TILES = (8, 16)


class GemvDequantSm90(SwapDequantGemmSm90):
    """One expert GEMV stage (FC1 or FC2) for decode; compile-time knobs only. Shares ``swap_gemm``'s
    epilogue (its warp with four atoms); ``launch`` takes the same operands plus ``max_blocks``."""

    def __init__(
        self,
        fmt: str,
        tok_tile: int,
        epilogue: str,
        limit: float | None,
        requant: bool = False,
        gscale_index: int = 0,
        k_warps: int = 4,
        early_w: bool = False,
        trigger_after_wait: bool = False,
        stages: int = 2,
        pair_blocks: bool = False,
        gather_x: bool = False,
        prequantized: bool = False,
        pair_combine: bool = False,
        l2_prefetch: bool = False,
        early_ring: bool = False,
        pair_cluster: bool = False,
        row_tma: bool = False,
    ) -> None:
        super().__init__(fmt, 16, epilogue, limit, 1, requant=requant, gscale_index=gscale_index)
        self.l2_prefetch = l2_prefetch
        if early_ring and not early_w:
            raise ValueError("early_ring needs early_w (it widens the weight copies made before the wait)")
        self.early_ring = early_ring
        if (gather_x or pair_combine) and not pair_blocks:
            raise ValueError("gather_x and pair_combine need pair_blocks")
        if gather_x and early_w:
            raise ValueError("gather_x (the layer's first kernel) reads topk_ids only after its wait: no early_w")
        if pair_combine and epilogue != EPI_PLAIN:
            raise ValueError("pair_combine needs the plain epilogue (FC2)")
        if pair_cluster and not pair_combine:
            raise ValueError("pair_cluster needs pair_combine")
        self.pair_cluster = pair_cluster
        if row_tma and not (gather_x and not prequantized):
            raise ValueError("row_tma needs gather_x with BF16 rows (not prequantized): it bulk-copies the BF16 row")
        self.row_tma = row_tma
        self.pair_blocks = pair_blocks
        self.gather_x = gather_x
        self.prequantized = prequantized
        self.pair_combine = pair_combine
        self.tok_tile = tok_tile
        if tok_tile not in GEMV_TOKEN_TILES:
            raise ValueError(f"the GEMV takes M blocks of {GEMV_TOKEN_TILES} tokens, got tok_tile={tok_tile}")
        if k_warps not in GEMV_K_WARPS:
            raise ValueError(f"k_warps must be one of {GEMV_K_WARPS}, got {k_warps}")
        self.k_warps = k_warps
        self.early_w = early_w
        self.trigger_after_wait = trigger_after_wait
        # The epilogue's view: one warpgroup of four-atom warps (swap_gemm._setup with atoms = 4).
        self.atoms = 4
        self.num_wg = 1
        self.groups = self.atoms if self.gated else 2 * self.atoms
        self.wg_rows = 64 * self.atoms
        self.wg_out = self.wg_rows // 2 if self.gated else self.wg_rows
        self.block_warps = max(1, constants.QUANT_BLOCK[fmt] // 8 // self.groups) if requant else 1
        assert self.block_warps == 1  # a requantization block never spans row warps
        self.epi_chunk = 1
        self.col_groups = tok_tile // 8
        self.unit_k = constants.TILE_K * (2 if fmt == constants.FMT_NVFP4 else 1)
        self.x_chunks = 2 if fmt == constants.FMT_MXFP8 else 4  # 16-byte token chunks per lane and unit
        if stages < 2:
            raise ValueError(f"the GEMV ring needs 2 stages at least, got {stages}")
        self.stages = stages
        # one ring stage of a warp: 16 data bytes and a scale word per (row, lane), then the token chunks (none
        # with gather_x: the lanes read the token row)
        self.scales_at = 2 * self.atoms * 32 * 16
        self.tokens_at = self.scales_at + 2 * self.atoms * 32 * 4
        self.stage_bytes = self.tokens_at + (0 if gather_x else self.col_groups * self.x_chunks * 32 * 16)
        self.ring_bytes = stages * self.stage_bytes
        if not gather_x:  # with it, launch checks (the token row's length is K)
            self._check_shared_bytes(0)

    def _check_shared_bytes(self, token_row: int) -> None:
        """The CTA's shared memory (``gemv_shared_bytes``; ``token_row``: gather_x's row of K elements) fits."""
        smem = gemv_shared_bytes(self.fmt, self.tok_tile, self.k_warps, self.stages, token_row)
        partials = 4 * self.atoms * self.col_groups * 32 * 4
        assert smem == self.k_warps * (self.ring_bytes + partials) + 2 * token_row
        if smem > SM90_SMEM_BYTES:
            raise ValueError(
                f"the GEMV's rings need {smem} bytes of shared memory with {self.k_warps} warps, {self.tok_tile}-token "
                f"blocks, {self.stages} stages{f' and a token row of {token_row}' if token_row else ''} (at most "
                f"{SM90_SMEM_BYTES}): fewer warps"
            )

    def launch(
        self,
        act: cute.Tensor,  # (M_cap, K) bf16: the permuted activations
        w_data: cute.Tensor,  # [E, K/64, N, D] uint8 (weights.pack_quantized_matrix)
        w_scale: cute.Tensor,  # [E, K/64, N, S] uint8
        c: cute.Tensor,  # (M_cap, N_out) bf16
        m_block_expert: cute.Tensor,
        meta: cute.Tensor,
        w_gscale: cute.Tensor,
        act_gscale: cute.Tensor,
        stream,
        use_pdl: bool = False,
        max_blocks=1,
        topk_ids: cute.Tensor | None = None,
        x: cute.Tensor | None = None,
        x_scale: cute.Tensor | None = None,
        out: cute.Tensor | None = None,
        topk_weights: cute.Tensor | None = None,
        counters: cute.Tensor | None = None,
    ) -> None:
        """Trace-time: the grid (``max_blocks``, dynamic, bounds the M blocks: the routing's, or with
        ``pair_blocks`` exactly ``T * top_k``). ``pair_blocks``: ``topk_ids`` [T, K]; ``gather_x``: ``x`` [T, H]
        (bf16, or the codes) and ``x_scale`` (their block scales with ``prequantized``); ``pair_combine``:
        ``out`` [T, H], ``topk_weights`` [T, K] and ``counters`` (the workspace's ``expert_count``)."""
        n_rows = w_data.shape[2]
        k = w_data.shape[1] * constants.TILE_K
        if n_rows % ROW_WARP_ROWS or (self.gated and n_rows % constants.SWAP_GATE_UP_BLOCK):
            raise ValueError(f"GEMV: N={n_rows} must be a multiple of 64 (gated: of 256)")
        if k % self.unit_k:
            raise ValueError(f"GEMV ({self.fmt}): K={k} must be a multiple of {self.unit_k}")
        if self.gather_x:
            self._check_shared_bytes(k)
        row_warps = n_rows // ROW_WARP_ROWS
        n_acc = 4 * self.atoms * self.col_groups
        partial = cute.make_layout((self.k_warps, n_acc, 32), stride=(32 * n_acc, 32, 1))  # lanes contiguous
        self.k = k
        if cutlass.const_expr(not self.pair_blocks):
            topk_ids = meta  # unused placeholder
        if cutlass.const_expr(not self.gather_x):
            x, x_scale = act, meta  # unused placeholders
        elif cutlass.const_expr(not self.prequantized):
            x_scale = meta  # unused placeholder
        if cutlass.const_expr(not self.pair_combine):
            out, topk_weights, counters = c, meta, meta  # unused placeholders
        blocks = cutlass.max(cutlass.min(max_blocks, m_block_expert.shape[0]), 1)
        cluster = [1, 1, 1]
        if cutlass.const_expr(self.pair_cluster):  # the grid in whole clusters of one token's top_k pairs
            top_k = topk_weights.shape[1]
            if top_k > 8:
                raise ValueError(f"pair_cluster: a cluster holds at most 8 CTAs, top_k={top_k}")
            blocks = (blocks + top_k - 1) // top_k * top_k
            cluster = [top_k, 1, 1]
        self.kernel(
            w_data, w_scale, act, c, m_block_expert, meta, w_gscale, act_gscale, partial, row_warps, topk_ids, x,
            x_scale, out, topk_weights, counters,
        ).launch(
            grid=[blocks * row_warps, 1, 1],
            block=[32 * self.k_warps, 1, 1],
            cluster=cluster,
            stream=stream,
            use_pdl=use_pdl,
        )  # fmt: skip

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def kernel(
        self,
        mW: cute.Tensor,
        mS: cute.Tensor,
        mA: cute.Tensor,
        mC: cute.Tensor,
        m_block_expert: cute.Tensor,
        meta: cute.Tensor,
        w_gscale: cute.Tensor,
        act_gscale: cute.Tensor,
        partial_layout: cute.Layout,
        row_warps: cutlass.Constexpr,
        topk_ids: cute.Tensor,
        mX: cute.Tensor,
        mXs: cute.Tensor,
        mOut: cute.Tensor,
        topk_weights: cute.Tensor,
        counters: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        smem = cutlass.utils.SmemAllocator()
        sPartial = smem.allocate_tensor(Float32, partial_layout, 16)

        m_blk = bidx // row_warps
        row_warp = bidx - m_blk * row_warps
        slot_k = 0  # pair_cluster: this CTA's rank in its cluster (its pair's k)
        if cutlass.const_expr(self.pair_cluster):  # CTA (t * row_warps + row warp) * top_k + k: pair t * top_k + k
            cl_size = topk_weights.shape[1]
            unit = bidx // cl_size
            slot_k = bidx - unit * cl_size
            tok_c = unit // row_warps
            row_warp = unit - tok_c * row_warps
            m_blk = tok_c * cl_size + slot_k
            cute.arch.cluster_arrive_relaxed()  # waited for before the first remote store: every CTA has started
        n_rows = mW.shape[2]
        k_tiles = mW.shape[1]
        n_units = k_tiles * constants.TILE_K // self.unit_k
        offsets = self._row_offsets(row_warp, lane)

        # This warp's cp.async ring: its K units j = 0, 1, ... (unit warp + j * k_warps) in stage j % stages.
        ring = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.k_warps * self.ring_bytes), 128)
        ring_base = bq.smem_addr(ring.iterator) + warp * self.ring_bytes
        x_row = None  # gather_x: the token's prepared row (K bf16), read by every lane
        self._cluster_slot = None  # pair_cluster: this pair's slot of 64 y values in rank 0's shared memory
        if cutlass.const_expr(self.pair_cluster):
            slots = smem.allocate_tensor(Uint32, cute.make_layout(topk_weights.shape[1] * ROW_WARP_ROWS // 2), 16)
            self._cluster_slot = bq.smem_addr(slots.iterator) + slot_k * (ROW_WARP_ROWS * 2)
        row_bar = None  # row_tma: the mbarrier the row's bulk copy completes on
        if cutlass.const_expr(self.gather_x):
            x_row = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((1, self.k)), 16)
        if cutlass.const_expr(self.row_tma):
            row_bar = smem.allocate_tensor(Int64, cute.make_layout(1), 8).iterator
            if tidx == 0:
                cute.arch.mbarrier_init(row_bar, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.barrier()  # the mbarrier is initialized before any thread waits on it
        kw = self.k_warps
        mine = cutlass.max(n_units - warp + kw - 1, 0) // kw  # this warp's K units
        if cutlass.const_expr(self.early_w):
            blocks = self._num_blocks(meta, topk_ids, relaxed=True)
            e_early = Int32(0)
            if m_blk < blocks:
                if cutlass.const_expr(self.pair_blocks):  # topk_ids (row-major): pair m_blk is element m_blk
                    entry_ptr = (topk_ids.iterator + m_blk).llvm_ptr
                else:
                    entry_ptr = (m_block_expert.iterator + m_blk).llvm_ptr
                e_early = cute.arch.load(entry_ptr, Int32, sem="relaxed", scope="gpu") & 0xFFFF
            for j in cutlass.range_constexpr(self.stages if self.early_ring else self.stages - 1):
                pre = ring_base + j * self.stage_bytes
                self._copy_weights(pre, mW, mS, e_early, warp + j * kw, j < mine, k_tiles, n_rows, offsets, lane)
            if cutlass.const_expr(self.l2_prefetch):
                if m_blk < blocks:
                    self._prefetch_units(mW, mS, e_early, warp, mine, k_tiles, n_rows, row_warp, lane)
        if cutlass.const_expr(not self.trigger_after_wait):
            cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(self.trigger_after_wait):
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.row_tma):  # the token's row, ahead of the topk_ids read and the weight copies
            if tidx == 0:
                if m_blk < self._num_blocks(meta, topk_ids):
                    row_bytes = self.k * 2
                    cute.arch.mbarrier_arrive_and_expect_tx(row_bar, row_bytes)
                    row_at = mX.iterator.toint() + Int64(m_blk // topk_ids.shape[1]) * mX.shape[1] * 2
                    bulk_copy_g2s(bq.smem_addr(x_row.iterator), row_at, row_bytes, bq.smem_addr(row_bar))

        if m_blk < self._num_blocks(meta, topk_ids):
            block = self._block_entry(m_block_expert, topk_ids, m_blk)
            expert = block & 0xFFFF
            valid_rows = block >> 16
            alpha = self._alpha(expert, w_gscale, act_gscale)
            out_gs = self._out_gscale(act_gscale)
            acc = cute.make_rmem_tensor(((2, 2, self.col_groups), self.atoms, 1), Float32)
            acc.fill(0.0)
            # The first stages-1 units: one cp.async group each (the early weight copies join the first).
            for j in cutlass.range_constexpr(self.stages - 1):
                first = ring_base + j * self.stage_bytes
                if cutlass.const_expr(not self.early_w):
                    self._copy_weights(first, mW, mS, expert, warp + j * kw, j < mine, k_tiles, n_rows, offsets, lane)
                if cutlass.const_expr(not self.gather_x):
                    self._copy_tokens(first, mA, m_blk, valid_rows, warp + j * kw, j < mine, lane)
                cp_async_commit()
            if cutlass.const_expr(self.l2_prefetch and not self.early_w):
                self._prefetch_units(mW, mS, expert, warp, mine, k_tiles, n_rows, row_warp, lane)
            if cutlass.const_expr(self.gather_x):  # while those weights stream in
                if cutlass.const_expr(self.row_tma):  # in place, from the bulk-copied row
                    cute.arch.mbarrier_wait(row_bar, 0)
                    self._prepare_token_row(x_row, mXs, act_gscale, 0, x_row, warp, lane)
                else:
                    self._prepare_token_row(mX, mXs, act_gscale, m_blk // topk_ids.shape[1], x_row, warp, lane)
                cute.arch.barrier()
            for i in cutlass.range(mine, unroll=1):
                nxt = i + self.stages - 1
                fill = ring_base + (nxt % self.stages) * self.stage_bytes  # unit i - 1's, consumed
                if cutlass.const_expr(not self.early_ring) or i > 0:  # early_ring: step 0's were copied before the wait
                    self._copy_weights(
                        fill, mW, mS, expert, warp + nxt * kw, nxt < mine, k_tiles, n_rows, offsets, lane
                    )
                if cutlass.const_expr(not self.gather_x):
                    self._copy_tokens(fill, mA, m_blk, valid_rows, warp + nxt * kw, nxt < mine, lane)
                cp_async_commit()
                cp_async_wait(self.stages - 1)  # unit i's group (and every one before) has landed
                self._unit_mma(
                    acc, ring_base + (i % self.stages) * self.stage_bytes, valid_rows, lane, x_row, warp + i * kw
                )
            # K slices -> warp 0, summed in warp order
            n_acc = cute.size(acc)
            if warp > 0:
                for r in cutlass.range_constexpr(n_acc):
                    sPartial[warp, r, lane] = acc[r]
            cute.arch.barrier()
            if cutlass.const_expr(self.pair_cluster):
                cute.arch.cluster_wait()  # every CTA of the cluster has started: rank 0's slots can be written
            if warp == 0:
                for r in cutlass.range_constexpr(n_acc):
                    v = acc[r]
                    for w in cutlass.range_constexpr(1, self.k_warps):
                        v = v + sPartial[w, r, lane]
                    acc[r] = v
                self._epilogue(acc, mC, m_blk, 0, 0, row_warp, lane, valid_rows, alpha, out_gs, None)
                if cutlass.const_expr(self.pair_combine and not self.pair_cluster):
                    top_k = topk_weights.shape[1]
                    tok = m_blk // top_k
                    publish_stores()
                    counter = (counters.iterator + mW.shape[0] + 1 + tok * row_warps + row_warp).llvm_ptr
                    if count_in(counter, top_k):
                        reset_counter(counter)
                        col = row_warp * ROW_WARP_ROWS + 2 * lane  # lane l: the row warp's columns 2l, 2l + 1
                        y_base = mC.iterator.toint()
                        combine_word(y_base, mOut, mOut.shape[1], topk_weights, tok, top_k, self.tok_tile, col)
            if cutlass.const_expr(self.pair_cluster):
                cute.arch.cluster_arrive()  # release: this CTA's slot stores (warp 0's) before it
                cute.arch.cluster_wait()  # acquire: every slot is in rank 0's shared memory
                if slot_k == 0:
                    if warp == 0:  # lane l: the row warp's columns 2l, 2l + 1, pair k's from slot k
                        n_pairs = topk_weights.shape[1]
                        words = []
                        for kk in cutlass.range_constexpr(n_pairs):
                            words.append(bq.ld_shared_b32(self._cluster_slot + kk * (ROW_WARP_ROWS * 2) + lane * 4))
                        col = row_warp * ROW_WARP_ROWS + 2 * lane
                        combine_words(words, mOut, mOut.shape[1], topk_weights, m_blk // n_pairs, col)

    def _store_columns(self, cols: list, j: int, mC, m_blk, n_blk, wg, warp, lane, pair, pair_f32) -> None:
        """``swap_gemm``'s stores, or with ``pair_cluster`` the real token column's into the cluster slot
        (``_store_slot``); the padding columns and the y row are not stored then."""
        if cutlass.const_expr(not self.pair_cluster):
            super()._store_columns(cols, j, mC, m_blk, n_blk, wg, warp, lane, pair, pair_f32)
        elif cutlass.const_expr(j == 0):
            self._store_slot(cols, lane)

    @cute.jit
    def _store_slot(self, cols: list, lane) -> None:
        """``pair_cluster``: token column 0 (group 0, held by the even lanes of q = 0 after ``swap_gemm``'s
        exchange) as BF16 pairs into this pair's slot in rank 0's shared memory, word ``f / 2`` of the row warp's
        feature f."""
        i = lane >> 2
        odd = (i & 1) == 1
        real = (lane & 7) == 0  # q = 0 and i even
        for g in cutlass.range_constexpr(self.groups):  # features 8 g + i, 8 g + i + 1 (i even)
            send = cutlass.Float32(cutlass.select_(odd, cols[0][g], cols[1][g]))
            got = cute.arch.shuffle_sync_bfly(send, 4)
            if real:
                word = pack_bf16x2(cols[0][g], got)
                st_cluster_b32(self._cluster_slot + (4 * g + (i >> 1)) * 4, 0, word)

    def _num_blocks(self, meta: cute.Tensor, topk_ids: cute.Tensor, relaxed: bool = False):
        """M blocks of this call: the routing's count (``relaxed``: read with ld.relaxed.gpu, before the wait), or
        with ``pair_blocks`` one per pair."""
        if cutlass.const_expr(self.pair_blocks):
            return topk_ids.shape[0] * topk_ids.shape[1]
        if relaxed:
            return cute.arch.load(meta.iterator.llvm_ptr, Int32, sem="relaxed", scope="gpu")
        return meta[0]

    def _block_entry(self, m_block_expert: cute.Tensor, topk_ids: cute.Tensor, m_blk):
        """Block ``m_blk``'s entry: expert | real rows << 16 (``pair_blocks``: pair m_blk's expert, one row)."""
        if cutlass.const_expr(self.pair_blocks):
            return topk_ids[m_blk // topk_ids.shape[1], m_blk % topk_ids.shape[1]] | (1 << 16)
        return m_block_expert[m_blk]

    @cute.jit
    def _prepare_token_row(self, mX, mXs, act_gscale, tok, x_row, warp, lane) -> None:
        """``gather_x``: token ``tok``'s activation row into ``x_row`` as the gather prepares it (items of 32
        elements over ``TOKEN_LANES`` lanes, the block amax by shuffles; warp-uniform trip counts, lanes past
        the end redo the last slot and store nothing). ``row_tma`` passes ``x_row`` itself as ``mX`` (token 0): each
        lane rewrites only the 16 bytes it read, after the item's shuffles, so in place is safe."""
        lanes = TOKEN_LANES
        per_lane = ITEM // lanes
        j = lane % lanes
        vals = cute.make_rmem_tensor((1, per_lane), Float32)
        qfrag = cute.make_rmem_tensor((1, per_lane), cutlass.BFloat16)
        if cutlass.const_expr(self.prequantized):
            nitem = mXs.shape[1] // (ITEM // constants.QUANT_BLOCK[self.fmt])
            lane_bytes = item_bytes(self.fmt) // lanes
            raw = cute.make_rmem_tensor((1, lane_bytes), cutlass.Uint8)
        else:
            nitem = mX.shape[1] // ITEM
            frag = cute.make_rmem_tensor((1, per_lane), mX.element_type)
            gs = None  # the NVFP4 per-tensor constants
            if cutlass.const_expr(self.fmt == constants.FMT_NVFP4):
                gs = bq.nvfp4_global(act_gscale[0])
        slots = nitem * lanes
        for base in cutlass.range(warp * 32, slots, self.k_warps * 32, unroll=1):
            s = cutlass.min(base + lane, slots - 1)
            if cutlass.const_expr(self.prequantized):
                dequant_slot(mX, mXs, tok * slots + s, nitem, lanes, j, lane_bytes, raw, vals, qfrag, self.fmt)
            else:
                qdq_slot(mX, tok * slots + s, nitem, lanes, j, frag, vals, qfrag, self.fmt, gs)
            if base + lane < slots:
                cute.autovec_copy(qfrag, cute.local_tile(x_row, (1, per_lane), (0, s)))

    def _row_offsets(self, row_warp, lane) -> list:
        """offsets[a][h] = (weight row, 16-byte slot of the lane's segment in it) of atom a, row half h."""
        i = lane >> 2
        q = lane & 3
        d = self.data_bytes
        out = []
        for a in range(self.atoms):
            row_h = []
            for h in range(2):
                if cutlass.const_expr(self.gated):
                    f = row_warp * 32 + a * 8 + i  # feature: gate row, up row 128 further
                    half = constants.SWAP_GATE_UP_BLOCK // 2
                    row = (f // half) * constants.SWAP_GATE_UP_BLOCK + f % half + h * half
                else:
                    row = row_warp * ROW_WARP_ROWS + a * 16 + h * 8 + i
                seg = q if self.fmt == constants.FMT_MXFP8 else q & 1
                swz = (row // (128 // d)) % self.segs
                row_h.append((row, seg ^ swz))
            out.append(row_h)
        return out

    @cute.jit
    def _prefetch_units(self, mW, mS, expert, warp, mine, k_tiles, n_rows, row_warp, lane) -> None:
        """``l2_prefetch``: the warp's K units ``stages - 1 .. mine - 1`` (unit j is K unit ``warp + j * k_warps``)
        into L2, one bulk prefetch of the data and one of the scales per (unit, K tile of it, row range),
        those items spread over the lanes."""
        kts = 1 if self.fmt == constants.FMT_MXFP8 else 2  # K tiles (64) per unit
        ranges = 2 if self.gated else 1  # gated: the gate rows and the up rows of the row warp's 32 features
        range_rows = ROW_WARP_ROWS // ranges
        per_unit = kts * ranges
        first = self.stages - 1
        items = cutlass.max(mine - first, 0) * per_unit
        if cutlass.const_expr(self.gated):  # features 32 W .. 32 W + 31 lie in one gate/up block (_row_offsets)
            half = constants.SWAP_GATE_UP_BLOCK // 2
            f0 = row_warp * 32
            row0 = (f0 // half) * constants.SWAP_GATE_UP_BLOCK + f0 % half
        else:
            row0 = row_warp * ROW_WARP_ROWS
        w_base = mW.iterator.toint()
        s_base = mS.iterator.toint()
        for it in cutlass.range(lane, items, 32, unroll=1):
            j = first + it // per_unit
            t = (it % per_unit) // ranges
            rng = it % ranges
            kt = (warp + j * self.k_warps) * kts + t
            row = (Int64(expert) * k_tiles + kt) * n_rows + row0 + rng * (constants.SWAP_GATE_UP_BLOCK // 2)
            prefetch_l2(w_base + row * self.data_bytes, Int32(range_rows * self.data_bytes))
            prefetch_l2(s_base + row * self.scales_per_tile, Int32(range_rows * self.scales_per_tile))

    def _copy_weights(self, stage, mW, mS, expert, u, pred, k_tiles, n_rows, offsets, lane) -> None:
        """K unit ``u`` of the lane's eight rows into ring stage ``stage`` (row 2a + h: its 16 data bytes at
        ``DATA + r * 512 + lane * 16``, the 4-byte-aligned word holding its scale at ``SCALES + r * 128 + lane
        * 4``); zeros where ``pred`` does not hold."""
        q = lane & 3
        kt = u if self.fmt == constants.FMT_MXFP8 else 2 * u + (q >> 1)
        plane = (Int64(expert) * k_tiles + kt) * n_rows  # first row of (expert, K tile)
        w_base = mW.iterator.toint()
        s_base = mS.iterator.toint()
        for a in range(self.atoms):
            for h in range(2):
                r = 2 * a + h
                row, slot = offsets[a][h]
                data = w_base + (plane + row) * self.data_bytes + slot * constants.QUANT_SEGMENT_BYTES
                cp_async(stage + r * 512 + lane * 16, data, 16, pred)
                scale = s_base + (plane + row) * self.scales_per_tile  # MXFP8: 2 bytes, 2-aligned
                if cutlass.const_expr(self.fmt == constants.FMT_MXFP8):
                    scale = scale - (row & 1) * 2  # the word holding rows (row & ~1, row | 1)
                cp_async(stage + self.scales_at + r * 128 + lane * 4, scale, 4, pred)

    def _copy_tokens(self, stage, mA, m_blk, valid_rows, u, pred, lane) -> None:
        """The token operand of K unit ``u`` into ring stage ``stage`` (column group j, 16-byte chunk c at
        ``TOKENS + (j * x_chunks + c) * 512 + lane * 16``): lane (n, q) copies elements ``[x_chunks * 8 q,
        x_chunks * 8 (q + 1))`` of the unit from column 8 j + n's row; zeros for padding columns and where
        ``pred`` does not hold."""
        i = lane >> 2
        q = lane & 3
        a_base = mA.iterator.toint()
        elem0 = u * self.unit_k + q * (8 * self.x_chunks)
        for j in range(self.col_groups):
            col = 8 * j + i
            real = pred & (col < valid_rows)
            row = Int64(m_blk * self.tok_tile + col)
            for ch in range(self.x_chunks):
                dst = stage + self.tokens_at + (j * self.x_chunks + ch) * 512 + lane * 16
                cp_async(dst, a_base + (row * self.k + elem0 + 8 * ch) * 2, 16, real)

    @cute.jit
    def _unit_mma(self, acc, stage, valid_rows, lane, x_row, u) -> None:
        """The MMAs of the K unit in ring stage ``stage``, per 8-column group that holds a real row, the
        weight words converted atom by atom. ``gather_x``: the token fragments of unit ``u`` from ``x_row``."""
        q = lane & 3
        # MXFP8: the lane's scale byte in the copied word (every row of the lane has the parity of lane // 4)
        byte_shift = Uint32((2 * ((lane >> 2) & 1) + (q >> 1)) * 8)
        for j in cutlass.range_constexpr(self.col_groups):
            if 8 * j < valid_rows:
                if cutlass.const_expr(self.gather_x):  # lane (n, q): elements [x_chunks * 8 q, ...) of the unit
                    elem = u * self.unit_k + q * (8 * self.x_chunks)
                    row = bq.smem_addr(x_row.iterator) + elem * 2
                    x = [list(bq.ld_shared_v4(row + 16 * ch)) for ch in range(self.x_chunks)]
                else:
                    x = [
                        list(bq.ld_shared_v4(stage + self.tokens_at + (j * self.x_chunks + ch) * 512 + lane * 16))
                        for ch in range(self.x_chunks)
                    ]
                for a in cutlass.range_constexpr(self.atoms):
                    rows = []
                    for h in cutlass.range_constexpr(2):
                        r = 2 * a + h
                        words = list(bq.ld_shared_v4(stage + r * 512 + lane * 16))
                        scale = bq.ld_shared_b32(stage + self.scales_at + r * 128 + lane * 4)
                        if cutlass.const_expr(self.fmt == constants.FMT_MXFP8):
                            scale = (scale >> byte_shift) & Uint32(0xFF)
                        rows.append((words, scale))
                    self._atom_mma(acc, rows[0], rows[1], x, j, a, q)

    def _atom_mma(self, acc, lo_row, hi_row, x, j: int, a: int, q) -> None:
        """Atom ``a``'s MMAs for column group ``j``: ``lo_row`` / ``hi_row`` are the (data, scale) of the
        lane's rows in halves 0 and 1."""
        idx = [((0, 0, j), a, 0), ((1, 0, j), a, 0), ((0, 1, j), a, 0), ((1, 1, j), a, 0)]
        if cutlass.const_expr(self.fmt == constants.FMT_MXFP8):
            mult0 = bq.ue8m0_multiplier(lo_row[1])
            mult1 = bq.ue8m0_multiplier(hi_row[1])
        else:
            shift = Uint32((q & 1) * 16)  # the segment's two scale bytes
            m0 = bq.nvfp4_scale_multipliers(lo_row[1] >> shift, 2)
            m1 = bq.nvfp4_scale_multipliers(hi_row[1] >> shift, 2)
        for qq in range(4):
            if cutlass.const_expr(self.fmt == constants.FMT_MXFP8):
                lo0, hi0 = bq.e4m3x4_to_bf16x4(lo_row[0][qq], mult0)
                lo1, hi1 = bq.e4m3x4_to_bf16x4(hi_row[0][qq], mult1)
                steps = [((lo0, lo1, hi0, hi1), (x[0][qq], x[1][qq]))]
            else:
                o0 = bq.e2m1x8_to_bf16x8(lo_row[0][qq], m0[0], m0[1])
                o1 = bq.e2m1x8_to_bf16x8(hi_row[0][qq], m1[0], m1[1])
                steps = [
                    ((o0[2 * blk], o1[2 * blk], o0[2 * blk + 1], o1[2 * blk + 1]), (x[2 * blk][qq], x[2 * blk + 1][qq]))
                    for blk in range(2)
                ]
            for a_frag, b_frag in steps:
                d = mma_bf16_16816(list(a_frag), list(b_frag), [acc[ix] for ix in idx])
                for r in range(4):
                    acc[idx[r]] = d[r]
