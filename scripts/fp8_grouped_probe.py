# ruff: noqa: N803, N806, N815  (CuTe naming: sA, tCrA, mC, ...)
"""Design probe for #7's MXFP8 prefill bar: the per-128 FP8 GEMM core as a *grouped* GEMM at the layers' shapes.

Session 29 measured the core on dense squares (``scripts/mxfp8_mma_probe.py``: E4M3 codes, FP8 WGMMA, one
promotion per 128 of K with a row and a column scale, 835-869 TFLOP/s against 668-706 for the best BF16
tile) and judged 1.25x too little for the layer. The layer is not dense, though: its GEMMs run over the
routing's expert-padded M blocks, and deepseek-v3 at T = 4096 is bound by the weight stream, which FP8
codes halve. This probe answers the question where it is decided, at each contract's FC1 and FC2 under
uniform top-k routing (T = 4096 and 16384 by default):

- ``fp8b128_n128``: ``Fp8Block128GroupedGemm`` (below), the drop's ``GroupedGemmSm90`` scheduling (persistent
  CTAs over ``m_block_expert``, a padding warpgroup skips its MMAs) with FP8 operands: per 128 of K, four
  FP8 WGMMAs chained in a scratch accumulator, one wait, then ``acc += scratch * sa[row] * sb[col]``
  (``sa``: the A row's per-128 multiplier, ``sb``: the weight row's); the stage's scales ride the TMA ring;
  bf16 out through the parent's stmatrix + TMA-store epilogue; ``fp8b128c2_n128`` with the parent's
  ``cluster_m=2`` weight-tile multicast (the scales each CTA loads whole). ``fp8b128o_n128`` /
  ``fp8b128oc2_n128`` (session 38): the two consumer warpgroups take turns issuing each K tile's WGMMAs (two
  named barriers), so one promotes while the tensor cores run the other's batch; without the turns both wait on
  the same stage, issue together and promote together, the tensor cores idle meanwhile. (Two scratch
  accumulators in one warpgroup, K tile k + 1 in flight while k is promoted, is what ptxas will not do: it
  serializes every WGMMA, C7514, "non wgmma instructions reading accumulator registers of a wgmma between start
  and end of the pipeline stage".)
- ``bf16_n256`` / ``bf16_n128``: the drop's BF16 ``GroupedGemmSm90`` (plain epilogue, no cluster, the
  default ``mma_overlap``) on the same routing, with the dequantized operands in BF16; ``bf16c2_n256`` with
  ``cluster_m=2``, as the BF16 layer's prefill bucket runs its GEMMs (adjacent M blocks paired, no pair table).
- ``torch_grouped_mm``: ``torch._grouped_mm`` in BF16 on the unpadded rows (the baseline's GEMM), and
  ``torch_scaled_grouped_mm`` (FP8, one scale per row and per weight column, where torch has it on this GPU).

Not the layer: no gather, no activation, no requantization, no combine (the plain epilogue writes bf16 C).
What decides building the MXFP8 FP8-WGMMA prefill path: ``fp8b128``'s FC1 + FC2 time against the faster BF16
kernel of each GEMM (TUNING.md "Session 37": at least about 1.37x at qwen3-30b-a3b, 1.26x at qwen3-235b-a22b
and 1.23x at deepseek-v3, where the layer's other kernels, with the extra passes that path needs, take their share).

Usage::

    CUTE_DSL_ARCH=sm_90a python scripts/fp8_grouped_probe.py build --out .kcache-fp8probe   # CPU
    python scripts/fp8_grouped_probe.py run --lib .kcache-fp8probe                           # GPU

``run`` first checks every kernel against the fp32 torch product of its own operands on a small routing
with empty experts, a one-row expert and a skewed one (NaN-poisoned C, padding rows not compared), the FP8
kernels on MXFP8-quantized data re-blocked per 128 against the MXFP8 reference product (``check_mxfp8``: the
design's error as the layer's tests would see it), and every kernel on the first experts of every timed shape;
it then times interleaved rounds (CUDA events, median, three
rotating A sets; the weights, far larger than L2, are one set) and prints a table last.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TILE_M = 128
TILE_K_FP8 = 128  # 128 bytes of K per row: the 128-byte swizzle, one promotion per K tile
NUM_SMS = 132
#: name -> (mode, tile_n)
VARIANTS = {
    "fp8b128_n128": ("fp8b128", 128),
    "fp8b128c2_n128": ("fp8b128c2", 128),
    "fp8b128o_n128": ("fp8b128o", 128),
    "fp8b128oc2_n128": ("fp8b128oc2", 128),
    "bf16_n256": ("bf16", 256),
    "bf16_n128": ("bf16", 128),
    "bf16c2_n256": ("bf16c2", 256),
}
#: contract -> (hidden, intermediate, experts, top_k)
CONTRACTS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
}


# ------------------------------------------------------------------------------------ kernels (traced)
def make_kernel_classes():
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import cpasync, warpgroup

    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe.src.moe_bf16_glu.grouped_gemm import GroupedGemmSm90
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe.src.moe_bf16_glu.kernel import Sm90MegaMoEBf16Kernel

    expert_major = Sm90MegaMoEBf16Kernel._expert_major_view  # torch [E, N, K] -> cute (N, K, E)

    Float32 = cutlass.Float32

    def ld_shared_v2_f32(addr) -> tuple:
        return cute.arch.inline_ptx(
            "ld.shared.v2.f32 {{$w0}, {$w1}}, [{$r0}];",
            write_only_types=[Float32, Float32],
            read_only_args=[addr],
        )

    class Bf16Grouped:
        """The drop's BF16 grouped GEMM, plain epilogue; ``cluster_m=2`` as the layer's prefill bucket runs it
        (CTA pairs on M blocks 2g and 2g + 1 share each weight tile where both are one expert's; no pair table)."""

        def __init__(self, tile_n: int, cluster_m: int = 1) -> None:
            self.gemm = GroupedGemmSm90(TILE_M, tile_n, "plain", None, NUM_SMS, cluster_m=cluster_m)

        @cute.jit
        def __call__(self, a, sfa, b, sfb, c, m_block_expert, meta, stream):
            self.gemm.launch(a, expert_major(b), c, m_block_expert, meta, stream)

    class Fp8Block128GroupedGemm(GroupedGemmSm90):
        """C[rows of M block b] = (A * sa) @ (B[expert(b)] * sb)^T, A and B E4M3 codes with one fp32 multiplier
        per row and 128 of K; the parent's scheduling, producer roles and TMA-store epilogue."""

        TURN_BARRIER = 2  # and 3 (1: the parent's epilogue barrier)

        def __init__(self, tile_n: int, cluster_m: int = 1, ordered: bool = False) -> None:
            if tile_n not in (64, 128):
                raise ValueError("accumulator and scratch take 2 x tile_n / 2 registers a thread: tile_n <= 128")
            super().__init__(TILE_M, tile_n, "plain", None, NUM_SMS, cluster_m=cluster_m)
            # ordered: the two consumer warpgroups take turns issuing each K tile's WGMMAs (named barriers), so one
            # warpgroup promotes while the tensor cores run the other's batch, instead of both promoting at once
            self.ordered = ordered
            self.tile_k = TILE_K_FP8
            self.slices = TILE_K_FP8 // 32  # FP8 WGMMAs per K tile

        def _setup(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor) -> None:
            self.ab_dtype = cutlass.Float8E4M3FN
            self.c_dtype = c.element_type
            self.a_layout = utils.LayoutEnum.ROW_MAJOR
            self.b_layout = utils.LayoutEnum.ROW_MAJOR
            self.c_layout = utils.LayoutEnum.from_tensor(c)
            kmajor = utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
            self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.ab_dtype, self.ab_dtype, kmajor, kmajor, self.acc_dtype, (self.num_mma_wg, 1, 1),
                tiler_mn=(64, self.tile_n),
            )  # fmt: skip
            self.tiled_mma_out = self.tiled_mma
            self.mma_tiler = (self.tile_m, self.tile_n, self.tile_k)
            self.out_tiler = (self.tile_m, self.tile_n)
            self.epi_tile = (self.tile_m, 32)
            ab_bytes = (self.tile_m + self.tile_n) * (self.tile_k + 4)  # codes and the fp32 multipliers
            epi_stage_bytes = self.epi_tile[0] * self.epi_tile[1] * 2
            budget = self.smem_capacity - 4096
            self.ab_stages = min(8, (budget - 2 * epi_stage_bytes) // ab_bytes)
            self.epi_stages = max(2, min(4, (budget - self.ab_stages * ab_bytes) // epi_stage_bytes))
            self.a_smem_layout = sm90_utils.make_smem_layout_a(
                self.a_layout, self.mma_tiler, self.ab_dtype, self.ab_stages
            )
            self.b_smem_layout = sm90_utils.make_smem_layout_b(
                self.b_layout, self.mma_tiler, self.ab_dtype, self.ab_stages
            )
            self.epi_smem_layout = sm90_utils.make_smem_layout_epi(
                self.c_dtype, self.c_layout, self.epi_tile, self.epi_stages
            )
            self.sfa_layout = cute.make_layout((self.tile_m, 1, self.ab_stages))
            self.sfb_layout = cute.make_layout((self.tile_n, 1, self.ab_stages))

        @cute.jit
        def __call__(
            self,
            a: cute.Tensor,  # (M_cap, K) uint8: E4M3 codes of the permuted rows
            sfa: cute.Tensor,  # [K/128, M_cap] fp32
            b: cute.Tensor,  # [E, N, K] uint8: E4M3 codes
            sfb: cute.Tensor,  # [E, K/128, N] fp32
            c: cute.Tensor,  # (M_cap, N) bf16
            m_block_expert: cute.Tensor,
            meta: cute.Tensor,
            stream,
        ):
            a = cute.make_tensor(cute.recast_ptr(a.iterator, dtype=cutlass.Float8E4M3FN), a.layout)
            b = expert_major(cute.make_tensor(cute.recast_ptr(b.iterator, dtype=cutlass.Float8E4M3FN), b.layout))
            self._setup(a, b, c)
            sfa_v = cute.make_tensor(sfa.iterator, cute.select(sfa.layout, mode=[1, 0]))  # (M_cap, K/128)
            sfb_v = cute.make_tensor(sfb.iterator, cute.select(sfb.layout, mode=[2, 1, 0]))  # (N, K/128, E)
            g2s = cpasync.CopyBulkTensorTileG2SOp()
            b_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cluster_m > 1 else g2s
            a_one = cute.slice_(self.a_smem_layout, (None, None, 0))
            b_one = cute.slice_(self.b_smem_layout, (None, None, 0))
            sfa_one = cute.slice_(self.sfa_layout, (None, None, 0))
            sfb_one = cute.slice_(self.sfb_layout, (None, None, 0))
            epi_one = cute.slice_(self.epi_smem_layout, (None, None, 0))
            tma_a, tma_ta = cpasync.make_tiled_tma_atom(g2s, a, a_one, (self.tile_m, self.tile_k))
            tma_b, tma_tb = cpasync.make_tiled_tma_atom(
                b_op, b, b_one, (self.tile_n, self.tile_k), num_multicast=self.cluster_m
            )
            tma_sa, tma_tsa = cpasync.make_tiled_tma_atom(g2s, sfa_v, sfa_one, cute.shape(sfa_one))
            tma_sb, tma_tsb = cpasync.make_tiled_tma_atom(g2s, sfb_v, sfb_one, cute.shape(sfb_one))
            tma_c, tma_tc = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), c, epi_one, self.epi_tile)
            self.tma_bytes = (
                cute.size_in_bytes(self.ab_dtype, a_one)
                + cute.size_in_bytes(self.ab_dtype, b_one)
                + cute.size_in_bytes(Float32, sfa_one)
                + cute.size_in_bytes(Float32, sfb_one)
            )

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
                sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_layout)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_layout)], 1024]
                sC: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_layout)], 1024]
                sSA: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(self.sfa_layout)], 128]
                sSB: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(self.sfb_layout)], 128]

            self.shared_storage = SharedStorage
            self.fp8_kernel(
                tma_a, tma_ta, tma_b, tma_tb, tma_sa, tma_tsa, tma_sb, tma_tsb, tma_c, tma_tc, m_block_expert, meta,
                self.tiled_mma, self.a_smem_layout, self.b_smem_layout, self.sfa_layout, self.sfb_layout,
                self.epi_smem_layout,
            ).launch(
                grid=[self.num_sms, 1, 1], block=[self.num_threads, 1, 1], cluster=[self.cluster_m, 1, 1],
                min_blocks_per_mp=1, stream=stream,
            )  # fmt: skip

        @cute.kernel
        def fp8_kernel(
            self,
            tma_a: cute.CopyAtom,
            mA: cute.Tensor,
            tma_b: cute.CopyAtom,
            mB: cute.Tensor,
            tma_sa: cute.CopyAtom,
            mSA: cute.Tensor,
            tma_sb: cute.CopyAtom,
            mSB: cute.Tensor,
            tma_c: cute.CopyAtom,
            mC: cute.Tensor,
            m_block_expert: cute.Tensor,
            meta: cute.Tensor,
            tiled_mma: cute.TiledMma,
            a_smem_layout: cute.ComposedLayout,
            b_smem_layout: cute.ComposedLayout,
            sfa_layout: cute.Layout,
            sfb_layout: cute.Layout,
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
                cpasync.prefetch_descriptor(tma_sa)
                cpasync.prefetch_descriptor(tma_sb)
                cpasync.prefetch_descriptor(tma_c)

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            # cluster_m = 2: the parent's scheme (CTA r of cluster group g takes M block 2g + r; where both
            # blocks are one expert's, each CTA loads half of every weight tile and multicasts it to both, so a
            # stage is free once both CTAs' consumers released it); the scales each CTA loads whole
            cta_layout_mnk = cute.make_layout((self.cluster_m, 1, 1))
            cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
            b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
            b_self_mask = cutlass.Int16(1) << cta_rank
            ab_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=self.ab_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cluster_m * self.num_mma_wg * 4),
                tx_count=self.tma_bytes,
                cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
                defer_sync=True,
            )
            pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)
            sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
            sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
            sC = storage.sC.get_tensor(epi_smem_layout.outer, swizzle=epi_smem_layout.inner)
            sSA = storage.sSA.get_tensor(sfa_layout)
            sSB = storage.sSB.get_tensor(sfb_layout)

            gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (None, None))  # (bM, bK, RestM, RestK)
            gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None, None))  # (bN, bK, RestN, RestK, E)
            gC = cute.local_tile(mC, self.out_tiler, (None, None))
            gSA = cute.local_tile(mSA, (self.tile_m, 1), (None, None))  # (bM, 1, RestM, K/128)
            gSB = cute.local_tile(mSB, (self.tile_n, 1), (None, None, None))  # (bN, 1, RestN, K/128, E)

            def part(atom, s, g):
                return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                             cute.group_modes(g, 0, 2))  # fmt: skip

            tAsA, tAgA = part(tma_a, sA, gA)
            # this CTA's slice of each weight tile, and the partner's (loaded here too when the experts differ)
            tBsB, tBgB = cpasync.tma_partition(tma_b, cluster_coord[0], cute.make_layout(self.cluster_m),
                                               cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))  # fmt: skip
            tBsB_o, tBgB_o = cpasync.tma_partition(tma_b, (cluster_coord[0] + 1) % self.cluster_m,
                                                   cute.make_layout(self.cluster_m), cute.group_modes(sB, 0, 2),
                                                   cute.group_modes(gB, 0, 2))  # fmt: skip
            tSAs, tSAg = part(tma_sa, sSA, gSA)
            tSBs, tSBg = part(tma_sb, sSB, gSB)
            k_tiles = cute.size(gB, mode=[3])
            n_tiles = cute.size(gB, mode=[2])

            pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()
            # tiles (cluster group of M blocks, n); an odd block count ends with the routing's phantom block
            num_tiles = (meta[0] + self.cluster_m - 1) // self.cluster_m * n_tiles
            first_tile = bidx // self.cluster_m
            tile_stride = grid_x // self.cluster_m

            if wg_idx == 0:
                # ------------------------------------------------------------ producer: TMA ring
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                    tile = first_tile
                    while tile < num_tiles:
                        grp = tile // n_tiles
                        n_blk = tile - grp * n_tiles
                        m_blk = grp * self.cluster_m + cluster_coord[0]
                        expert = m_block_expert[m_blk] & 0xFFFF
                        share_b = cutlass.Boolean(False)
                        if cutlass.const_expr(self.cluster_m > 1):  # both CTAs derive it from the same entries
                            partner = grp * self.cluster_m + (cluster_coord[0] + 1) % self.cluster_m
                            share_b = (m_block_expert[partner] & 0xFFFF) == expert
                        for k in cutlass.range(k_tiles, unroll=1):
                            ab_pipe.producer_acquire(prod)
                            bar = ab_pipe.producer_get_barrier(prod)
                            s = prod.index
                            cute.copy(tma_a, tAgA[(None, m_blk, k)], tAsA[(None, s)], tma_bar_ptr=bar)
                            self._load_b(ab_pipe, prod, tma_b, tBgB, tBsB, tBgB_o, tBsB_o, n_blk, k, expert, share_b,
                                         b_mcast_mask, b_self_mask)  # fmt: skip
                            cute.copy(tma_sa, tSAg[(None, m_blk, k)], tSAs[(None, s)], tma_bar_ptr=bar)
                            cute.copy(tma_sb, tSBg[(None, n_blk, k, expert)], tSBs[(None, s)], tma_bar_ptr=bar)
                            ab_pipe.producer_commit(prod)
                            prod.advance()
                        tile += tile_stride
                    ab_pipe.producer_tail(prod)
            else:
                # ------------------------------------------------------------ consumers: MMA + promotion
                cute.arch.setmaxregister_increase(self.consumer_regs)
                mma_tidx = tidx - self.threads_per_wg
                wg = wg_idx - 1
                thr_mma = tiled_mma.get_slice(cute.make_layout(self.num_mma_wg, stride=self.threads_per_wg)(wg))
                tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
                tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
                acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.tile_n)), self.acc_dtype)
                scratch = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
                # Accumulator mode 0 is ((2, 2, N/8)): v0 = column of a pair, v1 = row half (+8), j = column group.
                ctid = mma_tidx - wg * self.threads_per_wg
                warp = ctid // 32
                lane = ctid - warp * 32
                row0 = wg * 64 + warp * 16 + lane // 4  # and row0 + 8
                sfb_base = storage.sSB.data_ptr().toint() + 2 * (lane % 4) * 4  # column 2 (lane % 4), + 8 j

                # epilogue: registers -> smem (stmatrix) -> gmem (TMA store), as the parent's
                r2s_atom = sm90_utils.get_smem_store_op(self.c_layout, self.c_dtype, self.acc_dtype)
                stm_atom = cute.make_copy_atom(
                    cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.c_dtype
                )
                tiled_r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma))
                thr_r2s = tiled_r2s.get_slice(mma_tidx)
                tRS_sC = thr_r2s.partition_D(sC)
                tRS_acc = tiled_r2s.retile(acc)
                rD_shape = cute.shape(thr_r2s.partition_S(sC))
                tRS_rD = cute.make_rmem_tensor(rD_shape[:3], self.acc_dtype)
                tRS_rD_out = cute.make_rmem_tensor(rD_shape[:3], self.c_dtype)
                store_pipe = pipeline.PipelineTmaStore.create(
                    num_stages=self.epi_stages,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
                )

                read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
                epi_count = cutlass.Int32(0)
                # ordered: warpgroup w waits on barrier TURN + w before it issues a K tile and then hands the turn
                # to the other on TURN + 1 - w; warpgroup 1 opens with a hand-over (warpgroup 0 issues first) and
                # warpgroup 0 closes with a wait for the last one, so every barrier's arrivals are matched
                turn_wait = self.TURN_BARRIER + wg
                turn_give = self.TURN_BARRIER + 1 - wg
                turn_threads = 2 * self.threads_per_wg
                if cutlass.const_expr(self.ordered):
                    if wg == 1:
                        cute.arch.barrier_arrive(barrier_id=turn_give, number_of_threads=turn_threads)
                tile = first_tile
                while tile < num_tiles:
                    grp = tile // n_tiles
                    n_blk = tile - grp * n_tiles
                    m_blk = grp * self.cluster_m + cluster_coord[0]
                    valid_rows = m_block_expert[m_blk] >> 16
                    acc.fill(0.0)
                    if valid_rows > wg * 64:
                        for _k in cutlass.range(k_tiles, unroll=1):
                            ab_pipe.consumer_wait(read)
                            # the stage's multipliers, read before the WGMMAs are waited for
                            fa = [sSA[(row0, 0, read.index)], sSA[(row0 + 8, 0, read.index)]]
                            stage = sfb_base + read.index * (self.tile_n * 4)
                            fb = [ld_shared_v2_f32(stage + j * 32) for j in range(self.tile_n // 8)]
                            if cutlass.const_expr(self.ordered):
                                cute.arch.barrier(barrier_id=turn_wait, number_of_threads=turn_threads)
                            warpgroup.fence()
                            for s in cutlass.range_constexpr(self.slices):
                                tiled_mma.set(warpgroup.Field.ACCUMULATE, s > 0)
                                cute.gemm(tiled_mma, scratch, tCrA[(None, None, s, read.index)],
                                          tCrB[(None, None, s, read.index)], scratch)  # fmt: skip
                            warpgroup.commit_group()
                            if cutlass.const_expr(self.ordered):
                                cute.arch.barrier_arrive(barrier_id=turn_give, number_of_threads=turn_threads)
                            warpgroup.wait_group(0)
                            ab_pipe.consumer_release(read)
                            read.advance()
                            for j in cutlass.range_constexpr(self.tile_n // 8):
                                for v1 in cutlass.range_constexpr(2):
                                    for v0 in cutlass.range_constexpr(2):
                                        i = ((v0, v1, j), 0, 0)
                                        acc[i] = scratch[i] * (fa[v1] * fb[j][v0]) + acc[i]
                    else:
                        # 64 rows of expert padding: take and free every stage, no MMA
                        for _k in cutlass.range(k_tiles, unroll=1):
                            ab_pipe.consumer_wait(read)
                            if cutlass.const_expr(self.ordered):  # keep the turns
                                cute.arch.barrier(barrier_id=turn_wait, number_of_threads=turn_threads)
                                cute.arch.barrier_arrive(barrier_id=turn_give, number_of_threads=turn_threads)
                            ab_pipe.consumer_release(read)
                            read.advance()
                    epi_count = self._tma_epilogue(
                        tma_c, gC, sC, m_blk, n_blk, warp_idx, tiled_r2s, tRS_sC, tRS_acc, tRS_rD, tRS_rD_out,
                        store_pipe, epi_count,
                    )  # fmt: skip
                    tile += tile_stride
                if cutlass.const_expr(self.ordered):
                    if wg == 0:
                        cute.arch.barrier(barrier_id=turn_wait, number_of_threads=turn_threads)
                store_pipe.producer_tail()

    return Fp8Block128GroupedGemm, Bf16Grouped


# ------------------------------------------------------------------------------------ build (CPU)
def build(out: Path, only: list[str] | None) -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe.src.moe_bf16_glu.export import link_library

    fp8_cls, bf16_cls = make_kernel_classes()
    out.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, (mode, tile_n) in VARIANTS.items():
        if only and name not in only:
            continue
        t0 = time.time()
        m, n, k, e, kt, nb = (cute.sym_int(divisibility=d) for d in (128, 256, 128, 1, 1, 1))
        ab = cutlass.Uint8 if mode.startswith("fp8") else cutlass.BFloat16

        def mat(dtype, shape):
            return make_fake_compact_tensor(dtype, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),
                                            assumed_align=16)  # fmt: skip

        args = [
            mat(ab, (m, k)),
            mat(cutlass.Float32, (kt, m)),
            mat(ab, (e, n, k)),
            mat(cutlass.Float32, (e, kt, n)),
            mat(cutlass.BFloat16, (m, n)),
            mat(cutlass.Int32, (nb,)),
            mat(cutlass.Int32, (cute.sym_int(),)),
            make_fake_stream(use_tvm_ffi_env_stream=True),
        ]
        cluster_m = 2 if mode.endswith("c2") else 1
        if mode.startswith("fp8"):
            kernel = fp8_cls(tile_n, cluster_m, ordered=mode.startswith("fp8b128o"))
        else:
            kernel = bf16_cls(tile_n, cluster_m)
        compiled = cute.compile(kernel, *args, options="--enable-tvm-ffi")
        lib = link_library(compiled, out, f"probe_{name}")
        manifest[name] = dict(mode=mode, tile_n=tile_n, lib=lib.name)
        print(f"built {name:14s} {time.time() - t0:5.1f}s {lib.stat().st_size // 1024} KiB", flush=True)
    path = out / "manifest.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**old, **manifest}, indent=1))


# ------------------------------------------------------------------------------------ run (GPU)
def block_map(counts):
    """Expert-major M blocks of 128 rows: (m_block_expert [blocks], meta [1], the first row of each expert,
    M_cap), as the routing kernel lays them out (entry = expert | real rows << 16). An odd count gets the
    routing's phantom block (no real rows, not counted in meta) that a cluster pair's second CTA takes."""
    import torch

    entries, first = [], []
    row = 0
    for e, c in enumerate(counts.tolist()):
        first.append(row)
        for i in range((c + TILE_M - 1) // TILE_M):
            entries.append(e | (min(TILE_M, c - TILE_M * i) << 16))
            row += TILE_M
    meta = torch.tensor([len(entries)], dtype=torch.int32, device="cuda")
    if len(entries) % 2:
        entries.append(entries[-1] & 0xFFFF)
        row += TILE_M
    mbe = torch.tensor(entries or [0], dtype=torch.int32, device="cuda")
    return mbe, meta, first, max(row, TILE_M)


def fp8_codes(shape, gen):
    import torch

    return (torch.randn(*shape, device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)


def pow2_scales(shape, gen):
    import torch

    return torch.exp2(torch.randint(-7, 8, shape, device="cuda", generator=gen).float())


def make_problem(counts, n: int, k: int, gen, a_sets: int = 1):
    """Operands of one grouped GEMM over ``counts`` rows per expert: E4M3 codes with per-128 multipliers, their
    dequantized BF16 copies (exact: a power of two times an E4M3 value), and the unpadded BF16 rows."""
    import torch

    e = counts.numel()
    mbe, meta, first, m_cap = block_map(counts)
    b_q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device="cuda")
    sfb = pow2_scales((e, k // 128, n), gen)
    b_bf = torch.empty(e, n, k, dtype=torch.bfloat16, device="cuda")
    for i in range(e):  # per expert: no fp32 copy of the whole weight tensor (deepseek-v3's FC1 is 7.5 G codes)
        b_q[i] = fp8_codes((n, k), gen)
        b_bf[i] = (b_q[i].float() * sfb[i].t().repeat_interleave(128, dim=1)).bfloat16()
    real = torch.cat([torch.arange(f, f + c, device="cuda") for f, c in zip(first, counts.tolist(), strict=True)])
    sets = []
    for _ in range(a_sets):
        a_q = fp8_codes((m_cap, k), gen)
        sfa = pow2_scales((k // 128, m_cap), gen)
        a_bf = (a_q.float() * sfa.t().repeat_interleave(128, dim=1)).bfloat16()
        sets.append(dict(a_q=a_q.view(torch.uint8), sfa=sfa, a_bf=a_bf, a_rows=a_bf[real].contiguous()))
    return dict(sets=sets, b_q=b_q.view(torch.uint8), sfb=sfb, b_bf=b_bf, mbe=mbe, meta=meta, first=first,
                counts=counts, m_cap=m_cap, real=real,
                offs=torch.cumsum(counts.to(device="cuda"), 0, dtype=torch.int32))  # fmt: skip


def check(fns, p, n: int, experts: list[int], label: str) -> int:
    """Each kernel's C on the rows of ``experts`` against the fp32 product of the dequantized operands."""
    import torch

    failures = 0
    s = p["sets"][0]
    for name, (v, fn) in fns.items():
        if n % v["tile_n"]:
            continue
        c = torch.full((p["m_cap"], n), float("nan"), dtype=torch.bfloat16, device="cuda")
        call(v, fn, p, s, c)
        torch.cuda.synchronize()
        num = den = 0.0
        worst = 0.0
        finite = True
        for e in experts:
            f, cnt = p["first"][e], int(p["counts"][e])
            if cnt == 0:
                continue
            ref = s["a_bf"][f : f + cnt].float() @ p["b_bf"][e].float().t()
            got = c[f : f + cnt].float()
            finite &= bool(torch.isfinite(got).all())
            num += (got - ref).abs().sum().item()
            den += ref.abs().sum().item()
            big = ref.abs() > 1e-2 * ref.abs().max()
            if big.any():
                worst = max(worst, ((got - ref).abs()[big] / ref.abs()[big]).max().item())
        mean = num / max(den, 1e-30)
        ok = finite and mean < 1e-2 and worst < 5e-2
        failures += not ok
        print(f"check {name:14s} {label}: mean rel {mean:.2e} max rel {worst:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return failures


def call(v, fn, p, s, c) -> None:
    if not v["mode"].startswith("fp8"):
        fn(s["a_bf"], s["sfa"], p["b_bf"], p["sfb"], c, p["mbe"], p["meta"])
    else:
        fn(s["a_q"], s["sfa"], p["b_q"], p["sfb"], c, p["mbe"], p["meta"])


def time_shape(fns, p, n: int, rounds: int, reps: int) -> dict[str, float]:
    """Median ms of every kernel and torch peer on problem ``p``: ``rounds`` interleaved rounds of ``reps``
    calls each (CUDA events around each call), the A sets rotating."""
    import torch

    e = p["counts"].numel()
    sets = p["sets"]
    c = torch.empty((p["m_cap"], n), dtype=torch.bfloat16, device="cuda")
    w_t = p["b_bf"].transpose(1, 2)
    b_t = p["b_q"].view(torch.float8_e4m3fn).transpose(1, 2)
    ones_b = torch.ones(e, n, device="cuda")
    f8_rows = [s["a_rows"].float().clamp(-448, 448).to(torch.float8_e4m3fn) for s in sets]
    ones_a = [torch.ones(r.shape[0], device="cuda") for r in f8_rows]

    def run_one(name: str, i: int) -> None:
        j = i % len(sets)
        if name == "torch_grouped_mm":
            torch._grouped_mm(sets[j]["a_rows"], w_t, offs=p["offs"])
        elif name == "torch_scaled_grouped_mm":
            torch._scaled_grouped_mm(f8_rows[j], b_t, ones_a[j], ones_b, offs=p["offs"], out_dtype=torch.bfloat16)
        else:
            v, fn = fns[name]
            call(v, fn, p, sets[j], c)

    names = [name for name, (v, _) in fns.items() if n % v["tile_n"] == 0]
    names += ["torch_grouped_mm", "torch_scaled_grouped_mm"]
    times: dict[str, list[float]] = {}
    for name in names:  # warm-up, and drop a torch peer this build cannot run
        try:
            run_one(name, 0)
            torch.cuda.synchronize()
            times[name] = []
        except (RuntimeError, TypeError, NotImplementedError, AttributeError) as err:
            print(f"skip {name}: {type(err).__name__}: {str(err)[:160]}", flush=True)
    for r in range(rounds):
        for name in times:
            for i in range(reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                run_one(name, r * reps + i)
                e1.record()
                e1.synchronize()
                times[name].append(e0.elapsed_time(e1))
    return {name: statistics.median(ts) for name, ts in times.items()}


def check_mxfp8(fns, gen, t: int = 512) -> int:
    """The design's numerics on MXFP8 data: qwen3-30b-a3b's FC1 shape (E 128, N 1536, K 2048) with ``t`` tokens
    routed top 8, activations and weights quantized to MXFP8 as the layer's reference does
    (``core.quant.quantize_mxfp8``), re-blocked per 128 of K (``mxfp8_reblock_study.reblock_shift``: codes of a
    32-block below its 128-block's largest exponent shifted and rounded again), through each FP8 kernel. Against
    the MXFP8 reference product (what the layer's reference computes) with the kernel tests' bars (mean < 1 %,
    max < 5 % over |ref| > 1 % of its largest), and against the re-blocked operands' own fp32 product (the FP8
    tensor core's accumulation alone)."""
    import torch

    sys.path.insert(0, str(REPO / "scripts"))
    from mxfp8_reblock_study import dequant, reblock_shift

    from flashinfer.moe_ep.core.quant import dequantize_mxfp8, quantize_mxfp8

    e, n, k, top_k = 128, 1536, 2048, 8
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(top_k, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=e).cpu()
    mbe, meta, first, m_cap = block_map(counts)
    x = torch.randn(m_cap, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(e, n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    qx, sx = quantize_mxfp8(x)
    qw, sw = quantize_mxfp8(w)
    cx, ex = reblock_shift(qx, sx)
    cw, ew = reblock_shift(qw, sw)
    p = dict(counts=counts, mbe=mbe, meta=meta, m_cap=m_cap,
             b_q=cw.to(torch.float8_e4m3fn).view(torch.uint8),
             sfb=torch.exp2(ew.float() - 127).transpose(1, 2).contiguous())  # fmt: skip
    s = dict(a_q=cx.to(torch.float8_e4m3fn).view(torch.uint8), sfa=torch.exp2(ex.float() - 127).t().contiguous())
    failures = 0
    for name, (v, fn) in fns.items():
        if not v["mode"].startswith("fp8"):
            continue
        c = torch.full((m_cap, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        call(v, fn, p, s, c)
        torch.cuda.synchronize()
        errs = {}
        for label, a_op, b_op in (("MXFP8 reference", (qx, sx), (qw, sw)), ("re-blocked operands", (cx, ex), (cw, ew))):
            num = den = worst = 0.0
            for ei in (0, 1, e // 2, e - 1):
                f, cnt = first[ei], int(counts[ei])
                if cnt == 0:
                    continue
                if label == "MXFP8 reference":
                    a = dequantize_mxfp8(a_op[0][f : f + cnt], a_op[1][f : f + cnt])
                    b = dequantize_mxfp8(b_op[0][ei], b_op[1][ei])
                else:
                    a = dequant(a_op[0][f : f + cnt], a_op[1][f : f + cnt], 128)
                    b = dequant(b_op[0][ei], b_op[1][ei], 128)
                ref = a.float() @ b.float().t()
                got = c[f : f + cnt].float()
                num += (got - ref).abs().sum().item()
                den += ref.abs().sum().item()
                big = ref.abs() > 1e-2 * ref.abs().max()
                worst = max(worst, ((got - ref).abs()[big] / ref.abs()[big]).max().item())
            errs[label] = (num / max(den, 1e-30), worst)
        mean, worst = errs["MXFP8 reference"]
        ok = mean < 1e-2 and worst < 5e-2  # a NaN mean fails
        failures += not ok
        detail = "; ".join(f"vs {k_}: mean rel {m:.2e} max rel {w_:.2e}" for k_, (m, w_) in errs.items())
        print(f"mxfp8 {name:14s} T={t} {n}x{k}: {detail} {'ok' if ok else 'FAIL'}", flush=True)
    return failures


def run(lib_dir: Path, contracts: list[str], tokens: list[int], rounds: int, reps: int) -> int:
    import torch
    import tvm_ffi

    torch.backends.cuda.matmul.allow_tf32 = False
    manifest = json.loads((lib_dir / "manifest.json").read_text())
    fns = {}
    keep = []
    for name, v in manifest.items():
        mod = tvm_ffi.load_module(str((lib_dir / v["lib"]).resolve()))
        keep.append(mod)
        fns[name] = (v, getattr(mod, f"probe_{name}"))
    print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__, flush=True)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(37)
    failures = 0

    # ---- correctness on odd routing: 8 experts, empty ones, a one-row expert, a skewed one, K with 3 K tiles
    counts = torch.tensor([0, 1, 7, 300, 0, 129, 128, 1000])
    p = make_problem(counts, 256, 384, gen)
    failures += check(fns, p, 256, list(range(8)), "odd routing 256x384")
    del p
    failures += check_mxfp8(fns, gen)

    rows = []
    for contract in contracts:
        h, inter, e, top_k = CONTRACTS[contract]
        for t in tokens:
            ids = torch.rand(t, e, device="cuda", generator=gen).topk(top_k, dim=1).indices
            counts = torch.bincount(ids.flatten(), minlength=e).cpu()
            for stage, n, k in (("FC1", 2 * inter, h), ("FC2", h, inter)):
                p = make_problem(counts, n, k, gen, a_sets=3)
                label = f"{contract} T={t} {stage} {n}x{k}"
                failures += check(fns, p, n, [0, 1, e - 1], label)
                flop = 2.0 * int(counts.sum()) * n * k
                med = time_shape(fns, p, n, rounds, reps)
                base = min((ms for name, ms in med.items() if name.startswith("bf16")), default=float("nan"))
                for name, ms in med.items():
                    rows.append((contract, t, stage, name, ms, flop / ms / 1e9, base / ms))
                # as it goes, so that a run cut short still says what it measured
                print(f"{label}: " + ", ".join(f"{name} {ms:.3f}" for name, ms in med.items()), flush=True)
                del p
                torch.cuda.empty_cache()

    print("\n| contract | T | GEMM | variant | ms | TFLOP/s | x best BF16 kernel |")
    print("|---|---|---|---|---|---|---|")
    for contract, t, stage, name, ms, tf, ratio in rows:
        print(f"| {contract} | {t} | {stage} | {name} | {ms:.3f} | {tf:.0f} | {ratio:.2f} |")
    # FC1 + FC2 per (contract, T): the sum that decides, against the faster BF16 kernel of each GEMM
    print("\n| contract | T | variant | FC1 + FC2 ms | x best BF16 kernels |")
    print("|---|---|---|---|---|")
    sums: dict = {}
    for contract, t, _stage, name, ms, _tf, ratio in rows:
        sums.setdefault((contract, t), {}).setdefault(name, []).append((ms, ms * ratio))
    for (contract, t), by in sums.items():
        for name, parts in by.items():
            if len(parts) == 2:
                ms, base = sum(x for x, _ in parts), sum(b for _, b in parts)
                print(f"| {contract} | {t} | {name} | {ms:.3f} | {base / ms:.2f} |")
    print(f"\nfailures: {failures}")
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, default=REPO / ".kcache-fp8probe")
    b.add_argument("--only", nargs="*")
    r = sub.add_parser("run")
    r.add_argument("--lib", type=Path, default=REPO / ".kcache-fp8probe")
    r.add_argument("--contracts", nargs="*", default=list(CONTRACTS))
    r.add_argument("--tokens", nargs="*", type=int, default=[4096, 16384])
    r.add_argument("--rounds", type=int, default=5)
    r.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    if a.cmd == "build":
        build(a.out, a.only)
        return 0
    return run(a.lib, a.contracts, a.tokens, a.rounds, a.reps)


if __name__ == "__main__":
    raise SystemExit(main())
