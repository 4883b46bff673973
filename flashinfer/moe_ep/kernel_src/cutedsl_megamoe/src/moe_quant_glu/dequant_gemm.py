"""Grouped GEMM with block-scaled weights (MXFP8 or NVFP4) on Hopper: dequantize in shared memory,
multiply with BF16 WGMMA. Same scheduling, producer and epilogue as ``moe_bf16_glu.grouped_gemm``.

Pipeline per K tile (64):

- producer warp: one TMA box of A (bf16, ``tile_m x 64``), one of the packed weight data
  (``tile_n x D`` bytes) and one of their raw block scales (``tile_n x S`` bytes, see ``weights``)
  into stage ``s`` of the ring;
- consumer warpgroups (two, whatever rows they own; with ``tile_m=64`` the second only converts):
  convert the packed rows of stage ``s`` into a BF16 tile in the 128B-swizzled K-major layout WGMMA
  reads, in one of three BF16 buffers; ``fence.proxy.async`` + named barrier, then the WGMMA.

Per K tile k: issue WGMMA k; convert tile k+1 into buffer (k+1) % 3, which WGMMA k-2 read and which
every warpgroup has already waited for; ``wait_group(1)`` (WGMMA k-1 done) and release its ring
stage; one named barrier (tile k+1 converted by everyone). With two buffers (``bf_buffers=2``) the
conversion must wait for every warpgroup's WGMMA k-1 first: two barriers per K tile and less overlap.
Measured (TUNING.md): three buffers are 22 % faster at decode (tile_m 64) and 6 % at prefill although
the third buffer costs a ring stage; separate A and weight rings fed by two producer warps were slower.

Epilogue: the fp32 accumulator is multiplied by what the conversion left out (``MXFP8_ACC_SCALE``, or
for NVFP4 ``NVFP4_ACC_SCALE`` times the global scales ``act_gscale[i] * w_gscale[expert]``); then
the activation (FC1) and, with ``requant``, the quantize-dequantize of the output along N in blocks of
the format (amax over a row's block: 8 or 4 values per thread, a quad of lanes holds the row), stored
as exact BF16.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..common import constants
from ..moe_bf16_glu.grouped_gemm import GroupedGemmSm90
from ..src import block_quant as bq

RAW_BOX = 256  # bytes per TMA box row of the packed weights (the widest box dimension)


def packed_view(w: cute.Tensor, inner: int) -> cute.Tensor:
    """torch [E, K/64, N, B] uint8 (contiguous) -> cute (inner, N*B/inner, K/64, E): each (expert, K
    tile) is one run of ``inner``-byte rows, moved by TMA as such rather than as B-byte rows."""
    e, kt, n, b = w.shape
    run = n * b
    layout = cute.make_layout((inner, run // inner, kt, e), stride=(1, inner, run, kt * run))
    return cute.make_tensor(w.iterator, layout)


def ring_state(stages: int, n):
    """The consumer state of the n-th K tile taken from a ring of ``stages`` (the phase flips at each
    wrap): consumers derive every state from one running count."""
    return pipeline.PipelineState(stages, n, n % stages, (n // stages) & 1)


def box_inner(rows: int, row_bytes: int) -> int:
    """The inner TMA box extent for ``rows`` packed rows of ``row_bytes``: 256 bytes, or the whole run."""
    return min(RAW_BOX, rows * row_bytes)


class DequantGroupedGemmSm90(GroupedGemmSm90):
    """One grouped GEMM stage (FC1 or FC2) with packed block-scaled weights."""

    def __init__(
        self,
        fmt: str,
        tile_m: int,
        tile_n: int,
        epilogue: str,
        limit: float | None,
        num_sms: int,
        ab_stages: int | None = None,
        requant: bool = False,
        gscale_index: int = 0,
        probe: int = 0,
        bf_buffers: int = 3,
    ) -> None:
        super().__init__(tile_m, tile_n, epilogue, limit, num_sms, ab_stages, epi_direct=False, cluster_m=1)
        if fmt not in constants.QUANT_FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        self.fmt = fmt
        self.requant = requant
        self.gscale_index = gscale_index
        self.data_bytes = constants.QUANT_DATA_BYTES[fmt]
        self.scales_per_tile = constants.QUANT_SCALES_PER_TILE[fmt]
        self.segs = self.data_bytes // constants.QUANT_SEGMENT_BYTES  # data segments per row
        # Two consumer warpgroups convert whatever tile_m is: with tile_m=64 the second one only
        # converts (no MMA rows), so a decode tile loads 64 rows of A, not 128, and still has 256
        # threads dequantizing.
        self.num_conv_wg = 2
        self.num_conv_threads = self.num_conv_wg * self.threads_per_wg
        self.num_threads = (1 + self.num_conv_wg) * self.threads_per_wg
        self.consumer_regs = 232
        # Conversion work: one 16-byte data segment per thread and step (16 MXFP8 / 32 NVFP4 weights).
        # Fewer segments than threads (NVFP4, tile_n 64): two threads convert each, writing equal values.
        self.conv_units = tile_n * self.segs
        if self.conv_units % self.num_conv_threads and self.num_conv_threads % self.conv_units:
            raise ValueError(f"tile_n={tile_n}: {self.conv_units} segments do not split over the converting threads")
        self.conv_steps = max(1, self.conv_units // self.num_conv_threads)
        self.conv_barrier = pipeline.NamedBarrier(barrier_id=2, num_threads=self.num_conv_threads)
        # Profiling only (wrong results): bit 0 skips the conversion, bit 1 the per-K-tile barriers.
        self.probe = probe
        # Converted BF16 buffers: 2 (convert K tile k+1 once every warpgroup's WGMMA k-1 is done: two
        # barriers per K tile) or 3 (the buffer being filled was read by WGMMA k-2, already waited
        # for: one barrier per K tile, at the cost of one ring stage of shared memory).
        if bf_buffers not in (2, 3):
            raise ValueError(f"bf_buffers must be 2 or 3, got {bf_buffers}")
        self.bf_buffers = bf_buffers

    def _setup(self, a: cute.Tensor, c: cute.Tensor) -> None:
        self.ab_dtype = a.element_type
        self.c_dtype = c.element_type
        self.a_layout = cutlass.utils.LayoutEnum.from_tensor(a)
        self.b_layout = cutlass.utils.LayoutEnum.ROW_MAJOR  # K-major, as the converted tile is written
        self.c_layout = cutlass.utils.LayoutEnum.from_tensor(c)
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

        a_bytes = self.tile_m * self.tile_k * 2
        data_bytes = self.tile_n * self.data_bytes
        scale_bytes = self.tile_n * self.scales_per_tile
        raw_bytes = data_bytes + scale_bytes
        bf_bytes = self.bf_buffers * self.tile_n * self.tile_k * 2  # the converted BF16 buffers
        epi_bytes = self.epi_tile[0] * self.epi_tile[1] * 2 * self.epi_stages + 1024 * 4 + 256
        if self.ab_stages_override is not None:
            self.ab_stages = self.ab_stages_override
        else:
            self.ab_stages = min(8, (self.smem_capacity - epi_bytes - bf_bytes) // (a_bytes + raw_bytes))
        self.a_smem_layout = sm90_utils.make_smem_layout_a(self.a_layout, self.mma_tiler, self.ab_dtype, self.ab_stages)
        self.b_smem_layout = sm90_utils.make_smem_layout_b(
            self.b_layout, self.mma_tiler, self.ab_dtype, self.bf_buffers
        )
        # A stage's data (and its scales) are one contiguous run in global memory each.
        self.data_inner = box_inner(self.tile_n, self.data_bytes)
        self.scale_inner = box_inner(self.tile_n, self.scales_per_tile)
        self.raw_smem_layout = cute.make_layout((self.data_inner, data_bytes // self.data_inner, self.ab_stages))
        self.scale_smem_layout = cute.make_layout((self.scale_inner, scale_bytes // self.scale_inner, self.ab_stages))
        self.data_stage_bytes = data_bytes
        self.scale_stage_bytes = scale_bytes
        self.epi_smem_layout = sm90_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.epi_stages
        )

    def launch(
        self,
        a: cute.Tensor,
        w_data: cute.Tensor,  # [E, K/64, N, D] uint8 (weights.pack_quantized_matrix)
        w_scale: cute.Tensor,  # [E, K/64, N, S] uint8
        c: cute.Tensor,
        m_block_expert: cute.Tensor,
        meta: cute.Tensor,
        w_gscale: cute.Tensor,  # (E,) fp32 (NVFP4 weight global scales; unused for MXFP8)
        act_gscale: cute.Tensor,  # (2,) fp32
        stream,
        use_pdl: bool = False,
    ) -> None:
        self._setup(a, c)
        a_smem_one = cute.slice_(self.a_smem_layout, (None, None, 0))
        raw_smem_one = cute.slice_(self.raw_smem_layout, (None, None, 0))
        scale_smem_one = cute.slice_(self.scale_smem_layout, (None, None, 0))
        epi_smem_one = cute.slice_(self.epi_smem_layout, (None, None, 0))
        tma_a, tma_tensor_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), a, a_smem_one, (self.tile_m, self.tile_k)
        )
        tma_b, tma_tensor_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            packed_view(w_data, self.data_inner),
            raw_smem_one,
            cute.shape(raw_smem_one),
        )
        tma_s, tma_tensor_s = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            packed_view(w_scale, self.scale_inner),
            scale_smem_one,
            cute.shape(scale_smem_one),
        )
        tma_c, tma_tensor_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), c, epi_smem_one, self.epi_tile
        )
        self.tma_bytes = cute.size_in_bytes(self.ab_dtype, a_smem_one) + self.data_stage_bytes + self.scale_stage_bytes

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_layout)], 1024]
            sRaw: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.raw_smem_layout)], 1024]
            sScale: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.scale_smem_layout)], 128]
            sC: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_a,
            tma_tensor_a,
            tma_b,
            tma_tensor_b,
            tma_s,
            tma_tensor_s,
            tma_c,
            tma_tensor_c,
            m_block_expert,
            meta,
            w_gscale,
            act_gscale,
            self.tiled_mma,
            self.tiled_mma_out,
            self.a_smem_layout,
            self.b_smem_layout,
            self.raw_smem_layout,
            self.scale_smem_layout,
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
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_s: cute.CopyAtom,
        mS: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        m_block_expert: cute.Tensor,
        meta: cute.Tensor,
        w_gscale: cute.Tensor,
        act_gscale: cute.Tensor,
        tiled_mma: cute.TiledMma,
        tiled_mma_out: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        raw_smem_layout: cute.Layout,
        scale_smem_layout: cute.Layout,
        epi_smem_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_s)
            cpasync.prefetch_descriptor(tma_c)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_conv_wg * 4)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=producer_group,
            consumer_group=consumer_group,
            tx_count=self.tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sRaw = storage.sRaw.get_tensor(raw_smem_layout)
        sScale = storage.sScale.get_tensor(scale_smem_layout)
        sC = storage.sC.get_tensor(epi_smem_layout.outer, swizzle=epi_smem_layout.inner)

        # (bM, bK, RestM, RestK) / (inner, rows, 1, RestN, RestK, E) twice / (bM, bNout, RestM, RestNout)
        gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (None, None))
        gB = cute.local_tile(mB, cute.shape(cute.slice_(raw_smem_layout, (None, None, 0))), (None, None, None, None))
        gS = cute.local_tile(mS, cute.shape(cute.slice_(scale_smem_layout, (None, None, 0))), (None, None, None, None))
        gC = cute.local_tile(mC, self.out_tiler, (None, None))

        tAsA, tAgA = cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sRaw, 0, 2), cute.group_modes(gB, 0, 2)
        )
        tSsS, tSgS = cpasync.tma_partition(
            tma_s, 0, cute.make_layout(1), cute.group_modes(sScale, 0, 2), cute.group_modes(gS, 0, 2)
        )

        k_tiles = cute.size(gA, mode=[3])
        n_tiles = cute.size(gB, mode=[3])

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        num_tiles = meta[0] * n_tiles

        if wg_idx == 0:
            # ------------------------------------------------------------ producer warpgroup
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                tile = bidx
                while tile < num_tiles:
                    m_blk = tile // n_tiles
                    n_blk = tile - m_blk * n_tiles
                    expert = m_block_expert[m_blk] & 0xFFFF
                    for k in cutlass.range(k_tiles, unroll=1):
                        ab_pipe.producer_acquire(prod_state)
                        bar = ab_pipe.producer_get_barrier(prod_state)
                        cute.copy(tma_a, tAgA[(None, m_blk, k)], tAsA[(None, prod_state.index)], tma_bar_ptr=bar)
                        cute.copy(
                            tma_b, tBgB[(None, 0, n_blk, k, expert)], tBsB[(None, prod_state.index)], tma_bar_ptr=bar
                        )
                        cute.copy(
                            tma_s, tSgS[(None, 0, n_blk, k, expert)], tSsS[(None, prod_state.index)], tma_bar_ptr=bar
                        )
                        ab_pipe.producer_commit(prod_state)
                        prod_state.advance()
                    tile += grid_x
                ab_pipe.producer_tail(prod_state)
        else:
            # ------------------------------------------------------------ consumer warpgroups
            cute.arch.setmaxregister_increase(self.consumer_regs)
            mma_tidx = tidx - self.threads_per_wg
            is_mma_wg = wg_idx - 1 < self.num_mma_wg  # tile_m=64: the second warpgroup only converts
            wg_thread_layout = cute.make_layout(self.num_mma_wg, stride=self.threads_per_wg)
            thr_mma = tiled_mma.get_slice(wg_thread_layout(wg_idx - 1))
            thr_mma_out = tiled_mma_out.get_slice(wg_thread_layout(wg_idx - 1))

            tCsA = thr_mma.partition_A(sA)
            tCsB = thr_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            acc_shape = thr_mma.partition_shape_C((self.tile_m, self.tile_n))
            acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            if cutlass.const_expr(self.epilogue == "plain"):
                acc_out = acc
            else:
                acc_out = cute.make_rmem_tensor(thr_mma_out.partition_shape_C(self.out_tiler), self.acc_dtype)

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

            raw_base = bq.smem_addr(storage.sRaw.data_ptr())
            scale_base = bq.smem_addr(storage.sScale.data_ptr())
            bf_base = bq.smem_addr(storage.sB.data_ptr())
            conv_offsets = self._conv_offsets(mma_tidx)
            consumed = cutlass.Int32(0)  # K tiles taken from the ring so far (ring states derive from it)
            epi_count = cutlass.Int32(0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            tile = bidx
            while tile < num_tiles:
                m_blk = tile // n_tiles
                n_blk = tile - m_blk * n_tiles
                packed = m_block_expert[m_blk]
                expert = packed & 0xFFFF
                active = (packed >> 16) > (wg_idx - 1) * 64

                acc.fill(0.0)
                # Both BF16 buffers are free (barrier after the previous tile's last WGMMA).
                # Convert K tile 0 into buffer 0.
                first = self._ring_state(consumed)
                ab_pipe.consumer_wait(first)
                self._dequant_stage(raw_base, scale_base, bf_base, first.index, 0, conv_offsets)
                cute.arch.fence_proxy("async.shared", space="cta")
                self._barrier()
                # The branch on `active` holds the whole K loop: with a WGMMA under a branch inside the loop,
                # ptxas closes each batch with an empty one, and wait_group(1) then waits for the batch just issued.
                if active:
                    self._k_loop(ab_pipe, consumed, k_tiles, tiled_mma, acc, tCrA, tCrB, raw_base, scale_base, bf_base,
                                 conv_offsets, True)  # fmt: skip
                else:
                    self._k_loop(ab_pipe, consumed, k_tiles, tiled_mma, acc, tCrA, tCrB, raw_base, scale_base, bf_base,
                                 conv_offsets, False)  # fmt: skip
                self._barrier()  # every WGMMA of the tile is done: the next tile may fill either buffer
                ab_pipe.consumer_release(self._ring_state(consumed + k_tiles - 1))
                consumed += k_tiles

                if is_mma_wg:
                    if cutlass.const_expr(self.fmt == constants.FMT_NVFP4):
                        alpha = act_gscale[self.gscale_index] * w_gscale[expert] * bq.NVFP4_ACC_SCALE
                    else:
                        alpha = cutlass.Float32(bq.MXFP8_ACC_SCALE)
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        acc[i] = acc[i] * alpha
                    self._epilogue_math(acc, acc_out)
                    if cutlass.const_expr(self.requant):
                        self._requant(acc_out, act_gscale)
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
                tile += grid_x
            if is_mma_wg:
                store_pipe.producer_tail()

    @cute.jit
    def _k_loop(self, ab_pipe, consumed, k_tiles, tiled_mma, acc, tCrA, tCrB, raw_base, scale_base, bf_base,
                conv_offsets, mma: cutlass.Constexpr) -> None:
        """The tile's K loop from ring position ``consumed`` (K tile 0 converted into buffer 0 already), then
        ``wait_group(0)``; ``mma``: this warpgroup multiplies (else it only converts its share and keeps the
        barriers)."""
        num_kb = cute.size(tCrA, mode=[2])
        for k in cutlass.range(k_tiles, unroll=1):
            buf = k % self.bf_buffers
            cur = self._ring_state(consumed + k)
            if cutlass.const_expr(mma):
                warpgroup.fence()
                for kb in cutlass.range_constexpr(num_kb):
                    cute.gemm(
                        tiled_mma,
                        acc,
                        tCrA[(None, None, kb, cur.index)],
                        tCrB[(None, None, kb, buf)],
                        acc,
                    )
                warpgroup.commit_group()  # (a commit with no WGMMA would be an empty batch of its own)
            if cutlass.const_expr(self.bf_buffers == 2):
                self._wait_mma(mma, 1)
                self._barrier()  # every WGMMA k-1 is done: the other buffer is free
                if k > 0:
                    ab_pipe.consumer_release(self._ring_state(consumed + k - 1))
                if k + 1 < k_tiles:
                    nxt = self._ring_state(consumed + k + 1)
                    ab_pipe.consumer_wait(nxt)
                    self._dequant_stage(raw_base, scale_base, bf_base, nxt.index, 1 - buf, conv_offsets)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    self._barrier()
            else:
                # Buffer (k+1) % 3 was read by WGMMA k-2: this warpgroup waited for it in the
                # previous K tile, the other one before the previous barrier.
                if k + 1 < k_tiles:
                    nxt = self._ring_state(consumed + k + 1)
                    ab_pipe.consumer_wait(nxt)
                    self._dequant_stage(raw_base, scale_base, bf_base, nxt.index, (k + 1) % 3, conv_offsets)
                    cute.arch.fence_proxy("async.shared", space="cta")
                self._wait_mma(mma, 1)  # WGMMA k-1 done: its ring stage is free
                if k > 0:
                    ab_pipe.consumer_release(self._ring_state(consumed + k - 1))
                self._barrier()  # tile k+1 converted by everyone (and WGMMA k-1 done everywhere)
        self._wait_mma(mma, 0)

    def _wait_mma(self, mma: bool, pending: int) -> None:
        """``wait_group(pending)`` where this warpgroup multiplies."""
        if cutlass.const_expr(mma):
            warpgroup.wait_group(pending)

    def _barrier(self) -> None:
        if not self.probe & 2:
            self.conv_barrier.arrive_and_wait()

    def _ring_state(self, n):
        return ring_state(self.ab_stages, n)

    def _conv_offsets(self, ctid):
        """Per-thread shared-memory offsets of the conversion (constant over the kernel): thread
        ``ctid`` takes data segment ``s = ctid % segs`` of rows ``ctid // segs + step * rows_per_step``.
        Steps add multiples of 8 rows, so the segment's swizzled slot and the BF16 chunks' swizzle
        (``chunk ^ row % 8``) never change; every step is a fixed offset plus a compile-time stride."""
        segs = self.segs
        if self.conv_units < self.num_conv_threads:
            ctid = ctid % self.conv_units
        row = ctid // segs
        s = ctid - row * segs
        d = self.data_bytes
        slot = s ^ ((row // (128 // d)) % segs)  # weights.segment_swizzle
        src = row * d + slot * constants.QUANT_SEGMENT_BYTES
        # MXFP8: a segment is half a 32-block (one scale byte); NVFP4: two 16-blocks (two bytes)
        scale = row * self.scales_per_tile + (s >> 1 if self.fmt == constants.FMT_MXFP8 else 2 * s)
        chunks = 2 if self.fmt == constants.FMT_MXFP8 else 4  # 16-byte BF16 chunks per segment
        dst = [row * 128 + (((chunks * s + m) ^ (row & 7)) << 4) for m in range(chunks)]
        return src, scale, dst

    def _dequant_stage(self, raw_base, scale_base, bf_base, stage, buf, offsets) -> None:
        """Packed data of ring stage ``stage`` -> BF16 buffer ``buf`` (128B-swizzled, K-major: the
        16-byte chunk c of row r sits at chunk ``c ^ (r % 8)`` of the row's 128 bytes).

        Word q of a segment holds (``weights.SEGMENT_ORDER``) MXFP8 elements 2q, 2q+1, 2q+8, 2q+9 of
        its 16, NVFP4 element pairs 2q + 8j (j = 0..3) of its 32: converted, word q's first pair goes
        to chunk 0 of the segment's output, its second to chunk 1 (and so on), lane position q."""
        if self.probe & 1:
            return
        raw_stage = raw_base + stage * self.data_stage_bytes
        scale_stage = scale_base + stage * self.scale_stage_bytes
        bf_stage = bf_base + buf * (self.tile_n * self.tile_k * 2)
        src0, scale0, dst0 = offsets
        rows_per_step = self.num_conv_threads // self.segs
        for it in range(self.conv_steps):
            self._dequant_segment(raw_stage, scale_stage, bf_stage, src0, scale0, dst0, it * rows_per_step)

    def _dequant_segment(self, raw_stage, scale_stage, bf_stage, src0, scale0, dst0, row_off: int) -> None:
        words = bq.ld_shared_v4(raw_stage + src0 + row_off * self.data_bytes)
        scale_addr = scale_stage + scale0 + row_off * self.scales_per_tile
        if cutlass.const_expr(self.fmt == constants.FMT_MXFP8):
            mult = bq.ue8m0_multiplier(bq.ld_shared_u8(scale_addr))
            pairs = [bq.e4m3x4_to_bf16x4(w, mult) for w in words]  # (chunk 0, chunk 1) of lane q
        else:
            mult_lo, mult_hi = bq.nvfp4_scale_multipliers(bq.ld_shared_u16(scale_addr), 2)
            pairs = [bq.e2m1x8_to_bf16x8(w, mult_lo, mult_hi) for w in words]  # chunks 0..3 of lane q
        for m, dst in enumerate(dst0):
            bq.st_shared_v4(bf_stage + dst + row_off * 128, *[p[m] for p in pairs])

    def _requant(self, acc_out: cute.Tensor, act_gscale: cute.Tensor) -> None:
        """Quantize-dequantize the fp32 output fragment along N in blocks of the format (in place).

        Fragment mode 0 is ((2, 2, N/8)): v0 = column pair, v1 = row +8, j = column group of 8; a row's
        columns [8j, 8j+8) are spread over the 4 lanes of a quad (2 each). A block of 32 (16) columns
        is 4 (2) groups: 8 (4) values per lane, amax over the quad.
        """
        groups = constants.QUANT_BLOCK[self.fmt] // 8
        n_groups = self.tile_n_out // 8
        n_mm = cute.size(acc_out, mode=[1])
        rq = None
        if cutlass.const_expr(self.fmt == constants.FMT_NVFP4):
            rq = bq.nvfp4_global(act_gscale[1])
        for mm in range(n_mm):
            for v1 in range(2):
                for blk in range(n_groups // groups):
                    idx = [((v0, v1, blk * groups + j), mm, 0) for j in range(groups) for v0 in range(2)]
                    vals = [acc_out[i] for i in idx]
                    amax = bq.quad_amax(bq.block_amax(vals))
                    if cutlass.const_expr(self.fmt == constants.FMT_MXFP8):
                        q = bq.mxfp8_qdq(vals, amax)
                    else:
                        q = bq.nvfp4_qdq(vals, amax, rq)
                    for i, v in zip(idx, q):
                        acc_out[i] = v
