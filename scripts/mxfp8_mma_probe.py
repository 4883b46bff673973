# ruff: noqa: N803, N806, N815  (CuTe naming: sA, tCrA, mC, ...)
"""Design probe for the MXFP8 kernel (#7): FP8 WGMMA with per-32 promotion against BF16 WGMMA.

Hopper has no block-scaled MMA. An exact MXFP8 GEMM can either dequantize to BF16 (a UE8M0 scale
times an E4M3 value is exact in BF16) and run BF16 WGMMA -- the design the drop uses -- or run FP8
WGMMA one 32-wide K slice at a time into a scratch accumulator and fold each slice into the fp32
accumulator with its two scales (``acc += P * 2**(ea[row] + eb[col])``: one multiply and one FMA per
accumulator element per 32 of K). This script measures the second design's GEMM core against the
first's in one run, on the same tile shape and pipeline, so the decision rests on a measurement:

- ``bf16``:  BF16 operands (the dequantized MXFP8 values), BF16 WGMMA: the drop's MMA rate.
- ``fp8``:   E4M3 codes, FP8 WGMMA, no scales: what per-tensor FP8 gets (not MXFP8; the upper bound).
- ``mx``:    E4M3 codes, FP8 WGMMA per 32 of K into a scratch accumulator, promoted with the scales.
- ``mx2``:   as ``mx`` with two scratch accumulators, so slice s+1's WGMMA runs while slice s is
             promoted (the last slice of each K tile is promoted after a full wait).
- ``b128``:  MXFP8 re-blocked to one scale per 128 of K (session 28): the four 32-wide slices of a K
             tile chained in one scratch accumulator, promoted once per K tile (a quarter of ``mx``'s
             promotion work; DeepGEMM's per-128 scheme). The codes of a 32-block whose exponent is
             below its 128-block's maximum are shifted down (exact unless they fall below E4M3's
             subnormals: ``scripts/mxfp8_reblock_study.py`` measures what that changes, on the CPU).
             Here the operands are generated per 128 (slice 0's scales serve the whole K tile).
             (A 192-wide tile spills: accumulator and scratch need 96 + 96 registers a thread.)

Dense GEMM C[M, N] = A[M, K] @ B[N, K]^T (both K-major), fp32 C, one CTA per 128 x tile_n output tile:
one producer warp (TMA into a multi-stage mbarrier ring), two consumer warpgroups of 64 rows each.
Scales ride the operand ring (TMA, same stage barrier): A's (activations) one UE8M0 byte per (row,
32 of K), packed four per int32 and stored [K/128, M]; B's (weights, prepared offline) as fp32
``2**(e - 127)`` stored [K/32, N], so a thread reads its two adjacent columns' multipliers with one
64-bit shared load per slice, issued before it waits for the slice's WGMMA. Combined exponents stay
normal for the probe's scale range (120..134); a product kernel would need the general case. (A first
version read the scales from global memory inside the promotion: 0.30-0.43x of ``bf16_n128``.)

Usage::

    CUTE_DSL_ARCH=sm_90a python scripts/mxfp8_mma_probe.py build --out .kcache-probe   # CPU
    python scripts/mxfp8_mma_probe.py run --lib .kcache-probe [--shapes 8192x8192x8192]  # H200

``run`` checks every variant against the fp32 torch reference of its operands (NaN-poisoned output,
fresh random inputs), then times them (CUDA events, median over rotating inputs) and prints a table
with the ratio to ``bf16`` at the same tile last.
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
#: name -> (mode, tile_n)
VARIANTS = {
    "bf16_n128": ("bf16", 128),
    "bf16_n64": ("bf16", 64),
    "bf16_n256": ("bf16", 256),
    "fp8_n128": ("fp8", 128),
    "fp8_n256": ("fp8", 256),
    "mx_n128": ("mx", 128),
    "mx_n64": ("mx", 64),
    "mx2_n128": ("mx2", 128),
    "mx2_n64": ("mx2", 64),
    "b128_n128": ("b128", 128),
    "b128_n64": ("b128", 64),
}


# ------------------------------------------------------------------------------------ kernel (traced)
def make_probe_class():
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import cpasync, warpgroup

    Float32, Int32, Uint32 = cutlass.Float32, cutlass.Int32, cutlass.Uint32

    def ld_shared_v2_f32(addr) -> tuple:
        return cute.arch.inline_ptx(
            "ld.shared.v2.f32 {{$w0}, {$w1}}, [{$r0}];",
            write_only_types=[Float32, Float32],
            read_only_args=[addr],
        )

    def ue8m0_byte_to_f32(word, byte: int):
        """Byte ``byte`` of a packed int32 of UE8M0 scales -> ``2**(e - 127)`` (e >= 1)."""
        e = (Uint32(word) >> Uint32(8 * byte)) & Uint32(0xFF)
        return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[e << 23])

    class ScaledGemmProbe:
        def __init__(self, mode: str, tile_n: int) -> None:
            assert mode in ("bf16", "fp8", "mx", "mx2", "b128")
            self.mode = mode
            self.scaled = mode in ("mx", "mx2", "b128")
            self.tile_m, self.tile_n = TILE_M, tile_n
            self.ab_dtype = cutlass.BFloat16 if mode == "bf16" else cutlass.Float8E4M3FN
            self.tile_k = 64 if mode == "bf16" else 128  # 128 bytes of K per row either way
            self.slices = self.tile_k // (16 if mode == "bf16" else 32)  # WGMMAs per K tile
            self.num_mma_wg = 2
            self.threads = 128 * (1 + self.num_mma_wg)
            self.smem_capacity = utils.get_smem_capacity_in_bytes("sm_90")

        @cute.jit
        def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, c: cute.Tensor, stream):
            if cutlass.const_expr(self.mode != "bf16"):  # the codes arrive as uint8
                a = cute.make_tensor(cute.recast_ptr(a.iterator, dtype=self.ab_dtype), a.layout)
                b = cute.make_tensor(cute.recast_ptr(b.iterator, dtype=self.ab_dtype), b.layout)
            kmajor = utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.ab_dtype,
                self.ab_dtype,
                kmajor,
                kmajor,
                Float32,
                (self.num_mma_wg, 1, 1),
                tiler_mn=(64, self.tile_n),
            )
            mma_tiler = (self.tile_m, self.tile_n, self.tile_k)
            stage_bytes = (self.tile_m + self.tile_n) * 128
            self.stages = min(8, (self.smem_capacity - 4096) // stage_bytes)
            a_layout = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, mma_tiler, self.ab_dtype, self.stages)
            b_layout = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, mma_tiler, self.ab_dtype, self.stages)
            a_one = cute.slice_(a_layout, (None, None, 0))
            b_one = cute.slice_(b_layout, (None, None, 0))
            g2s = cpasync.CopyBulkTensorTileG2SOp()
            tma_a, tma_ta = cpasync.make_tiled_tma_atom(g2s, a, a_one, (self.tile_m, self.tile_k))
            tma_b, tma_tb = cpasync.make_tiled_tma_atom(g2s, b, b_one, (self.tile_n, self.tile_k))
            self.tma_bytes = cute.size_in_bytes(self.ab_dtype, a_one) + cute.size_in_bytes(self.ab_dtype, b_one)
            # Scales ride the same ring: per stage the A words (tile_m int32) and the B multipliers
            # (slices x tile_n fp32). Views with the row/column index innermost (both stored [K/.., M|N]).
            sfa_v = cute.make_tensor(sfa.iterator, cute.select(sfa.layout, mode=[1, 0]))  # (M, K/128)
            sfb_v = cute.make_tensor(sfb.iterator, cute.select(sfb.layout, mode=[1, 0]))  # (N, K/32)
            self.sfa_layout = cute.make_layout((self.tile_m, 1, self.stages))
            self.sfb_layout = cute.make_layout((self.tile_n, self.slices, self.stages))
            sfa_one = cute.slice_(self.sfa_layout, (None, None, 0))
            sfb_one = cute.slice_(self.sfb_layout, (None, None, 0))
            tma_sa, tma_tsa = cpasync.make_tiled_tma_atom(g2s, sfa_v, sfa_one, cute.shape(sfa_one))
            tma_sb, tma_tsb = cpasync.make_tiled_tma_atom(g2s, sfb_v, sfb_one, cute.shape(sfb_one))
            if cutlass.const_expr(self.scaled):
                self.tma_bytes += cute.size_in_bytes(Int32, sfa_one) + cute.size_in_bytes(Float32, sfb_one)

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_layout)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_layout)], 1024]
                sSFA: cute.struct.Align[cute.struct.MemRange[Int32, cute.cosize(self.sfa_layout)], 128]
                sSFB: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(self.sfb_layout)], 128]

            self.shared_storage = SharedStorage
            grid_m = cute.size(c, mode=[0]) // self.tile_m
            grid_n = cute.size(c, mode=[1]) // self.tile_n
            self.kernel(
                tma_a,
                tma_ta,
                tma_b,
                tma_tb,
                tma_sa,
                tma_tsa,
                tma_sb,
                tma_tsb,
                c,
                tiled_mma,
                a_layout,
                b_layout,
                self.sfa_layout,
                self.sfb_layout,
            ).launch(grid=[grid_m, grid_n, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1, stream=stream)

        @cute.kernel
        def kernel(
            self,
            tma_a,
            mA,
            tma_b,
            mB,
            tma_sa,
            mSFA,
            tma_sb,
            mSFB,
            mC,
            tiled_mma,
            a_layout,
            b_layout,
            sfa_layout,
            sfb_layout,
        ):
            tidx, _, _ = cute.arch.thread_idx()
            bx, by, _ = cute.arch.block_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg_idx = cute.arch.make_warp_uniform(tidx // 128)
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_a)
                cpasync.prefetch_descriptor(tma_b)
            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            ab_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_wg * 4),
                tx_count=self.tma_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True,
            )
            pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
            sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
            sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
            gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (None, None))
            gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None))
            tAsA, tAgA = cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
            )
            k_tiles = cute.size(gA, mode=[3])
            sSFA = storage.sSFA.get_tensor(sfa_layout)
            sSFB = storage.sSFB.get_tensor(sfb_layout)
            gSA = cute.local_tile(mSFA, (self.tile_m, 1), (None, None))
            gSB = cute.local_tile(mSFB, (self.tile_n, self.slices), (None, None))
            tSAs, tSAg = cpasync.tma_partition(
                tma_sa, 0, cute.make_layout(1), cute.group_modes(sSFA, 0, 2), cute.group_modes(gSA, 0, 2)
            )
            tSBs, tSBg = cpasync.tma_partition(
                tma_sb, 0, cute.make_layout(1), cute.group_modes(sSFB, 0, 2), cute.group_modes(gSB, 0, 2)
            )
            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

            if wg_idx == 0:
                # -------------------------------------------------------- producer: TMA ring
                cute.arch.setmaxregister_decrease(40)
                if warp_idx == 0:
                    prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                    for k in cutlass.range(k_tiles, unroll=1):
                        ab_pipe.producer_acquire(prod)
                        bar = ab_pipe.producer_get_barrier(prod)
                        cute.copy(tma_a, tAgA[(None, bx, k)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
                        cute.copy(tma_b, tBgB[(None, by, k)], tBsB[(None, prod.index)], tma_bar_ptr=bar)
                        if cutlass.const_expr(self.scaled):
                            cute.copy(tma_sa, tSAg[(None, bx, k)], tSAs[(None, prod.index)], tma_bar_ptr=bar)
                            cute.copy(tma_sb, tSBg[(None, by, k)], tSBs[(None, prod.index)], tma_bar_ptr=bar)
                        ab_pipe.producer_commit(prod)
                        prod.advance()
                    ab_pipe.producer_tail(prod)
            else:
                # -------------------------------------------------------- consumers: MMA + promotion
                cute.arch.setmaxregister_increase(232)
                mma_tidx = tidx - 128
                wg_threads = cute.make_layout(self.num_mma_wg, stride=128)
                thr_mma = tiled_mma.get_slice(wg_threads(wg_idx - 1))
                tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
                tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
                acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.tile_n)), Float32)
                acc.fill(0.0)
                read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                if cutlass.const_expr(not self.scaled):
                    release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.fence()
                    ab_pipe.consumer_wait(read)
                    for s in cutlass.range_constexpr(self.slices):
                        self._slice_mma(tiled_mma, acc, tCrA, tCrB, s, read.index)
                    warpgroup.commit_group()
                    read.advance()
                    for _k in cutlass.range(1, k_tiles, unroll=1):
                        ab_pipe.consumer_wait(read)
                        for s in cutlass.range_constexpr(self.slices):
                            self._slice_mma(tiled_mma, acc, tCrA, tCrB, s, read.index)
                        warpgroup.commit_group()
                        warpgroup.wait_group(1)
                        ab_pipe.consumer_release(release)
                        release.advance()
                        read.advance()
                    warpgroup.wait_group(0)
                    ab_pipe.consumer_release(release)
                else:
                    # Per 32 of K: WGMMA into a scratch accumulator (ACCUMULATE off), then
                    # acc += scratch * fa[row] * fb[col]. Accumulator mode 0 is ((2, 2, N/8)):
                    # v0 = column of a pair, v1 = row half (+8), j = group of 8 columns.
                    ctid = mma_tidx - (wg_idx - 1) * 128
                    warp = ctid // 32
                    lane = ctid - warp * 32
                    row0 = (wg_idx - 1) * 64 + warp * 16 + lane // 4  # in the tile; and row0 + 8
                    col0 = 2 * (lane % 4)  # in the tile; and col0 + 1, + 8 j
                    sfb_base = storage.sSFB.data_ptr().toint() + col0 * 4
                    groups = self.tile_n // 8
                    scratch = [cute.make_rmem_tensor(acc.shape, Float32) for _ in range(2 if self.mode == "mx2" else 1)]
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                    for _k in cutlass.range(k_tiles, unroll=1):
                        ab_pipe.consumer_wait(read)
                        wa = [sSFA[(row0, 0, read.index)], sSFA[(row0 + 8, 0, read.index)]]
                        stage_base = sfb_base + read.index * (self.slices * self.tile_n * 4)
                        if cutlass.const_expr(self.mode == "b128"):
                            # the K tile's four slices chained in the scratch, one promotion per 128 of K
                            sc = self._scales(wa, stage_base, groups, 0)
                            warpgroup.fence()
                            for s in cutlass.range_constexpr(self.slices):
                                tiled_mma.set(warpgroup.Field.ACCUMULATE, s > 0)
                                self._slice_mma(tiled_mma, scratch[0], tCrA, tCrB, s, read.index)
                            warpgroup.commit_group()
                            warpgroup.wait_group(0)
                            self._promote(acc, scratch[0], sc)
                        elif cutlass.const_expr(self.mode == "mx"):
                            for s in cutlass.range_constexpr(self.slices):
                                sc = self._scales(wa, stage_base, groups, s)
                                warpgroup.fence()
                                self._slice_mma(tiled_mma, scratch[0], tCrA, tCrB, s, read.index)
                                warpgroup.commit_group()
                                warpgroup.wait_group(0)
                                self._promote(acc, scratch[0], sc)
                        else:
                            prev = None
                            for s in cutlass.range_constexpr(self.slices):
                                sc = self._scales(wa, stage_base, groups, s)
                                warpgroup.fence()
                                self._slice_mma(tiled_mma, scratch[s % 2], tCrA, tCrB, s, read.index)
                                warpgroup.commit_group()
                                if cutlass.const_expr(s > 0):
                                    warpgroup.wait_group(1)  # slice s-1 is done; slice s runs during its promotion
                                    self._promote(acc, scratch[(s - 1) % 2], prev)
                                prev = sc
                            warpgroup.wait_group(0)
                            self._promote(acc, scratch[(self.slices - 1) % 2], prev)
                        ab_pipe.consumer_release(read)
                        read.advance()

                # -------------------------------------------------------- epilogue: fp32 straight to C
                store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64)
                tiled_store = cute.make_tiled_copy_C(store_atom, tiled_mma)
                thr_store = tiled_store.get_slice(mma_tidx)
                gC = cute.local_tile(mC, (self.tile_m, self.tile_n), (None, None))
                cute.copy(tiled_store, tiled_store.retile(acc), thr_store.partition_D(gC[(None, None, bx, by)]))

        def _slice_mma(self, tiled_mma, dst, tCrA, tCrB, s: int, stage) -> None:
            """K slice ``s`` (one WGMMA's K) of ring stage ``stage``: ``dst`` (+)= A_s B_s^T."""
            cute.gemm(tiled_mma, dst, tCrA[(None, None, s, stage)], tCrB[(None, None, s, stage)], dst)

        def _scales(self, wa, stage_base, groups, s: int) -> tuple:
            """The slice's two row multipliers and the thread's column multipliers from the stage's
            shared memory (issued before the slice's WGMMA is waited for, so the loads overlap it)."""
            fa = [ue8m0_byte_to_f32(wa[h], s) for h in range(2)]
            row_addr = stage_base + s * (self.tile_n * 4)
            fb = [ld_shared_v2_f32(row_addr + j * 32) for j in range(groups)]
            return fa, fb

        def _promote(self, acc, part, scales) -> None:
            fa, fb = scales
            for j in range(len(fb)):
                for v1 in range(2):
                    for v0 in range(2):
                        i = ((v0, v1, j), 0, 0)
                        acc[i] = part[i] * (fa[v1] * fb[j][v0]) + acc[i]

    return ScaledGemmProbe


# ------------------------------------------------------------------------------------ build (CPU)
def build(out: Path, only: list[str] | None) -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe.src.moe_bf16_glu.export import link_library

    probe_cls = make_probe_class()
    out.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, (mode, tile_n) in VARIANTS.items():
        if only and name not in only:
            continue
        t0 = time.time()
        m, n, k = (cute.sym_int(divisibility=d) for d in (128, 128, 128))
        ab = cutlass.BFloat16 if mode == "bf16" else cutlass.Uint8

        def mat(dtype, shape):
            return make_fake_compact_tensor(dtype, shape, stride_order=(1, 0), assumed_align=16)

        args = [
            mat(ab, (m, k)),
            mat(ab, (n, k)),
            mat(cutlass.Int32, (cute.sym_int(), m)),  # packed UE8M0 of A, [K/128, M]
            mat(cutlass.Float32, (cute.sym_int(), n)),  # fp32 scales of B, [K/32, N]
            mat(cutlass.Float32, (m, n)),
            make_fake_stream(use_tvm_ffi_env_stream=True),
        ]
        compiled = cute.compile(probe_cls(mode, tile_n), *args, options="--enable-tvm-ffi")
        lib = link_library(compiled, out, f"probe_{name}")
        manifest[name] = dict(mode=mode, tile_n=tile_n, lib=lib.name)
        print(f"built {name:10s} {time.time() - t0:5.1f}s {lib.stat().st_size // 1024} KiB", flush=True)
    path = out / "manifest.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**old, **manifest}, indent=1))


# ------------------------------------------------------------------------------------ run (GPU)
def make_inputs(m: int, n: int, k: int, gen):
    """E4M3 codes with per-32 UE8M0 scales for A and B, their exact dequantized BF16, and the packed
    scale forms the kernels read."""
    import torch

    dev = "cuda"

    def codes(rows):
        x = torch.randn(rows, k, device=dev, generator=gen) * 64
        return x.clamp(-448, 448).to(torch.float8_e4m3fn)

    a_q, b_q = codes(m), codes(n)
    ea = torch.randint(120, 135, (m, k // 32), device=dev, generator=gen, dtype=torch.int32)
    eb = torch.randint(120, 135, (n, k // 32), device=dev, generator=gen, dtype=torch.int32)
    a_deq = a_q.float() * torch.exp2((ea - 127).float()).repeat_interleave(32, dim=1)
    b_deq = b_q.float() * torch.exp2((eb - 127).float()).repeat_interleave(32, dim=1)
    shifts = torch.tensor([0, 8, 16, 24], device=dev, dtype=torch.int32)
    sfa = (ea.view(m, k // 128, 4) << shifts).sum(-1, dtype=torch.int32).t()  # [K/128, M]
    sfb = torch.exp2((eb - 127).float()).t().contiguous()  # [K/32, N]
    # ``b128`` reads slice 0's scales for the whole K tile: its operands, one scale per 128 of K
    a_deq128 = a_q.float() * torch.exp2((ea[:, ::4] - 127).float()).repeat_interleave(128, dim=1)
    b_deq128 = b_q.float() * torch.exp2((eb[:, ::4] - 127).float()).repeat_interleave(128, dim=1)
    return dict(
        a_q=a_q.view(torch.uint8),
        b_q=b_q.view(torch.uint8),
        a_bf=a_deq.bfloat16(),
        b_bf=b_deq.bfloat16(),
        sfa=sfa.contiguous(),
        sfb=sfb,
        a_codes=a_q.float(),
        b_codes=b_q.float(),
        a_deq=a_deq,
        b_deq=b_deq,
        a_deq128=a_deq128,
        b_deq128=b_deq128,
    )


def run(lib_dir: Path, shapes: list[tuple[int, int, int]], iters: int, sets: int) -> int:
    import torch
    import tvm_ffi

    torch.backends.cuda.matmul.allow_tf32 = False
    manifest = json.loads((lib_dir / "manifest.json").read_text())
    fns = {}
    for name, v in manifest.items():
        mod = tvm_ffi.load_module(str((lib_dir / v["lib"]).resolve()))
        fns[name] = (v, getattr(mod, f"probe_{name}"), mod)
    print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__, flush=True)

    def call(name, inp, out):
        v, fn, _ = fns[name]
        if v["mode"] == "bf16":
            fn(inp["a_bf"], inp["b_bf"], inp["sfa"], inp["sfb"], out)
        else:
            fn(inp["a_q"], inp["b_q"], inp["sfa"], inp["sfb"], out)

    failures, rows = 0, []
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    # ---- correctness: a small odd-ish shape and each timed shape, against the fp32 reference
    for m, n, k in [(256, 512, 384), *shapes]:
        inp = make_inputs(m, n, k, gen)
        ref_mx = inp["a_deq"] @ inp["b_deq"].t()
        ref_codes = inp["a_codes"] @ inp["b_codes"].t()
        ref_b128 = inp["a_deq128"] @ inp["b_deq128"].t()
        for name, (v, _, _) in fns.items():
            if n % v["tile_n"]:
                continue
            ref = {"fp8": ref_codes, "b128": ref_b128}.get(v["mode"], ref_mx)
            out = torch.full((m, n), float("nan"), device="cuda")
            call(name, inp, out)
            torch.cuda.synchronize()
            err = ((out - ref).abs().sum() / ref.abs().sum()).item()
            big = ref.abs() > 1e-2 * ref.abs().max()
            max_rel = ((out - ref).abs()[big] / ref.abs()[big]).max().item()
            if v["mode"] == "fp8":
                # one FP8 WGMMA chain over all of K: the tensor core's own accumulation precision
                # (measured: mean 2e-4 at K = 384, 1.6e-3 with a 19 % worst element at K >= 7168),
                # so only the mean is gated; the max is reported
                ok = bool(torch.isfinite(out).all()) and err < 1e-2
            else:
                ok = bool(torch.isfinite(out).all()) and err < 1e-3 and max_rel < 5e-2
            failures += not ok
            print(
                f"check {name:10s} {m}x{n}x{k}: mean rel {err:.2e} max rel {max_rel:.2e} {'ok' if ok else 'FAIL'}",
                flush=True,
            )
        del inp, ref_mx, ref_codes, ref_b128

    # ---- timing: rotating input sets, CUDA events, median
    for m, n, k in shapes:
        sets_in = [make_inputs(m, n, k, gen) for _ in range(sets)]
        out = torch.empty((m, n), device="cuda")
        times = {}
        for name, (v, _, _) in fns.items():
            if n % v["tile_n"]:
                continue
            for i in range(3):
                call(name, sets_in[i % sets], out)
            ts = []
            for i in range(iters):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                call(name, sets_in[i % sets], out)
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1))
            times[name] = statistics.median(ts)
        # torch reference rate on the same machine, same shape (bf16 matmul, cuBLAS)
        ts = []
        for i in range(iters):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.matmul(sets_in[i % sets]["a_bf"], sets_in[i % sets]["b_bf"].t())
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        times["torch_bf16_matmul"] = statistics.median(ts)
        flop = 2.0 * m * n * k
        for name, ms in times.items():
            base = times.get("bf16_n128")
            rows.append((f"{m}x{n}x{k}", name, ms, flop / ms / 1e9, base / ms if base else float("nan")))
        del sets_in

    print("\n| shape (MxNxK) | variant | ms | TFLOP/s | x bf16_n128 |")
    print("|---|---|---|---|---|")
    for shape, name, ms, tf, ratio in rows:
        print(f"| {shape} | {name} | {ms:.3f} | {tf:.0f} | {ratio:.2f} |")
    print(f"\nfailures: {failures}")
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, default=REPO / ".kcache-probe")
    b.add_argument("--only", nargs="*")
    r = sub.add_parser("run")
    r.add_argument("--lib", type=Path, default=REPO / ".kcache-probe")
    r.add_argument("--shapes", nargs="*", default=["8192x8192x8192", "4096x4096x7168"])
    r.add_argument("--iters", type=int, default=20)
    r.add_argument("--sets", type=int, default=3)
    a = p.parse_args()
    if a.cmd == "build":
        build(a.out, a.only)
        return 0
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes]
    return run(a.lib, shapes, a.iters, a.sets)


if __name__ == "__main__":
    raise SystemExit(main())
