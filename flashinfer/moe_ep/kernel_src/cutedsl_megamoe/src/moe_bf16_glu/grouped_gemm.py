"""Persistent warp-specialized grouped GEMM for Hopper (TMA + WGMMA), scheduled on the device.

C[rows of M block b] = A[rows of b] @ B[expert(b)].T for every M block b of the permuted row space.

- A: (M_cap, K) bf16, K-major (the permuted activations); M blocks never straddle experts.
- B: (N, K, E) bf16, K-major (the expert weights viewed with the expert as batch coordinate).
- C: (M_cap, N_out) bf16, written through smem with TMA stores (or, ``epi_direct``, straight
  from registers with 32-bit stores).
- ``m_block_expert[b]`` (packed: expert in bits 0..15, rows holding real pairs in bits 16..31)
  and ``meta[0]`` (number of M blocks) come from the routing kernel, so the tile count is only
  known on the device: the grid is persistent (one CTA per SM) and every CTA walks the linear
  tile index ``tile = b * n_tiles + n`` with a grid stride. A consumer warpgroup whose 64 rows are
  all expert padding skips its MMAs (it still walks the pipeline) and, with the direct epilogue,
  its stores.
- ``cluster_m = 2``: the two CTAs of a cluster take M blocks ``2g`` and ``2g + 1``, or with
  ``pair_by_expert`` the two blocks of entry g of the routing's pair table (the second half of
  ``m_block_expert``). When both belong to one expert they share each B tile (each CTA loads half
  and multicasts it to both); otherwise (an expert boundary, or the phantom block the routing
  appends to an odd count) each CTA loads its own whole B tile. Experts are padded to ``tile_m``
  only, not ``2 * tile_m``.
- Mainloop: one WGMMA batch (a K tile) in flight while the next is issued, the ring stage of batch
  k-1 released once it is done (``mma_overlap``; off: each batch waited for before the next stage is
  taken). A consumer warpgroup whose rows are all padding takes and frees the stages without MMAs: that
  branch holds the whole K loop, since a WGMMA under a branch inside the loop makes ptxas close each
  batch with an empty one at the join (so ``wait_group(1)`` would wait for the batch just issued).
- PDL: the prologue (barrier init, descriptor prefetch) runs before ``griddepcontrol.wait``.
- ``early_b`` (FC2, ``cluster_m = 1``): the weights do not depend on the kernel before (FC1), so the
  producer issues the B loads of its first tile's first ring stages before ``griddepcontrol.wait``
  (the A rows, FC1's output, after it): a CTA launched beside FC1's tail streams its weights then.
  It reads the routing's block map before the wait, which is safe only when the kernel before it
  triggers its dependents after its own wait (``trigger_after_wait``, set on FC1): the routing has
  then ended before this kernel starts.
- ``split_n`` (gated FC1 only): N tiles of ``tile_n`` over B interleaved per ``2 * tile_n`` rows (the
  layer's weight layout), so a decode step that touches few experts gets twice the CTAs to stream
  the weights without a second weight layout. Each stage loads two ``tile_n / 2``-row boxes, the
  gate rows and the up rows of one half of a layout block, into the two halves of the B stage: the
  tile then looks like one interleaved per ``tile_n`` to the MMA and the epilogue.
- ``pair_combine`` (FC2 with ``pair_blocks``): the combine happens here, not in a kernel of its own. A
  tile's one real row (row 0: lanes 0-3 of the first consumer warp) goes to y as bf16 with plain stores (the
  padding rows are not stored); the warp fences and counts itself in at the (token, N tile)'s counter
  (``counters[E + 1 + t * n_tiles + n]``, acq_rel); the last of the token's ``top_k`` arrivals reads the k
  rows back past L1 and stores ``out[t] = bf16(sum_k w[t,k] * y_k)``, k in order, one FMA each from zero: the
  combine kernel's arithmetic, so the same bits whichever CTA is last. It zeroes the counter again (the
  counting and the sums: ``src.pair_combine``, shared with the block-scaled GEMV).
- ``gather_a`` (FC1 at world size 1): A rows come straight from the token matrix ``x`` through
  ``row_token`` (the token of every real row of the permuted row space), so no gathered copy of
  the activations is written and read back. The whole producer warpgroup loads them with 16-byte
  ``cp.async`` (eight consecutive threads per 128-byte row segment, so a warp reads whole
  segments) into the 128-byte-swizzled A stage (chunk c of row r at chunk ``c ^ (r % 8)``, the
  TMA ``SWIZZLE_128B`` pattern the WGMMA descriptors expect); each producer thread's
  ``cp.async.mbarrier.arrive.noinc`` and warp 0's ``arrive.expect_tx`` for the B tile complete the
  stage's full barrier. Padding rows are not loaded (their smem rows hold stale data; their
  results are never read).

Warp roles: warpgroup 0 is the producer (warp 0 issues TMA loads into a multi-stage mbarrier
pipeline, registers released with setmaxnreg); warpgroups 1..W are consumers, each owning 64 rows
of the tile, running WGMMA and then the epilogue.

Epilogues: ``plain`` stores the accumulator as bf16. A gated activation expects B rows interleaved
per N tile (first half gate, second half up, see ``weights.interleave_gate_up``), so one thread
holds gate and up of the same output column in its accumulator fragment; it writes an N tile of
half the width. ``relu2`` applies relu(h)^2 on a full-width tile.
"""

# No `from __future__ import annotations`: cute.struct reads its annotations as objects.

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..common import constants
from ..src import activations
from ..src.pair_combine import combine_word, count_in, publish_stores, reset_counter, st_global_bf16x2

EPI_PLAIN = "plain"


def cp_async_16(dst_smem: cutlass.Int32, src_gmem: cutlass.Int64) -> None:
    """16 bytes global -> shared, cached in L2 only; the thread's next
    ``cp.async.mbarrier.arrive`` fires once it has landed."""
    cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16;", read_only_args=[dst_smem, src_gmem])


class GroupedGemmSm90:
    """One grouped GEMM stage (FC1 or FC2) of the MoE; compile-time knobs only."""

    def __init__(
        self,
        tile_m: int,
        tile_n: int,
        epilogue: str,
        limit: float | None,
        num_sms: int,
        ab_stages: int | None = None,
        epi_direct: bool = False,
        cluster_m: int = 1,
        pair_by_expert: bool = False,
        gather_a: bool = False,
        split_n: bool = False,
        early_b: bool = False,
        trigger_after_wait: bool = False,
        pair_blocks: bool = False,
        pair_combine: bool = False,
        mma_overlap: bool = True,
    ) -> None:
        # mma_overlap: WGMMA batch k+1 is issued before batch k is waited for (stage k is released once
        # batch k is done); False waits for each batch before the next stage is taken, as drops up to v46
        # did in effect (their padding branch around the WGMMAs made ptxas close every batch with an empty
        # one, so wait_group(1) waited for the batch just issued)
        self.mma_overlap = mma_overlap
        if pair_blocks and cluster_m != 1:
            raise ValueError("pair_blocks needs cluster_m=1")
        if pair_combine and not (pair_blocks and epilogue == EPI_PLAIN):
            raise ValueError("pair_combine needs pair_blocks and the plain epilogue (FC2)")
        self.pair_combine = pair_combine
        # pair_blocks: M block b is pair b of topk_ids (expert topk_ids.flat[b], one real row: token b // K);
        # no routing kernel writes a block map (the chain's one-token path)
        self.pair_blocks = pair_blocks
        if early_b and (gather_a or split_n or cluster_m != 1):
            raise ValueError("early_b needs TMA-loaded A rows, no split_n and cluster_m=1")
        self.early_b = early_b
        self.trigger_after_wait = trigger_after_wait
        # split_n: B is gate/up interleaved per 2 * tile_n rows; N tile n is half n % 2 of layout block
        # n // 2 (its gate rows and its up rows: two (tile_n / 2)-row TMA boxes per stage).
        self.split_n = split_n
        if split_n and (cluster_m != 1 or epilogue not in constants.GATED_ACTIVATIONS):
            raise ValueError("split_n needs a gated epilogue and cluster_m=1")
        if tile_m not in (64, 128, 256):
            raise ValueError(f"tile_m must be 64, 128 or 256, got {tile_m}")
        if tile_n not in (64, 128, 192, 256):
            raise ValueError(f"tile_n must be 64/128/192/256, got {tile_n}")
        if cluster_m not in (1, 2) or num_sms % cluster_m:
            raise ValueError(f"cluster_m must be 1 or 2 and divide num_sms, got {cluster_m}")
        self.tile_m = tile_m
        self.tile_n = tile_n
        # Cluster of cluster_m CTAs along M: a pair of M blocks of one expert shares each B tile,
        # loaded once by TMA multicast (each CTA loads 1/cluster_m of it for both), halving weight
        # traffic from L2/HBM; a pair that straddles two experts loads both tiles unshared.
        self.cluster_m = cluster_m
        if pair_by_expert and cluster_m != 2:
            raise ValueError("pair_by_expert needs cluster_m=2")
        self.pair_by_expert = pair_by_expert
        self.tile_k = constants.TILE_K
        self.epilogue = epilogue
        self.gated = epilogue in constants.GATED_ACTIVATIONS
        if self.gated and tile_n % 32 != 0:
            raise ValueError("gated epilogue needs tile_n % 32 == 0")
        # Output columns per tile: the gated epilogue halves the width.
        self.tile_n_out = tile_n // 2 if self.gated else tile_n
        self.limit = limit
        self.num_sms = num_sms
        self.acc_dtype = cutlass.Float32
        # Consumer warpgroups: 1 for 64 rows, else 2. The MMA atoms (64 rows each) alternate between
        # them: with tile_m=256 warpgroup w owns rows [64w, 64w+64) and [128+64w, 192+64w), and
        # each B tile serves twice the rows (half the weight traffic of tile_m=128).
        self.num_mma_wg = 1 if tile_m == 64 else 2
        if tile_m * tile_n // (self.num_mma_wg * 128) > 128:
            # More than 128 fp32 accumulators per thread spill (measured: 5x slower).
            raise ValueError(f"tile {tile_m}x{tile_n} needs > 128 accumulator registers per thread")
        self.threads_per_wg = 128
        self.num_threads = (1 + self.num_mma_wg) * self.threads_per_wg
        self.num_mma_threads = self.num_mma_wg * self.threads_per_wg
        self.gather_a = gather_a
        # setmaxnreg moves registers inside the launch budget (384 threads x 168): the producer must give
        # back what the consumers take (40 x 128 + 232 x 256 = 168 x 384), or the consumers' increase
        # never returns. The gathering producer lives with 40 as well.
        self.producer_regs = 40
        self.consumer_regs = 232 if self.num_mma_wg > 1 else 240
        # Direct epilogue: each thread stores its fragment straight to global memory (no smem, no
        # barriers between the consumer warpgroups); otherwise stmatrix -> smem -> TMA store.
        self.epi_direct = epi_direct
        self.epi_stages = 1 if epi_direct else 2
        self.ab_stages_override = ab_stages
        self.debug_print = False
        self.smem_capacity = utils.get_smem_capacity_in_bytes("sm_90")
        # Named barrier 1 syncs the consumer warpgroups around the epilogue smem buffers.
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)

    @property
    def layout_tile_n(self) -> int:
        """B rows per block of the weight layout (the gate/up interleave of a gated FC1): the N tile,
        or two of them with ``split_n``."""
        return 2 * self.tile_n if self.split_n else self.tile_n

    # ---------------------------------------------------------------- host-side setup (traced)
    def _setup(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor) -> None:
        self.ab_dtype = a.element_type
        self.c_dtype = c.element_type
        self.a_layout = utils.LayoutEnum.from_tensor(a)
        self.b_layout = utils.LayoutEnum.from_tensor(b)
        self.c_layout = utils.LayoutEnum.from_tensor(c)
        atom_layout = (self.num_mma_wg, 1, 1)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            atom_layout,
            tiler_mn=(64, self.tile_n),
        )
        # Same thread layout over the output tile: its C fragment is the first half of the full one.
        self.tiled_mma_out = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            atom_layout,
            tiler_mn=(64, self.tile_n_out),
        )
        self.mma_tiler = (self.tile_m, self.tile_n, self.tile_k)
        self.out_tiler = (self.tile_m, self.tile_n_out)
        self.epi_tile = (min(self.tile_m, 128) if self.num_mma_wg > 1 else 64, 32)
        if self.tile_n_out % 32 != 0:
            raise ValueError("output tile width must be a multiple of 32")

        ab_bytes = (self.tile_m + self.tile_n) * self.tile_k * self.ab_dtype.width // 8
        epi_stage_bytes = self.epi_tile[0] * self.epi_tile[1] * self.c_dtype.width // 8
        # The barriers sit in the first 1 KiB (the buffers are 1 KiB aligned and sized); 1 KiB slack.
        budget = self.smem_capacity - 2048
        if self.ab_stages_override is not None:
            self.ab_stages = self.ab_stages_override
        else:
            self.ab_stages = min(8, (budget - epi_stage_bytes * self.epi_stages) // ab_bytes)
        if not self.epi_direct:
            # Leftover shared memory deepens the TMA-store ring (up to 4 sub-tiles in flight), so
            # the epilogue rarely waits for an older store to drain before reusing a buffer.
            self.epi_stages = max(self.epi_stages, min(4, (budget - self.ab_stages * ab_bytes) // epi_stage_bytes))
        self.a_smem_layout = sm90_utils.make_smem_layout_a(self.a_layout, self.mma_tiler, self.ab_dtype, self.ab_stages)
        self.b_smem_layout = sm90_utils.make_smem_layout_b(self.b_layout, self.mma_tiler, self.ab_dtype, self.ab_stages)
        self.epi_smem_layout = sm90_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.epi_stages
        )

    def launch(
        self,
        a: cute.Tensor,
        b: cute.Tensor,
        c: cute.Tensor,
        m_block_expert: cute.Tensor,
        meta: cute.Tensor,
        stream,
        use_pdl: bool = False,
        x: cute.Tensor | None = None,
        row_token: cute.Tensor | None = None,
        topk_ids: cute.Tensor | None = None,
        out: cute.Tensor | None = None,
        topk_weights: cute.Tensor | None = None,
        counters: cute.Tensor | None = None,
    ) -> None:
        """Trace-time: build TMA descriptors and launch the persistent kernel on ``stream``.
        With ``gather_a``, ``a`` only sets the operand type: A rows come from ``x`` [T, H] through
        ``row_token`` [M_cap] int32 (no TMA descriptor over ``x``: T may be 0). With ``pair_combine``,
        ``out`` [T, H], ``topk_weights`` [T, K] and ``counters`` (the workspace's ``expert_count``)."""
        self._setup(a, b, c)
        a_smem_one = cute.slice_(self.a_smem_layout, (None, None, 0))
        b_smem_one = cute.slice_(self.b_smem_layout, (None, None, 0))
        epi_smem_one = cute.slice_(self.epi_smem_layout, (None, None, 0))
        b_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cluster_m > 1 else cpasync.CopyBulkTensorTileG2SOp()
        if cutlass.const_expr(self.split_n):
            b_half_layout = sm90_utils.make_smem_layout_b(
                self.b_layout, (self.tile_m, self.tile_n // 2, self.tile_k), self.ab_dtype, 1
            )
            tma_b, tma_tensor_b = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), b, cute.slice_(b_half_layout, (None, None, 0)),
                (self.tile_n // 2, self.tile_k),
            )
        else:
            tma_b, tma_tensor_b = cpasync.make_tiled_tma_atom(
                b_op, b, b_smem_one, (self.tile_n, self.tile_k), num_multicast=self.cluster_m
            )
        tma_c, tma_tensor_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), c, epi_smem_one, self.epi_tile
        )
        self.tma_bytes = cute.size_in_bytes(self.ab_dtype, b_smem_one)
        if cutlass.const_expr(self.gather_a):
            tma_a, tma_tensor_a = tma_b, tma_tensor_b  # unused placeholders
        else:
            tma_a, tma_tensor_a = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), a, a_smem_one, (self.tile_m, self.tile_k)
            )
            self.tma_bytes += cute.size_in_bytes(self.ab_dtype, a_smem_one)
            x, row_token = a, meta  # unused placeholders
        if cutlass.const_expr(not self.pair_blocks):
            topk_ids = meta  # unused placeholder
        if cutlass.const_expr(not self.pair_combine):
            out, topk_weights, counters = c, meta, meta  # unused placeholders

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_layout)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_a,
            tma_tensor_a,
            tma_b,
            tma_tensor_b,
            tma_c,
            tma_tensor_c,
            c,
            m_block_expert,
            meta,
            x,
            row_token,
            topk_ids,
            out,
            topk_weights,
            counters,
            self.tiled_mma,
            self.tiled_mma_out,
            self.a_smem_layout,
            self.b_smem_layout,
            self.epi_smem_layout,
        ).launch(
            grid=[self.num_sms, 1, 1],
            block=[self.num_threads, 1, 1],
            cluster=[self.cluster_m, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=use_pdl,
        )

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        mC_plain: cute.Tensor,
        m_block_expert: cute.Tensor,
        meta: cute.Tensor,
        mX: cute.Tensor,
        row_token: cute.Tensor,
        topk_ids: cute.Tensor,
        mOut: cute.Tensor,
        topk_weights: cute.Tensor,
        counters: cute.Tensor,
        tiled_mma: cute.TiledMma,
        tiled_mma_out: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        epi_smem_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)

        if warp_idx == 0:
            if cutlass.const_expr(not self.gather_a):
                cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_c)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # Cluster along M: a stage's B buffer may be filled by both CTAs' multicasts, so it is free
        # only once the consumers of both CTAs released it (each consumer warp arrives in both CTAs).
        cta_layout_mnk = cute.make_layout((self.cluster_m, 1, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
        b_self_mask = cutlass.Int16(1) << cta_rank
        # Full barrier: warp 0's arrive.expect_tx, plus with gather_a one cp.async arrive per producer thread.
        producer_group = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, 1 + self.threads_per_wg if self.gather_a else 1
        )
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cluster_m * self.num_mma_wg * 4)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=producer_group,
            consumer_group=consumer_group,
            tx_count=self.tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sC = storage.sC.get_tensor(epi_smem_layout.outer, swizzle=epi_smem_layout.inner)

        # (bM, bK, RestM, RestK) / (bN, bK, RestN, RestK, E) / (bM, bNout, RestM, RestNout)
        if cutlass.const_expr(not self.gather_a):
            gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (None, None))
        gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None, None))
        gC = cute.local_tile(mC, self.out_tiler, (None, None))
        gC_plain = cute.local_tile(mC_plain, self.out_tiler, (None, None))

        if cutlass.const_expr(not self.gather_a):
            tAsA, tAgA = cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
        k_tiles = cute.size(gB, mode=[3])
        n_tiles = cute.size(gB, mode=[2])
        if cutlass.const_expr(self.split_n):
            # Boxes of tile_n / 2 rows: gmem (box, N / (tile_n / 2), K tiles, E); smem: the lower (tBsB) and
            # the upper (tBsB_other) half of each stage (see _load_b).
            g_half = cute.local_tile(mB, (self.tile_n // 2, self.tile_k), (None, None, None))
            s_halves = cute.zipped_divide(sB, (self.tile_n // 2, self.tile_k))
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), s_halves[(None, (0, 0, None))], cute.group_modes(g_half, 0, 2)
            )
            tBsB_other, tBgB_other = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), s_halves[(None, (1, 0, None))], cute.group_modes(g_half, 0, 2)
            )
        else:
            tBsB, tBgB = cpasync.tma_partition(
                tma_b,
                cluster_coord[0],
                cute.make_layout(self.cluster_m),
                cute.group_modes(sB, 0, 2),
                cute.group_modes(gB, 0, 2),
            )
            # The partner CTA's slice of each B tile: loaded here too when the two blocks' experts differ.
            tBsB_other, tBgB_other = cpasync.tma_partition(
                tma_b,
                (cluster_coord[0] + 1) % self.cluster_m,
                cute.make_layout(self.cluster_m),
                cute.group_modes(sB, 0, 2),
                cute.group_modes(gB, 0, 2),
            )

        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))
        first_tile = bidx // self.cluster_m
        tile_stride = grid_x // self.cluster_m
        # B stages of the first tile issued before the wait (early_b)
        early_k = min(self.ab_stages, k_tiles) if self.early_b else 0
        if cutlass.const_expr(self.early_b):
            if warp_idx == 0:
                self._early_b_loads(
                    ab_pipe, tma_b, tBgB, tBsB, tBgB_other, tBsB_other, m_block_expert, meta, topk_ids, first_tile,
                    n_tiles,
                    early_k, b_mcast_mask, b_self_mask,
                )  # fmt: skip
        # PDL: the prologue above overlapped the previous kernel; its outputs are read below.
        if cutlass.const_expr(not self.trigger_after_wait):
            cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(self.trigger_after_wait):
            cute.arch.griddepcontrol_launch_dependents()
        # Cluster tiles: (group of cluster_m M blocks, n); this CTA takes block cluster_m*g + rank
        # (an odd block count ends with a phantom block: no real rows, see the routing scan).
        num_tiles = (self._num_blocks(meta, topk_ids) + self.cluster_m - 1) // self.cluster_m * n_tiles

        if wg_idx == 0:
            # ------------------------------------------------------------ producer warpgroup
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if cutlass.const_expr(self.gather_a):
                # gather_a: all four warps load A rows (cp.async); warp 0 also loads B (TMA). Eight
                # consecutive threads take the eight 16-byte chunks of one row (a warp reads four whole
                # 128-byte row segments per instruction); thread group g = tidx // 8 takes rows g + 16 j.
                rows_pt = self.tile_m // 16
                chunk = tidx % 8
                group = tidx // 8
                swz = (chunk ^ (group % 8)) << 4  # row g + 16 j has the same row % 8 as g
                a_smem = storage.sA.data_ptr().toint()
                x_base = mX.iterator.toint()
                row_bytes = cute.size(mX, mode=[1]) * 2
                stage_bytes = self.tile_m * self.tile_k * 2
                k_bytes = self.tile_k * 2
                prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                tile = first_tile
                while tile < num_tiles:
                    grp = tile // n_tiles
                    n_blk = tile - grp * n_tiles
                    m_blk = self._m_block(m_block_expert, grp, cluster_coord[0])
                    expert = self._block_entry(m_block_expert, topk_ids, m_blk) & 0xFFFF
                    valid_rows = self._block_entry(m_block_expert, topk_ids, m_blk) >> 16
                    share_b = cutlass.Boolean(False)
                    if cutlass.const_expr(self.cluster_m > 1):
                        partner = self._m_block(m_block_expert, grp, (cluster_coord[0] + 1) % self.cluster_m)
                        share_b = (m_block_expert[partner] & 0xFFFF) == expert
                    # The token of each of this thread's rows (-1: a padding row, not loaded).
                    tok = []
                    for j in cutlass.range_constexpr(rows_pt):
                        t = cutlass.Int32(-1)
                        if group + 16 * j < valid_rows:
                            t = self._row_token(row_token, topk_ids, m_blk, group + 16 * j)
                        tok.append(t)
                    for k in cutlass.range(k_tiles, unroll=1):
                        ab_pipe.sync_object_empty.wait(prod_state.index, prod_state.phase)
                        if warp_idx == 0:
                            ab_pipe.producer_acquire(prod_state)
                            self._load_b(
                                ab_pipe, prod_state, tma_b, tBgB, tBsB, tBgB_other, tBsB_other, n_blk, k, expert,
                                share_b, b_mcast_mask, b_self_mask,
                            )
                        dst = a_smem + prod_state.index * stage_bytes + group * 128 + swz
                        col = k * k_bytes + chunk * 16
                        for j in cutlass.range_constexpr(rows_pt):
                            if tok[j] >= 0:
                                src = x_base + cutlass.Int64(tok[j]) * row_bytes + col
                                cp_async_16(dst + j * 16 * 128, src)
                        cute.arch.cp_async_mbarrier_arrive_noinc(ab_pipe.producer_get_barrier(prod_state))
                        prod_state.advance()
                    tile += tile_stride
                if warp_idx == 0:
                    ab_pipe.producer_tail(prod_state)
            else:
                if warp_idx == 0:
                    prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                    tile = first_tile
                    while tile < num_tiles:
                        grp = tile // n_tiles
                        n_blk = tile - grp * n_tiles
                        m_blk = self._m_block(m_block_expert, grp, cluster_coord[0])
                        expert = self._block_entry(m_block_expert, topk_ids, m_blk) & 0xFFFF
                        # Both CTAs derive the same answer from the same two entries.
                        share_b = cutlass.Boolean(False)
                        if cutlass.const_expr(self.cluster_m > 1):
                            partner = self._m_block(m_block_expert, grp, (cluster_coord[0] + 1) % self.cluster_m)
                            share_b = (m_block_expert[partner] & 0xFFFF) == expert
                        for k in cutlass.range(k_tiles, unroll=1):
                            # early_b: the first tile's first early_k stages hold their B tile already
                            late = True
                            if cutlass.const_expr(self.early_b):
                                late = (tile != first_tile) | (k >= early_k)
                            if late:
                                ab_pipe.producer_acquire(prod_state)
                            bar = ab_pipe.producer_get_barrier(prod_state)
                            cute.copy(
                                tma_a,
                                tAgA[(None, m_blk, k)],
                                tAsA[(None, prod_state.index)],
                                tma_bar_ptr=bar,
                            )
                            if late:
                                self._load_b(
                                    ab_pipe, prod_state, tma_b, tBgB, tBsB, tBgB_other, tBsB_other, n_blk, k, expert,
                                    share_b, b_mcast_mask, b_self_mask,
                                )  # fmt: skip
                            ab_pipe.producer_commit(prod_state)
                            prod_state.advance()
                        tile += tile_stride
                    ab_pipe.producer_tail(prod_state)
        else:
            # ------------------------------------------------------------ consumer warpgroups
            cute.arch.setmaxregister_increase(self.consumer_regs)
            mma_tidx = tidx - self.threads_per_wg
            wg_thread_layout = cute.make_layout(self.num_mma_wg, stride=self.threads_per_wg)
            thr_mma = tiled_mma.get_slice(wg_thread_layout(wg_idx - 1))
            thr_mma_out = tiled_mma_out.get_slice(wg_thread_layout(wg_idx - 1))

            tCsA = thr_mma.partition_A(sA)
            tCsB = thr_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            acc_shape = thr_mma.partition_shape_C((self.tile_m, self.tile_n))
            acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            if cutlass.const_expr(self.epilogue == EPI_PLAIN):
                acc_out = acc  # no transform: store the accumulator itself
            else:
                out_shape = thr_mma_out.partition_shape_C(self.out_tiler)
                acc_out = cute.make_rmem_tensor(out_shape, self.acc_dtype)
            # Direct epilogue: per-thread view of the C tile (the MMA slices are per warpgroup),
            # two bf16 (one 32-bit store) per access, matching the accumulator fragment.
            r_out = cute.make_rmem_tensor(acc_out.shape, self.c_dtype)
            store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.c_dtype, num_bits_per_copy=32)
            tiled_store = cute.make_tiled_copy_C(store_atom, tiled_mma_out)
            thr_store = tiled_store.get_slice(mma_tidx)
            tDrC = tiled_store.retile(r_out)
            if cutlass.const_expr(self.debug_print):
                print("acc", acc.layout, "acc_out", acc_out.layout)

            # Epilogue: registers -> smem (stmatrix) -> gmem (TMA store), epi_tile at a time.
            r2s_atom = sm90_utils.get_smem_store_op(self.c_layout, self.c_dtype, self.acc_dtype)
            stm_atom = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.c_dtype
            )
            tiled_r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma_out))
            thr_r2s = tiled_r2s.get_slice(mma_tidx)
            tRS_sC = thr_r2s.partition_D(sC)
            tRS_acc = tiled_r2s.retile(acc_out)
            rD_shape = cute.shape(thr_r2s.partition_S(sC))
            tRS_rD = cute.make_rmem_tensor(rD_shape[:3], self.acc_dtype)
            tRS_rD_out = cute.make_rmem_tensor(rD_shape[:3], self.c_dtype)
            store_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
            )

            num_kb = cute.size(tCrA, mode=[2])
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            epi_count = cutlass.Int32(0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            tile = first_tile
            while tile < num_tiles:
                grp = tile // n_tiles
                n_blk = tile - grp * n_tiles
                m_blk = self._m_block(m_block_expert, grp, cluster_coord[0])
                # Rows of this M block that hold real pairs (the rest is expert padding): a
                # warpgroup whose 64 rows are all padding skips its MMAs and its stores.
                valid_rows = self._block_entry(m_block_expert, topk_ids, m_blk) >> 16
                active = valid_rows > (wg_idx - 1) * 64  # its first 64-row atom holds real rows

                # ---- mainloop: keep one WGMMA batch in flight, release the stage before it. The branch on
                # `active` holds the whole loop: with a WGMMA under a branch inside the loop, ptxas closes each
                # batch with an empty one at the join, and wait_group(1) then waits for the batch just issued.
                acc.fill(0.0)
                if active:
                    warpgroup.fence()
                    ab_pipe.consumer_wait(read_state)
                    self._order_gathered_a()
                    for kb in cutlass.range_constexpr(num_kb):
                        cute.gemm(
                            tiled_mma,
                            acc,
                            tCrA[(None, None, kb, read_state.index)],
                            tCrB[(None, None, kb, read_state.index)],
                            acc,
                        )
                    warpgroup.commit_group()
                    read_state.advance()
                    for _k in cutlass.range(1, k_tiles, unroll=1):
                        ab_pipe.consumer_wait(read_state)
                        self._order_gathered_a()
                        for kb in cutlass.range_constexpr(num_kb):
                            cute.gemm(
                                tiled_mma,
                                acc,
                                tCrA[(None, None, kb, read_state.index)],
                                tCrB[(None, None, kb, read_state.index)],
                                acc,
                            )
                        warpgroup.commit_group()
                        warpgroup.wait_group(1 if self.mma_overlap else 0)
                        ab_pipe.consumer_release(release_state)
                        release_state.advance()
                        read_state.advance()
                    warpgroup.wait_group(0)
                    ab_pipe.consumer_release(release_state)
                    release_state.advance()
                else:
                    # 64 rows of expert padding: take and free every stage, no MMA
                    for _k in cutlass.range(k_tiles, unroll=1):
                        ab_pipe.consumer_wait(read_state)
                        ab_pipe.consumer_release(release_state)
                        release_state.advance()
                        read_state.advance()

                # ---- epilogue math in registers
                self._epilogue_math(acc, acc_out)

                # ---- store
                if cutlass.const_expr(self.pair_combine):
                    if warp_idx == self.threads_per_wg // 32:  # the first consumer warp: row 0 in lanes 0-3
                        self._combine_pair(
                            acc, mC_plain, mOut, topk_weights, counters, m_blk, n_blk, n_tiles, cute.size(mB, mode=[2])
                        )
                elif cutlass.const_expr(self.epi_direct):
                    if active:
                        tDgC = thr_store.partition_D(gC_plain[(None, None, m_blk, n_blk)])
                        r_out.store(acc_out.load().to(self.c_dtype))
                        cute.copy(tiled_store, tDrC, tDgC)
                else:
                    epi_count = self._tma_epilogue(
                        tma_c,
                        gC,
                        sC,
                        m_blk,
                        n_blk,
                        warp_idx,
                        tiled_r2s,
                        tRS_sC,
                        tRS_acc,
                        tRS_rD,
                        tRS_rD_out,
                        store_pipe,
                        epi_count,
                    )
                tile += tile_stride
            store_pipe.producer_tail()

    def _num_blocks(self, meta: cute.Tensor, topk_ids: cute.Tensor):
        """M blocks of this call: the routing's count, or with ``pair_blocks`` one per pair."""
        if cutlass.const_expr(self.pair_blocks):
            return topk_ids.shape[0] * topk_ids.shape[1]
        return meta[0]

    def _block_entry(self, m_block_expert: cute.Tensor, topk_ids: cute.Tensor, m_blk):
        """Block ``m_blk``'s entry: expert | real rows << 16 (``pair_blocks``: pair m_blk's expert, one row)."""
        if cutlass.const_expr(self.pair_blocks):
            return topk_ids[m_blk // topk_ids.shape[1], m_blk % topk_ids.shape[1]] | (1 << 16)
        return m_block_expert[m_blk]

    def _row_token(self, row_token: cute.Tensor, topk_ids: cute.Tensor, m_blk, row):
        """The token of real row ``row`` of block ``m_blk`` (``pair_blocks``: the pair's token)."""
        if cutlass.const_expr(self.pair_blocks):
            return m_blk // topk_ids.shape[1]
        return row_token[m_blk * self.tile_m + row]

    def _m_block(self, m_block_expert: cute.Tensor, grp, rank):
        """The M block that CTA ``rank`` of cluster group ``grp`` takes (see the module docstring)."""
        if cutlass.const_expr(self.pair_by_expert):
            return m_block_expert[m_block_expert.shape[0] // 2 + grp * 2 + rank]
        return grp * self.cluster_m + rank

    def _order_gathered_a(self) -> None:
        """gather_a: the A stage was written by cp.async (generic proxy) and WGMMA reads it through
        the async proxy: order the two after the full barrier."""
        if cutlass.const_expr(self.gather_a):
            cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def _early_b_loads(
        self,
        ab_pipe,
        tma_b,
        tBgB,
        tBsB,
        tBgB_other,
        tBsB_other,
        m_block_expert,
        meta,
        topk_ids,
        first_tile,
        n_tiles,
        early_k: cutlass.Constexpr,
        mcast,
        self_mask,
    ) -> None:
        """``early_b``, warp 0 before ``griddepcontrol.wait``: acquire the first ``early_k`` ring stages and
        issue their B loads for this CTA's first tile (the stage's full barrier then waits for the A rows,
        loaded after the wait). The routing's outputs are read with ld.relaxed.gpu (not through L1)."""
        if cutlass.const_expr(self.pair_blocks):
            blocks = topk_ids.shape[0] * topk_ids.shape[1]
        else:
            blocks = cute.arch.load(meta.iterator.llvm_ptr, cutlass.Int32, sem="relaxed", scope="gpu")
        if first_tile < blocks * n_tiles:
            m_blk = first_tile // n_tiles
            n_blk = first_tile - m_blk * n_tiles
            if cutlass.const_expr(self.pair_blocks):  # topk_ids (row-major): pair m_blk is element m_blk
                entry_ptr = (topk_ids.iterator + m_blk).llvm_ptr
            else:
                entry_ptr = (m_block_expert.iterator + m_blk).llvm_ptr
            entry = cute.arch.load(entry_ptr, cutlass.Int32, sem="relaxed", scope="gpu")
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
            for k in cutlass.range(early_k, unroll=1):
                ab_pipe.producer_acquire(state)
                self._load_b(
                    ab_pipe, state, tma_b, tBgB, tBsB, tBgB_other, tBsB_other, n_blk, k, entry & 0xFFFF, False, mcast,
                    self_mask,
                )  # fmt: skip
                state.advance()

    @cute.jit
    def _load_b(
        self, ab_pipe, state, tma_b, tBgB, tBsB, tBgB_other, tBsB_other, n_blk, k, expert, share_b, mcast, self_mask
    ) -> None:
        """TMA of the stage's B tile: alone, shared with the cluster partner (each CTA loads its
        slice for both), or, when the partner's block belongs to another expert, both slices here."""
        bar = ab_pipe.producer_get_barrier(state)
        if cutlass.const_expr(self.split_n):
            # Layout block j (2 * tile_n rows) = boxes 4j..4j+3: gate of half 0, gate of half 1, up of half 0,
            # up of half 1. Tile n: gate box 4 (n // 2) + n % 2 into the lower half, its up box (+ 2) above.
            q = (n_blk // 2) * 4 + n_blk % 2
            cute.copy(tma_b, tBgB[(None, q, k, expert)], tBsB[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_b, tBgB[(None, q + 2, k, expert)], tBsB_other[(None, state.index)], tma_bar_ptr=bar)
        elif cutlass.const_expr(self.cluster_m == 1):
            cute.copy(tma_b, tBgB[(None, n_blk, k, expert)], tBsB[(None, state.index)], tma_bar_ptr=bar)
        else:
            if share_b:
                cute.copy(
                    tma_b, tBgB[(None, n_blk, k, expert)], tBsB[(None, state.index)], tma_bar_ptr=bar, mcast_mask=mcast
                )
            else:
                cute.copy(
                    tma_b, tBgB[(None, n_blk, k, expert)], tBsB[(None, state.index)], tma_bar_ptr=bar,
                    mcast_mask=self_mask,
                )
                cute.copy(
                    tma_b, tBgB_other[(None, n_blk, k, expert)], tBsB_other[(None, state.index)], tma_bar_ptr=bar,
                    mcast_mask=self_mask,
                )

    @cute.jit
    def _tma_epilogue(
        self,
        tma_c: cute.CopyAtom,
        gC: cute.Tensor,
        sC: cute.Tensor,
        m_blk: cutlass.Int32,
        n_blk: cutlass.Int32,
        warp_idx: cutlass.Int32,
        tiled_r2s: cute.TiledCopy,
        tRS_sC: cute.Tensor,
        tRS_acc: cute.Tensor,
        tRS_rD: cute.Tensor,
        tRS_rD_out: cute.Tensor,
        store_pipe: pipeline.PipelineTmaStore,
        epi_count: cutlass.Int32,
    ) -> cutlass.Int32:
        """registers -> smem (stmatrix) -> gmem (TMA store), one epi_tile at a time."""
        gC_epi = cute.zipped_divide(gC[(None, None, m_blk, n_blk)], self.epi_tile)
        bSG_sC, bSG_gC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi)
        epi_n = cute.size(gC_epi, mode=[1])
        epi_shape = gC_epi.shape[1]
        epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        rd_size = cute.size(tRS_rD)
        for e in cutlass.range_constexpr(epi_n):
            for v in cutlass.range_constexpr(rd_size):
                tRS_rD[v] = tRS_acc[e * rd_size + v]
            tRS_rD_out.store(tRS_rD.load().to(self.c_dtype))
            buf = epi_count % self.epi_stages
            cute.copy(tiled_r2s, tRS_rD_out, tRS_sC[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            self.epi_barrier.arrive_and_wait()
            if warp_idx == 4:
                cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, epi_layout.get_hier_coord(e))])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            self.epi_barrier.arrive_and_wait()
            epi_count += 1
        return epi_count

    @cute.jit
    def _combine_pair(
        self,
        acc: cute.Tensor,
        mY: cute.Tensor,
        mOut: cute.Tensor,
        topk_weights: cute.Tensor,
        counters: cute.Tensor,
        m_blk: cutlass.Int32,
        n_blk: cutlass.Int32,
        n_tiles: cutlass.Int32,
        num_experts: cutlass.Int32,
    ) -> None:
        """``pair_combine``, one warp (the first consumer warp: lanes 0-3 hold row 0 of the accumulator, columns
        ``8 j + 2 lane + (0, 1)``): store pair ``m_blk``'s row to y, count it in, and if it is the token's last
        pair of this N tile, combine the token's ``top_k`` rows of the tile into ``out`` (module docstring)."""
        lane = cute.arch.lane_idx()
        top_k = topk_weights.shape[1]
        hidden = mOut.shape[1]
        tok = m_blk // top_k
        col0 = n_blk * self.tile_n
        y_base = mY.iterator.toint()
        if lane < 4:
            row = y_base + (cutlass.Int64(m_blk * self.tile_m) * hidden + col0 + 2 * lane) * 2
            for j in cutlass.range_constexpr(self.tile_n // 8):
                st_global_bf16x2(row + j * 16, acc[((0, 0, j), 0, 0)], acc[((1, 0, j), 0, 0)])
        publish_stores()
        counter = (counters.iterator + num_experts + 1 + tok * n_tiles + n_blk).llvm_ptr
        if count_in(counter, top_k):
            reset_counter(counter)
            # lane l sums the bf16 pairs (words) l, l + 32, ... of the tile's columns over the k rows
            for i in cutlass.range_constexpr(self.tile_n // 64):
                col = col0 + 2 * (lane + 32 * i)
                combine_word(y_base, mOut, hidden, topk_weights, tok, top_k, self.tile_m, col)

    def _epilogue_math(self, acc: cute.Tensor, acc_out: cute.Tensor) -> None:
        """Fill the fp32 output fragment from the accumulator (trace-time unrolled)."""
        if self.gated:
            # Fragment mode 0 is ((2, 2, N/8)): the N/8 column groups of 8. The gate half of the
            # tile is column groups [0, N/16), the up half [N/16, N/8): same thread, same slot.
            half_groups = self.tile_n // 16
            n_mm = cute.size(acc, mode=[1])
            for mm in range(n_mm):
                for j in range(half_groups):
                    for v1 in range(2):
                        for v0 in range(2):
                            g = acc[((v0, v1, j), mm, 0)]
                            u = acc[((v0, v1, j + half_groups), mm, 0)]
                            acc_out[((v0, v1, j), mm, 0)] = activations.gated_act(self.epilogue, g, u, self.limit)
        elif self.epilogue != EPI_PLAIN:
            for i in range(cute.size(acc)):
                acc_out[i] = activations.plain_act(self.epilogue, acc[i])
