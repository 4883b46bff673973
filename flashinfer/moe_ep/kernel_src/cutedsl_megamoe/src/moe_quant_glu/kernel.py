"""``Sm90MegaMoEQuantKernel``: the MoE expert computation with MXFP8 or NVFP4 weights and activations.

``__call__`` enqueues five kernels (no host synchronization), as the BF16 kernel does:

1. routing (the BF16 kernel's);
2. gather with the activation quantized-dequantized along H (``aux_kernels.quant_gather_kernel``),
   or, with ``prequantized``, dequantized from the given codes and block scales
   (``aux_kernels.dequant_gather_kernel``, no requantization), into the K rows of each token's pairs;
   with ``gather_in_fc1`` into the token's own row of ``x_rows`` once, plus the row map, and FC1
   gathers its B rows from there (``swap_gemm`` ``gather_b``);
3. FC1: packed weights dequantized to BF16 (in shared memory, ``dequant_gemm``, or with
   ``swap_ab`` for decode in registers, ``swap_gemm``; with ``gemv``, a GEMV of ``mma.sync`` whose warps
   stream their own weight rows, ``gemv``), BF16 WGMMA (``mma.sync`` for the GEMV), the activation and the
   requantization to the FC2 input format in the epilogue -> ``h_buf`` (exact BF16 values);
4. FC2 the same way -> ``a_buf`` reused as y [M_cap, H] bf16;
5. combine (the BF16 kernel's): ``out[t] = bf16(sum_k w[t,k] * y)``, k in order.

With ``pair_blocks`` (the GEMV, one token) the GEMMs take M block b as pair b of ``topk_ids``: FC1 prepares
its token's row itself and no routing or gather kernel runs; with ``pair_combine`` FC2 also does the
combine, so the layer is two kernels (``gemv`` module docstring), and with ``gemv_fused`` one
(``gemv_fused`` module docstring).

The routing, gather and combine grids are sized to the work, as the BF16 kernel's ``sized_grids``.

The reference semantics are ``flashinfer.moe_ep.core.reference_quant`` with static NVFP4 activation
global scales (``act_gscale = [input scale, FC2 input scale]``; MXFP8 ignores them).
"""

import cutlass
import cutlass.cute as cute

from ..common import constants
from ..moe_bf16_glu import aux_kernels
from .aux_kernels import dequant_gather_kernel, gather_threads, quant_gather_kernel
from .dequant_gemm import DequantGroupedGemmSm90
from .gemv import GEMV_TOKEN_TILES, GemvDequantSm90
from .gemv_fused import GemvFusedPairSm90
from .swap_gemm import SwapDequantGemmSm90


class Sm90MegaMoEQuantKernel:
    """Compile-time knobs of the quantized MoE kernel (world size 1).

    :param fmt: ``"mxfp8"`` or ``"nvfp4"`` (weights and activations).
    :param activation, limit: as ``Sm90MegaMoEBf16Kernel``.
    :param tile_m: rows per M tile (64 or 128; with ``swap_ab`` the token tile, 16, 32, 64 or 128).
    :param fc1_tile_n, fc2_tile_n: N tiles (w13 gate/up rows interleaved per ``fc1_tile_n`` before
        packing, see ``weights.pack_quantized_weights``). ``swap_ab`` ignores them (its weight tiles
        follow ``common.host_utils.swap_tile_plan``) but needs gate/up interleaved per 256 rows.
    :param swap_ab: the swap-AB GEMMs (``swap_gemm``): weights as the WGMMA A operand, dequantized in
        registers; tokens as N.
    :param swap_wg: consumer warpgroups per CTA of the swap-AB GEMMs at most (1: CTA tiles of 256
        weight rows instead of 512, twice as many tiles for few tokens; 4, with ``swap_atoms`` 2 or 1:
        16 converting warps on an SM instead of 8, 112 registers each).
    :param swap_atoms: WGMMA atoms (64 weight rows) per warpgroup of the swap-AB GEMMs at most (4, or 2
        or 1: fewer rows per warpgroup at every token tile, see ``common.host_utils.swap_tile_plan``).
    :param swap_stagger: K tiles the second consumer warpgroup of a swap-AB CTA starts behind the first
        (0: in lock step; at most half the ring), so one's epilogue overlaps the other's WGMMAs.
    :param swap_narrow: (``swap_ab`` only) a tile whose real tokens fit 64, 32 or 16 columns (below the token
        tile) runs the narrowest WGMMA that holds them, on the first columns of its token stage (each expert's
        last token tile holds its remainder: at 128-token tiles about a fifth of the MMA slots of a uniform
        prefill are padding otherwise). The conversion of the weights is the same at every width. Output-neutral
        (the same products per output, summed alike). Off by default here; the frontend turns it on where it was
        measured faster (TUNING.md, session 36).
    :param swap_tma_store: (``swap_ab`` only) FC2's swap-AB epilogue stages each group of 8 tokens x a warp's
        16, 32 or 64 features in shared memory (transposing ``stmatrix``) and writes it with one TMA store, instead
        of a shuffle and a 32-bit store per feature pair (``SwapDequantGemmSm90(tma_store=True)``; FC1, whose
        epilogue is gated, keeps the register stores). Output-neutral. Refused with four consumer warpgroups or
        one WGMMA atom per warpgroup (four 1-atom warpgroups stored wrong values on a GPU; TUNING.md, session 38).
        Off by default here; the frontend turns it on where it was measured faster.
    :param num_sms, fc1_stages, fc2_stages, use_pdl, aux_vpt: as the BF16 kernel.
    :param swap_split_k: (``swap_ab`` only) K parts per CTA tile of the swap-AB GEMMs at most (1, 2,
        4): where that many parts of every tile fit one wave of the grid (few tokens), each part runs
        on its own CTA and the last sums them (``swap_gemm`` split K; workspaces ``split_ws`` and
        ``split_count``).
    :param gather_in_fc1: (``swap_ab`` only) each token's activation row is prepared once into
        ``x_rows`` and FC1 loads its token columns from there through the row map, instead of a
        prepared copy per pair in ``a_buf`` (T rows written instead of T * top_k).
    :param fc1_early_weights: (``swap_ab`` without ``gather_in_fc1``) FC1 issues its first work unit's
        weight loads before waiting for the gather (``SwapDequantGemmSm90(early_w=True)``), which lets FC1
        launch only once its own wait for the routing has returned: the weight stream starts while the
        activations are still being quantized. Measured on H200 (TUNING.md, session 23): up to 4 % faster
        at T = 1-2 beside FC2's early loads, 1-2 % slower with 16-token tiles from T = 8.
    :param gather_early_rows: the activation gather loads and quantizes (or dequantizes) its first items
        before it waits for the routing, which then triggers its dependents after its own wait (so ``x``
        is complete when the gather starts); only the gather's stores wait for the routing. Measured on
        H200 (TUNING.md, session 23): 0-4 % faster at T = 1 to 128, outputs bitwise equal.
    :param fc2_early_weights: (``swap_ab`` only) FC2 issues its first work unit's weight loads before
        waiting for FC1 (``SwapDequantGemmSm90(early_w=True)``), and FC1 lets FC2 launch only once its own
        wait has returned (FC2 reads the block map before its wait). Measured on H200 (TUNING.md, session
        23): 0-7 % faster at T = 1 to 128, within +-1 % at T = 4096, outputs bitwise equal.
    :param gemv: (``swap_ab`` with 8 or 16-token tiles only) FC1 and FC2 as ``gemv.GemvDequantSm90``: every
        warp streams its weight rows through a ``cp.async`` ring of its own and multiplies them with
        ``mma.sync``; one CTA per (M block, 64 weight rows) with ``gemv_k_warps`` warps splitting K. For the
        smallest T, where the swap-AB GEMMs are bound by their K loop's latency rather than the weight
        bytes. ``fc1_early_weights`` and ``fc2_early_weights`` apply to it as to the swap-AB GEMMs.
    :param gemv_k_warps: warps per GEMV CTA (2, 4, 8, 16).
    :param gemv_fc1_k_warps: FC1's warps per GEMV CTA where they differ from FC2's (None: ``gemv_k_warps``). Each
        warp of a CTA takes every ``k_warps``-th K unit in turn, one ``cp.async`` round trip after another, so
        more warps shorten FC1's chain (K = H units); FC2's CTAs (K = I, its token chunks in the ring) keep
        theirs and their occupancy.
    :param gemv_stages: the depth of each GEMV warp's ``cp.async`` ring (2 or more; with the warps, shared
        memory bounds it: ``common.host_utils.gemv_shared_bytes``).
    :param gemv_l2_prefetch: (``gemv`` only) each GEMV warp requests the weight rows and scales of its later K
        units into L2 with bulk prefetches as soon as it knows its expert (``GemvDequantSm90(l2_prefetch=True)``;
        FC2 with ``fc2_early_weights`` before its wait). Off by default: 8-14 % slower in the qwen3-30b-a3b pair
        chain at T = 1-2 (TUNING.md, sessions 39-40).
    :param gemv_early_ring: (``gemv`` with ``fc2_early_weights``) FC2's GEMV copies every stage of its ring's weights
        before its wait, not all but the last (``GemvDequantSm90(early_ring=True)``): a warp of at most
        ``gemv_stages`` K units then waits for no weight copy after FC1. The same copies and products.
    :param pair_blocks: (``gemv`` only) no routing and no gather kernel: M block b of both GEMVs is pair b of
        ``topk_ids`` (its expert, one real token column), and FC1 quantizes its token's row itself after its
        wait (``GemvDequantSm90(gather_x=True)``: the gather's functions, so the same values). Meant for one
        token: ``T * top_k <= num_experts`` (the workspace's rows; the frontend checks it before each
        launch). FC1 is then the layer's first kernel, so it reads ``topk_ids`` only after its wait:
        ``fc1_early_weights`` and ``gather_early_rows`` (no gather) must be off.
    :param pair_combine: (``pair_blocks`` only) FC2 combines the pairs itself, the last of a token's ``top_k``
        units of each 64-column row warp summing them in k order (the combine kernel's bits), and the combine
        kernel is not launched; its counters extend ``expert_count`` (``host_utils.pair_combine_counters(E,
        K, H, 64)``, zero on entry and zeroed again).
    :param gemv_pair_cluster: (``pair_combine`` only, ``top_k <= 8``) FC2's ``top_k`` units of a token's row warp run
        as one cluster and meet in the shared memory of its rank-0 CTA, which sums them (the same bits); no y
        rows, counters or atomics (``GemvDequantSm90(pair_cluster=True)``).
    :param gemv_row_tma: (``pair_blocks`` only, BF16 rows: not ``prequantized``) FC1 requests its token's BF16 row
        into shared memory with one bulk copy (TMA, on an mbarrier) right after its wait, before the ``topk_ids``
        read and its weight copies, and quantizes it there (``GemvDequantSm90(row_tma=True)``; the same values).
    :param gemv_fused: (``pair_combine`` only) the pair chain's FC1 and FC2 as one persistent launch of ``num_sms``
        CTAs of ``gemv_k_warps`` warps with ``gemv_stages``-deep rings (``gemv_fused.GemvFusedPairSm90``): every CTA
        an equal share of each GEMV's (pair, row warp, K unit) items, a grid barrier between FC1 and FC2, FC2's
        weights copied ahead of it; the split units' partial sums meet in ``split_ws`` / ``split_count``
        (``host_utils.gemv_fused_workspace``). Serves ``T * top_k <= num_sms``. It sums K in another order than the
        two-kernel chain (fixed for a given T). ``gemv_fc1_k_warps``, ``gemv_pair_cluster``, ``gemv_row_tma``,
        ``gemv_l2_prefetch``, ``gemv_early_ring`` and ``fc2_early_weights`` do not apply and are refused.
    :param prequantized: ``x`` holds the activation codes in the format (uint8: E4M3 [T, H] or E2M1
        pairs [T, H/2]) and ``x_scale`` their block scales (uint8: UE8M0 [T, H/32] or E4M3 [T, H/16]);
        otherwise ``x`` is bf16 [T, H], quantized by the kernel, and ``x_scale`` is not read.
    """

    def __init__(
        self,
        fmt: str,
        activation: str = constants.ACT_SWIGLU,
        limit: float | None = None,
        tile_m: int = 128,
        fc1_tile_n: int = 256,
        fc2_tile_n: int = 256,
        num_sms: int = constants.DEFAULT_NUM_SMS,
        fc1_stages: int | None = None,
        fc2_stages: int | None = None,
        use_pdl: bool = True,
        aux_vpt: int = 4,
        probe: int = 0,
        bf_buffers: int = 3,
        swap_ab: bool = False,
        swap_wg: int = 2,
        prequantized: bool = False,
        swap_atoms: int = 4,
        swap_stagger: int = 0,
        gather_in_fc1: bool = False,
        swap_split_k: int = 1,
        fc2_early_weights: bool = False,
        fc1_early_weights: bool = False,
        gather_early_rows: bool = False,
        gemv: bool = False,
        gemv_k_warps: int = 4,
        gemv_stages: int = 2,
        pair_blocks: bool = False,
        pair_combine: bool = False,
        swap_narrow: bool = False,
        swap_tma_store: bool = False,
        gemv_l2_prefetch: bool = False,
        gemv_fc1_k_warps: int | None = None,
        gemv_early_ring: bool = False,
        gemv_pair_cluster: bool = False,
        gemv_row_tma: bool = False,
        gemv_fused: bool = False,
    ) -> None:
        if gemv_fused and not pair_combine:
            raise ValueError("gemv_fused needs pair_combine (the GEMV pair chain)")
        if gemv_fused and (
            gemv_fc1_k_warps is not None
            or gemv_pair_cluster
            or gemv_row_tma
            or gemv_l2_prefetch
            or gemv_early_ring
            or fc2_early_weights
        ):
            raise ValueError(
                "gemv_fused runs FC1 and FC2 in one grid of gemv_k_warps warps a CTA: gemv_fc1_k_warps, "
                "gemv_pair_cluster, gemv_row_tma, gemv_l2_prefetch, gemv_early_ring and fc2_early_weights do not apply"
            )
        self.gemv_fused = gemv_fused
        if swap_narrow and not swap_ab:
            raise ValueError("swap_narrow needs the swap-AB GEMMs (swap_ab=True)")
        if swap_tma_store and not (swap_ab and not gemv):
            raise ValueError("swap_tma_store needs the swap-AB GEMMs (swap_ab=True, gemv=False)")
        if pair_blocks and not (gemv and not fc1_early_weights and not gather_early_rows):
            raise ValueError("pair_blocks needs gemv=True, fc1_early_weights=False and gather_early_rows=False")
        if pair_combine and not pair_blocks:
            raise ValueError("pair_combine needs pair_blocks")
        if gemv_pair_cluster and not pair_combine:
            raise ValueError("gemv_pair_cluster needs pair_combine")
        if gemv_row_tma and not (pair_blocks and not prequantized):
            raise ValueError("gemv_row_tma needs pair_blocks and BF16 rows (prequantized=False)")
        if gemv_l2_prefetch and not gemv:
            raise ValueError("gemv_l2_prefetch needs the GEMV (gemv=True)")
        if gemv_fc1_k_warps is not None and not gemv:
            raise ValueError("gemv_fc1_k_warps needs the GEMV (gemv=True)")
        if gemv_early_ring and not (gemv and fc2_early_weights):
            raise ValueError("gemv_early_ring needs the GEMV's early weights (gemv=True, fc2_early_weights=True)")
        self.pair_blocks = pair_blocks
        self.pair_combine = pair_combine
        if gemv and not (swap_ab and tile_m in GEMV_TOKEN_TILES and not gather_in_fc1 and swap_split_k == 1):
            raise ValueError(f"gemv needs swap_ab=True, tile_m in {GEMV_TOKEN_TILES}, no gather_in_fc1, swap_split_k=1")
        self.gemv = gemv
        if gather_early_rows and not use_pdl:
            raise ValueError("gather_early_rows needs use_pdl")
        self.gather_early_rows = gather_early_rows
        if gemv_fused and not use_pdl:
            raise ValueError("gemv_fused needs use_pdl (it lets its dependents launch after its own wait)")
        if fc2_early_weights and not (swap_ab and use_pdl):
            raise ValueError("fc2_early_weights needs the swap-AB GEMMs (swap_ab=True) and use_pdl")
        if fc1_early_weights and not (swap_ab and use_pdl and not gather_in_fc1):
            raise ValueError("fc1_early_weights needs the swap-AB GEMMs (swap_ab=True), use_pdl, no gather_in_fc1")
        self.fc1_early_weights = fc1_early_weights
        if fmt not in constants.QUANT_FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        if activation not in constants.ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}")
        if swap_ab and not gemv and tile_m not in constants.SWAP_TOKEN_TILES:
            raise ValueError(f"with swap_ab, tile_m must be one of {constants.SWAP_TOKEN_TILES}, got {tile_m}")
        if not swap_ab and tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {tile_m}")
        if gather_in_fc1 and not swap_ab:
            raise ValueError("gather_in_fc1 needs the swap-AB GEMMs (swap_ab=True)")
        if swap_split_k != 1 and not swap_ab:
            raise ValueError("swap_split_k needs the swap-AB GEMMs (swap_ab=True)")
        self.swap_split_k = swap_split_k
        self.gather_in_fc1 = gather_in_fc1
        self.swap_ab = swap_ab
        self.prequantized = prequantized
        self.fmt = fmt
        self.activation = activation
        self.limit = limit
        self.tile_m = tile_m
        self.num_sms = num_sms
        self.aux_threads = 256
        self.aux_grid = num_sms * 8
        self.use_pdl = use_pdl
        self.aux_vpt = aux_vpt
        self.fused = None  # gemv_fused: both GEMVs in one launch
        if gemv_fused:
            self.fused = GemvFusedPairSm90(fmt, activation, limit, gemv_k_warps, gemv_stages, num_sms, prequantized)
            self.fc1, self.fc2 = self.fused.fc1, self.fused.fc2
        else:
            self.fc1, self.fc2 = quant_gemms(
                fmt, tile_m, fc1_tile_n, fc2_tile_n, activation, limit, num_sms, fc1_stages, fc2_stages, swap_ab,
                swap_wg, probe, bf_buffers, swap_atoms, swap_stagger, gather_in_fc1, swap_split_k, fc2_early_weights,
                fc1_early_weights, gemv, gemv_k_warps, gemv_stages, pair_blocks, prequantized, pair_combine,
                swap_narrow, swap_tma_store, gemv_l2_prefetch, gemv_fc1_k_warps, gemv_early_ring, gemv_pair_cluster,
                gemv_row_tma,
            )  # fmt: skip

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # [T, H] bf16, or with ``prequantized`` the codes (uint8)
        x_scale: cute.Tensor,  # with ``prequantized`` the block scales (uint8), else unused
        topk_ids: cute.Tensor,  # [T, K] int32
        topk_weights: cute.Tensor,  # [T, K] fp32
        w13: cute.Tensor,  # [E, H/64, N1, D] uint8 data (weights.pack_quantized_weights)
        w13_scale: cute.Tensor,  # [E, H/64, N1, S] uint8 scale bytes
        w2: cute.Tensor,  # [E, I/64, H, D] uint8
        w2_scale: cute.Tensor,  # [E, I/64, H, S] uint8
        w13_gscale: cute.Tensor,  # [E] fp32 (NVFP4; ones for MXFP8)
        w2_gscale: cute.Tensor,  # [E] fp32
        act_gscale: cute.Tensor,  # [2] fp32: NVFP4 global scales of x and of the FC2 input
        out: cute.Tensor,  # [T, H] bf16
        pair_row: cute.Tensor,  # workspace: common.host_utils.moe_bf16_workspace_spec
        pair_rank: cute.Tensor,
        expert_count: cute.Tensor,
        cta_base: cute.Tensor,
        expert_off: cute.Tensor,
        m_block_expert: cute.Tensor,
        meta: cute.Tensor,
        a_buf: cute.Tensor,
        h_buf: cute.Tensor,
        x_rows: cute.Tensor,  # [T_cap, H] bf16: the prepared token rows (gather_in_fc1; else unused)
        split_ws: cute.Tensor,  # fp32: swap-AB split-K partials (swap_split_k > 1; else unused)
        split_count: cute.Tensor,  # int32: their counters, zero between calls
        stream,
    ):
        num_experts = w13.shape[0]
        pdl = self.use_pdl
        if cutlass.const_expr(self.gemv_fused):
            self.fused.launch(
                x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, w13_gscale, w2_gscale, act_gscale,
                out, h_buf, a_buf, expert_count, split_ws, split_count, stream, pdl,
            )  # fmt: skip
            return
        num_tokens, top_k = topk_ids.shape[0], topk_ids.shape[1]
        # Grids sized to the work (moe_bf16_glu.aux_kernels.launch_ctas): one CTA or a few at small T.
        route_ctas = aux_kernels.launch_ctas(num_tokens * top_k, aux_kernels.ROUTE_PAIRS_PER_CTA, self.num_sms)
        gather_ctas = aux_kernels.launch_ctas(
            gather_threads(num_tokens, out.shape[1], self.gather_in_fc1), self.aux_threads, self.aux_grid
        )
        combine_items = num_tokens * (out.shape[1] // (constants.BF16_PER_16B * self.aux_vpt))
        combine_ctas = aux_kernels.launch_ctas(combine_items, self.aux_threads, self.aux_grid)
        routed = not self.pair_blocks  # pair_blocks: the GEMVs read topk_ids themselves, FC1 prepares its row
        fc1_args = {}
        fc2_args = {}
        if cutlass.const_expr(routed):
            aux_kernels.route_kernel(
                topk_ids,
                pair_rank,
                expert_count,
                cta_base,
                expert_off,
                m_block_expert,
                meta,
                None,  # no row map here: the gather writes pair_row
                None,
                num_experts,
                self.tile_m,
                1,
                False,
                False,
                self.gather_early_rows,
            ).launch(grid=[route_ctas, 1, 1], block=[constants.ROUTING_THREADS, 1, 1], stream=stream, use_pdl=pdl)
            # gather_in_fc1: the row -> token map lives in a_buf until FC2 writes y there (FC2 starts after FC1 ends).
            row_token = cute.make_tensor(
                cute.recast_ptr(a_buf.iterator, dtype=cutlass.Int32), cute.make_layout(a_buf.shape[0])
            )
            rows = x_rows if self.gather_in_fc1 else a_buf
            if cutlass.const_expr(self.prequantized):
                gather = dequant_gather_kernel(
                    x, x_scale, topk_ids, pair_rank, expert_off, cta_base, pair_row, rows, route_ctas, row_token,
                    self.fmt, self.gather_in_fc1, self.fc1_early_weights, self.gather_early_rows,
                )  # fmt: skip
            else:
                gather = quant_gather_kernel(
                    x, topk_ids, pair_rank, expert_off, cta_base, pair_row, rows, act_gscale, route_ctas, row_token,
                    self.fmt, self.gather_in_fc1, self.fc1_early_weights, self.gather_early_rows,
                )  # fmt: skip
            gather.launch(grid=[gather_ctas, 1, 1], block=[self.aux_threads, 1, 1], stream=stream, use_pdl=pdl)
            if cutlass.const_expr(self.gather_in_fc1):
                fc1_args = {"x_rows": x_rows, "row_token": row_token}
        else:
            fc1_args = {"x": x, "x_scale": x_scale, "topk_ids": topk_ids}
            fc2_args = {"topk_ids": topk_ids, "out": out, "topk_weights": topk_weights, "counters": expert_count}
        # FC1 and FC2 share the split-K workspaces: FC2 waits for FC1's end (griddepcontrol) before its loop.
        split = {"split_ws": split_ws, "split_count": split_count} if self.swap_split_k > 1 else {}
        if cutlass.const_expr(self.gemv):
            split = {"max_blocks": num_tokens * top_k}  # the routing's M blocks at most (pair_blocks: exactly)
        self.fc1.launch(
            a_buf, w13, w13_scale, h_buf, m_block_expert, meta, w13_gscale, act_gscale, stream, pdl,
            **fc1_args, **split,
        )  # fmt: skip
        self.fc2.launch(
            h_buf, w2, w2_scale, a_buf, m_block_expert, meta, w2_gscale, act_gscale, stream, pdl, **fc2_args, **split
        )
        if cutlass.const_expr(not self.pair_combine):
            pair_rows = self.tile_m if self.pair_blocks else 0  # pair_blocks: pair p's y row is p * tile_m
            aux_kernels.combine_kernel(a_buf, pair_row, topk_weights, out, top_k, self.aux_vpt, pair_rows).launch(
                grid=[combine_ctas, 1, 1], block=[self.aux_threads, 1, 1], stream=stream, use_pdl=pdl
            )

def quant_gemms(
    fmt: str,
    tile_m: int,
    fc1_tile_n: int,
    fc2_tile_n: int,
    activation: str,
    limit: float | None,
    grid: int,
    fc1_stages: int | None,
    fc2_stages: int | None,
    swap_ab: bool,
    swap_wg: int,
    probe: int = 0,
    bf_buffers: int = 3,
    swap_atoms: int = 4,
    swap_stagger: int = 0,
    gather_in_fc1: bool = False,
    swap_split_k: int = 1,
    fc2_early_weights: bool = False,
    fc1_early_weights: bool = False,
    gemv: bool = False,
    gemv_k_warps: int = 4,
    gemv_stages: int = 2,
    pair_blocks: bool = False,
    prequantized: bool = False,
    pair_combine: bool = False,
    swap_narrow: bool = False,
    swap_tma_store: bool = False,
    gemv_l2_prefetch: bool = False,
    gemv_fc1_k_warps: int | None = None,
    gemv_early_ring: bool = False,
    gemv_pair_cluster: bool = False,
    gemv_row_tma: bool = False,
) -> tuple:
    """FC1 (the activation and the requantization to the FC2 input format in its epilogue) and FC2 of the
    block-scaled kernels (world size 1 and EP): the swap-AB GEMMs (weights dequantized in registers,
    ``tile_m`` tokens as N) or the shared-memory-dequantization ones (``tile_m``-row M tiles).
    ``gather_in_fc1``: the swap-AB FC1 loads its token rows itself (``SwapDequantGemmSm90(gather_b=True)``);
    ``swap_split_k``: their split K (``SwapDequantGemmSm90(split_k=...)``); ``fc2_early_weights``: FC2's
    weight loads before its wait (``early_w``), FC1's trigger after its own; ``fc1_early_weights``: FC1's
    weight loads before its wait (the gather before it triggers after its own wait); ``gemv``: both as
    ``gemv.GemvDequantSm90`` (the same early loads); ``pair_blocks`` / ``pair_combine``: the GEMVs' pair chain
    (FC1 preparing its token's row, of codes with ``prequantized``; FC2 combining); ``swap_narrow``: the swap-AB
    GEMMs' narrower WGMMAs for tiles of few real tokens (``SwapDequantGemmSm90(narrow=True)``); ``swap_tma_store``:
    the swap-AB FC2's epilogue through shared memory and TMA stores (``SwapDequantGemmSm90(tma_store=True)``);
    ``gemv_l2_prefetch``: the GEMVs' bulk L2 prefetches of their later K units
    (``GemvDequantSm90(l2_prefetch=True)``); ``gemv_fc1_k_warps``: FC1's GEMV warps (None: ``gemv_k_warps``);
    ``gemv_early_ring``: FC2's GEMV copies its whole ring's weights before its wait; ``gemv_pair_cluster``: FC2's
    GEMV combines each token's pairs in a cluster of its ``top_k`` CTAs; ``gemv_row_tma``: FC1's GEMV bulk-copies its
    token's BF16 row."""
    if gemv:
        fc1_k_warps = gemv_k_warps if gemv_fc1_k_warps is None else gemv_fc1_k_warps
        fc1 = GemvDequantSm90(fmt, tile_m, activation, limit, requant=True, k_warps=fc1_k_warps,
                              early_w=fc1_early_weights, trigger_after_wait=fc2_early_weights,
                              stages=gemv_stages, pair_blocks=pair_blocks, gather_x=pair_blocks,
                              prequantized=prequantized, l2_prefetch=gemv_l2_prefetch,
                              row_tma=gemv_row_tma)  # fmt: skip
        fc2 = GemvDequantSm90(fmt, tile_m, "plain", None, gscale_index=1, k_warps=gemv_k_warps,
                              early_w=fc2_early_weights, stages=gemv_stages, pair_blocks=pair_blocks,
                              pair_combine=pair_combine, l2_prefetch=gemv_l2_prefetch,
                              early_ring=gemv_early_ring, pair_cluster=gemv_pair_cluster)  # fmt: skip
        return fc1, fc2
    if swap_ab:
        swap = {"max_wg": swap_wg, "max_atoms": swap_atoms, "stagger": swap_stagger, "split_k": swap_split_k,
                "narrow": swap_narrow}  # fmt: skip
        fc1 = SwapDequantGemmSm90(
            fmt, tile_m, activation, limit, grid, fc1_stages, requant=True, gather_b=gather_in_fc1,
            early_w=fc1_early_weights, trigger_after_wait=fc2_early_weights, **swap,
        )  # fmt: skip
        fc2 = SwapDequantGemmSm90(
            fmt, tile_m, "plain", None, grid, fc2_stages, gscale_index=1, early_w=fc2_early_weights,
            tma_store=swap_tma_store, **swap,
        )  # fmt: skip
        return fc1, fc2
    fc1 = DequantGroupedGemmSm90(fmt, tile_m, fc1_tile_n, activation, limit, grid, fc1_stages, requant=True,
                                 gscale_index=0, probe=probe, bf_buffers=bf_buffers)  # fmt: skip
    fc2 = DequantGroupedGemmSm90(fmt, tile_m, fc2_tile_n, "plain", None, grid, fc2_stages, gscale_index=1,
                                 probe=probe, bf_buffers=bf_buffers)  # fmt: skip
    return fc1, fc2
