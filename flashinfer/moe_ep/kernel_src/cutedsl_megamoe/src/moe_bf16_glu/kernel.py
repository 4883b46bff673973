"""``Sm90MegaMoEBf16Kernel``: the whole BF16 MoE expert computation as one traced host function.

``__call__`` enqueues five kernels on the stream with no host synchronization:

1. routing (G1 CTAs, one per 128 pairs up to num_sms): per-CTA expert histograms and slot
   reservations; the last CTA computes the padded per-expert offsets, the expert of every M block
   and the block count (a single CTA, at T * K <= 128, straight from its histogram);
2. row map: final row of every (token, k) pair (``pair_row``) and the token of every real row
   (``row_token``, held in the first 4 * M_cap bytes of ``a_buf`` until FC2 overwrites it); written
   by the routing kernel itself when its grid is one CTA (``route_maps_rows``), then not launched;
   with ``gather_in_fc1=False`` the gather instead: ``a_buf[row] = x[token]``;
3. FC1 grouped GEMM with the activation fused in the epilogue -> ``h_buf`` [M_cap, I]; its A rows
   come from ``x`` through ``row_token`` (or from ``a_buf``);
4. FC2 grouped GEMM -> ``a_buf`` reused as y [M_cap, H];
5. combine: ``out[t] = bf16(sum_k w[t,k] * y[pair_row[t,k]])``, k in order, no atomics on data
   (``pair_combine``: done by FC2 itself, not launched).

The token count T is a symbolic extent: one compiled library serves every 0 <= T <= max_tokens,
where max_tokens sized the workspace (``common.host_utils.moe_bf16_workspace_spec``).
"""

import cutlass
import cutlass.cute as cute

from ..common import constants
from . import aux_kernels
from .decode import FusedDecodeSm90
from .grouped_gemm import EPI_PLAIN, GroupedGemmSm90


class Sm90MegaMoEBf16Kernel:
    """Compile-time knobs of the BF16 MoE kernel (world size 1).

    :param activation: one of ``common.constants.ACTIVATIONS``.
    :param limit: clamp limit for swiglu (DeepSeek-V4 style) or swiglu_oai (default 7.0); None = off.
    :param tile_m: rows per M tile (64, 128 or 256); each expert's rows are padded to a multiple of it.
    :param fc1_tile_n: FC1 N tile over the interleaved w13 rows (the activation output tile is half
        as wide for gated activations). w13 must be preprocessed with
        ``weights.interleave_gate_up(w13, fc1_tile_n)`` for gated activations.
    :param fc2_tile_n: FC2 N tile (over H).
    :param num_sms: persistent grid size of the GEMMs (132 on H200).
    :param fc1_stages, fc2_stages: TMA pipeline depths (None: as many as shared memory allows).
    :param use_pdl: launch with programmatic dependent launch (each kernel's prologue overlaps the
        previous kernel's tail; every kernel waits on ``griddepcontrol.wait`` before its reads).
    :param epi_direct: GEMM epilogues store registers straight to global memory (True) or go
        through shared memory and TMA stores (False, default: measured faster on H200).
    :param aux_vpt: 16-byte vectors per thread item in the gather and combine kernels (H must be
        a multiple of 8 * aux_vpt).
    :param cluster_m: 1, or 2 for clusters of 2 CTAs along M sharing each weight tile through TMA
        multicast when their two M blocks belong to one expert (pass the same value to the
        workspace spec: the block count is rounded up to a multiple of it).
    :param pair_by_expert: with ``cluster_m=2``, which two M blocks a cluster takes. False: blocks
        2g and 2g+1 of the expert-major order (a pair straddles two experts whenever an expert's
        blocks start at an odd index). True: the routing writes a pair table: when the non-empty
        experts have at most two M blocks on average, every expert's blocks in pairs (they share
        weight tiles) and its odd last block with the next expert's odd last block (unshared),
        groups in expert order; with more blocks per expert, blocks 2g and 2g+1. None (default):
        True with ``cluster_m=2``. Measured on H200 (TUNING.md, drops v6-v7): deepseek-v3 T=4096
        5-8 % faster than 2g/2g+1; expert pairs at many blocks per expert (deepseek-v3 T=16384) were
        4-5 % slower, hence the switch.
    :param mma_overlap: the grouped GEMMs keep one WGMMA batch in flight while the next K tile's is issued
        (``GroupedGemmSm90(mma_overlap=...)``); False waits for each batch first, which drops up to v46 did in
        effect (ptxas closed every batch with an empty one). Measured (TUNING.md, session 35).
    :param fc1_tiled: w13 comes tiled (``weights.tile_weights(w13, fc1_tile_n, TILE_K)`` after the
        gate/up interleave, 5-D): each FC1 weight tile is one contiguous block of memory.
    :param gather_in_fc1: FC1 loads its A rows from ``x`` itself (``GroupedGemmSm90(gather_a=True)``)
        instead of from a gathered copy in ``a_buf``: the gather kernel's copy (T * top_k rows written,
        then read back) becomes a row map of 8 bytes per pair. Measured on H200 (TUNING.md, drop v18):
        2-9 % faster at T <= 1024 and on qwen3 prefill, within 1-2.5 % slower on deepseek-v3 prefill.
    :param sized_grids: the routing, row-map / gather and combine grids sized to the work (one CTA per
        128 pairs, 256 pairs, 256 thread items; at most num_sms, 8 * num_sms, 8 * num_sms CTAs) instead
        of always the largest. Measured on H200 (TUNING.md, drop v19): at T = 1 the full aux grids do
        not fit beside the routing CTAs, which holds back every later launch; sized, the qwen3-30b-a3b
        decode chain is 1.8-5 us shorter in graphs at T = 1..8 and even at prefill. False: drop v18.
    :param fc1_split_n: FC1 computes N tiles of ``fc1_tile_n / 2`` over the same weight layout (gate/up
        interleaved and tiled per ``fc1_tile_n``; ``GroupedGemmSm90(split_n=True)``): twice the FC1
        CTAs where few experts are touched. Gated activations, ``fc1_tile_n=256`` and ``cluster_m=1``
        only. Measured on H200 (TUNING.md, session 12 run 13): qwen3-30b-a3b T = 1 8 % faster
        (48 -> 96 FC1 CTAs), 1-3 % slower from T = 2 and on deepseek-v3 (already 128 FC1 CTAs at T = 1).
    :param route_maps_rows: with ``gather_in_fc1``, a routing grid of one CTA (T * K <= 128, sized grids)
        also writes the row map, and the row-map kernel is not launched: four kernels instead of five
        (drop v21). False: drop v20's chain, for A/B runs.
    :param fc2_early_weights: FC2 issues its first tile's weight loads before waiting for FC1
        (``GroupedGemmSm90(early_b=True)``), so CTAs launched beside FC1's tail stream weights then; FC1
        then lets FC2 launch only once its own wait for the routing has returned (FC2 reads the block
        map before its wait). Applies with ``cluster_m=1`` and PDL (no effect otherwise: a cluster's
        multicast B loads depend on the partner's block). Measured on H200 (TUNING.md, drop v34):
        0-3.6 % faster at T = 1 to 1024 on the three bench contracts, outputs bitwise equal.
    :param decode_fused: the whole layer in one launch, ``decode.FusedDecodeSm90`` (routing in every CTA,
        FC1 and FC2 as GEMVs, a grid barrier between them, the combine fused into FC2); for a few tokens
        (``T * top_k <= decode.DECODE_MAX_PAIRS``, which the caller must keep: past it the kernel writes
        nothing). Needs ``num_sms`` CTAs co-resident (at most the device's SM count) and ``meta[2:4]`` zero
        on entry (left zero). The other knobs then only shape the unused chain (``fc1_tile_n`` and
        ``fc1_tiled`` still give w13's layout). Measured on H200 (TUNING.md, session 26, drops v39-v40):
        per layer in CUDA graphs even with the chain at T = 1-4 on the bench contracts (0.96-1.06x),
        1.1-1.2x its time at T = 16, eager calls back to back even or faster (one launch instead of four),
        so no default turns it on.
    :param decode_warps, decode_stages, decode_k_warps: the fused kernel's warps per CTA (8, 16), ring depth
        per warp and warps splitting the K steps of one FC1 unit (1, 2, 4, 8, 16, at most ``decode_warps``;
        None: all of the CTA's).
    :param pair_blocks: no routing kernel: M block b is pair b of ``topk_ids`` (its expert, one real row),
        FC1 reads the pair's token row and the combine row ``b * tile_m`` (``GroupedGemmSm90.pair_blocks``).
        Every pair then reads its expert's weights alone, so it is meant for one token; the caller must keep
        ``T * top_k <= num_experts`` (the workspace's rows). Needs ``gather_in_fc1`` and ``cluster_m=1``.
        Session 29: outputs bitwise the chain's, 0.94-0.98x its time at T = 1 on the three bench contracts.
    :param pair_combine: with ``pair_blocks``, FC2 does the combine and the combine kernel is not launched: the
        warp holding a pair's row stores it (bf16) to y, counts itself in at the (token, N tile)'s counter in
        ``expert_count[E + 1:]`` (``host_utils.pair_combine_counters``; zero on entry, zeroed again), and the
        last of the token's ``top_k`` arrivals sums the rows in k order as the combine kernel does (the same
        bits; deterministic whichever CTA is last).
    :param stage_mask: debugging/profiling only: bit i enables stage i (routing, gather, FC1,
        FC2, combine); anything but 0b11111 gives wrong results (and masking out routing leaves
        ``expert_count`` non-zero).

    Measured on H200 (swiglu, qwen3/deepseek shapes): ``tile_m=128, fc1_tile_n=256,
    fc2_tile_n=256`` is fastest from about T*K >= 16*E tokens-pairs on (prefill);
    ``tile_m=64, fc1_tile_n=128, fc2_tile_n=128`` below that (decode). One library per knob set.
    """

    def __init__(
        self,
        activation: str = constants.ACT_SWIGLU,
        limit: float | None = None,
        tile_m: int = 128,
        fc1_tile_n: int = 128,
        fc2_tile_n: int = 128,
        num_sms: int = constants.DEFAULT_NUM_SMS,
        fc1_stages: int | None = None,
        fc2_stages: int | None = None,
        use_pdl: bool = True,
        epi_direct: bool = False,
        aux_vpt: int = 4,
        cluster_m: int = 1,
        pair_by_expert: bool | None = None,
        fc1_tiled: bool = False,
        gather_in_fc1: bool = True,
        stage_mask: int = 0b11111,
        sized_grids: bool = True,
        fc1_split_n: bool = False,
        route_maps_rows: bool = True,
        fc2_early_weights: bool = True,
        decode_fused: bool = False,
        decode_warps: int = 16,
        decode_stages: int = 4,
        decode_k_warps: int | None = None,
        pair_blocks: bool = False,
        pair_combine: bool = False,
        mma_overlap: bool = True,
    ) -> None:
        early = fc2_early_weights and cluster_m == 1 and use_pdl
        if pair_blocks and not (gather_in_fc1 and cluster_m == 1):
            raise ValueError("pair_blocks needs gather_in_fc1 and cluster_m=1")
        if pair_combine and not pair_blocks:
            raise ValueError("pair_combine needs pair_blocks")
        self.pair_blocks = pair_blocks
        self.pair_combine = pair_combine
        self.sized_grids = sized_grids
        self.route_maps_rows = route_maps_rows
        if activation not in constants.ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}")
        self.activation = activation
        self.limit = limit
        self.tile_m = tile_m
        self.num_sms = num_sms
        self.aux_threads = 256
        self.aux_grid = num_sms * 8
        self.use_pdl = use_pdl
        self.aux_vpt = aux_vpt
        self.cluster_m = cluster_m
        if pair_by_expert is None:
            pair_by_expert = cluster_m == 2
        if pair_by_expert and cluster_m != 2:
            raise ValueError("pair_by_expert needs cluster_m=2")
        self.pair_by_expert = pair_by_expert
        self.stage_mask = stage_mask
        self.fc1_tiled = fc1_tiled
        self.gather_in_fc1 = gather_in_fc1
        if fc1_split_n and fc1_tile_n != 256:
            raise ValueError(f"fc1_split_n needs fc1_tile_n=256, got {fc1_tile_n}")
        self.fc1_split_n = fc1_split_n
        self.fc1 = GroupedGemmSm90(
            tile_m,
            fc1_tile_n // 2 if fc1_split_n else fc1_tile_n,
            activation,
            limit,
            num_sms,
            fc1_stages,
            epi_direct,
            cluster_m,
            pair_by_expert,
            gather_a=gather_in_fc1,
            split_n=fc1_split_n,
            trigger_after_wait=early,
            pair_blocks=pair_blocks,
            mma_overlap=mma_overlap,
        )
        # decode_fused: the whole layer is this one kernel (the GEMMs above then only give w13's layout)
        self.decode = (
            FusedDecodeSm90(
                activation, limit, num_sms, fc1_tile_n, fc1_tiled, decode_warps, decode_stages, decode_k_warps
            )
            if decode_fused
            else None
        )
        self.fc2 = GroupedGemmSm90(
            tile_m, fc2_tile_n, EPI_PLAIN, None, num_sms, fc2_stages, epi_direct, cluster_m, pair_by_expert,
            early_b=early, pair_blocks=pair_blocks, pair_combine=pair_combine, mma_overlap=mma_overlap,
        )  # fmt: skip

    @staticmethod
    def _expert_major_view(w: cute.Tensor) -> cute.Tensor:
        # torch [E, N, K] (K contiguous) -> cute (N, K, E): the expert becomes the batch mode.
        return cute.make_tensor(w.iterator, cute.select(w.layout, mode=[1, 2, 0]))

    @staticmethod
    def _tiled_expert_major_view(w: cute.Tensor) -> cute.Tensor:
        # torch [E, N/tn, K/tk, tn, tk] (weights.tile_weights) -> cute ((tn, N/tn), (tk, K/tk), E): the
        # same (N, K, E) coordinates as _expert_major_view, each (tn, tk) tile contiguous.
        e, nt, kt, tn, tk = (cute.size(w, mode=[i]) for i in range(5))
        tile = tn * tk
        layout = cute.make_layout(((tn, nt), (tk, kt), e), stride=((tk, kt * tile), (1, tile), nt * kt * tile))
        return cute.make_tensor(w.iterator, layout)

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # [T, H] bf16
        topk_ids: cute.Tensor,  # [T, K] int32
        topk_weights: cute.Tensor,  # [T, K] fp32
        w13: cute.Tensor,  # [E, 2I, H] bf16, gate/up interleaved per fc1_tile_n ([E, I, H] relu2)
        w2: cute.Tensor,  # [E, H, I] bf16
        out: cute.Tensor,  # [T, H] bf16
        pair_row: cute.Tensor,  # workspace, see host_utils.moe_bf16_workspace_spec
        pair_rank: cute.Tensor,
        expert_count: cute.Tensor,
        cta_base: cute.Tensor,
        expert_off: cute.Tensor,
        m_block_expert: cute.Tensor,
        meta: cute.Tensor,
        a_buf: cute.Tensor,
        h_buf: cute.Tensor,
        stream,
    ):
        num_experts = w13.shape[0]
        pdl = self.use_pdl
        if cutlass.const_expr(self.decode is not None):
            self.decode.launch(x, topk_ids, topk_weights, w13, w2, out, h_buf, meta, stream, pdl)
            return
        num_tokens, top_k = topk_ids.shape[0], topk_ids.shape[1]
        num_pairs = num_tokens * top_k
        # Grids of the routing, row-map / gather and combine kernels (see aux_kernels.launch_ctas).
        route_ctas, map_ctas, combine_ctas = self.num_sms, self.aux_grid, self.aux_grid
        if cutlass.const_expr(self.sized_grids):
            items = num_tokens * (x.shape[1] // (constants.BF16_PER_16B * self.aux_vpt))  # gather / combine
            route_ctas = aux_kernels.launch_ctas(num_pairs, aux_kernels.ROUTE_PAIRS_PER_CTA, self.num_sms)
            map_ctas = aux_kernels.launch_ctas(
                num_pairs if self.gather_in_fc1 else items, self.aux_threads, self.aux_grid
            )
            combine_ctas = aux_kernels.launch_ctas(items, self.aux_threads, self.aux_grid)
        # The row -> token map lives in a_buf until FC2 writes y there (FC2 starts after FC1 ends).
        row_token = cute.make_tensor(
            cute.recast_ptr(a_buf.iterator, dtype=cutlass.Int32), cute.make_layout(a_buf.shape[0])
        )
        # A single routing CTA writes the row map itself (route_maps_rows): no row-map launch then.
        map_in_routing = self.gather_in_fc1 and self.route_maps_rows and self.stage_mask & 3 == 3
        routed = not self.pair_blocks  # pair_blocks: the GEMMs read topk_ids themselves
        if cutlass.const_expr(self.stage_mask & 1 and routed):
            aux_kernels.route_kernel(
                topk_ids,
                pair_rank,
                expert_count,
                cta_base,
                expert_off,
                m_block_expert,
                meta,
                pair_row,
                row_token,
                num_experts,
                self.tile_m,
                self.cluster_m,
                self.pair_by_expert,
                map_in_routing,
            ).launch(
                grid=[route_ctas, 1, 1],
                block=[constants.ROUTING_THREADS, 1, 1],
                stream=stream,
                use_pdl=pdl,
            )
        if cutlass.const_expr(self.stage_mask & 2 and routed):
            if cutlass.const_expr(self.gather_in_fc1):
                launch_map = True
                if cutlass.const_expr(map_in_routing):
                    launch_map = route_ctas > 1  # a run-time test: the routing grid follows T
                if launch_map:
                    aux_kernels.row_map_kernel(
                        topk_ids, pair_rank, expert_off, cta_base, pair_row, row_token, route_ctas
                    ).launch(
                        grid=[map_ctas, 1, 1],
                        block=[self.aux_threads, 1, 1],
                        stream=stream,
                        use_pdl=pdl,
                    )
            else:
                aux_kernels.gather_kernel(
                    x, topk_ids, pair_rank, expert_off, cta_base, pair_row, a_buf, route_ctas, self.aux_vpt
                ).launch(
                    grid=[map_ctas, 1, 1],
                    block=[self.aux_threads, 1, 1],
                    stream=stream,
                    use_pdl=pdl,
                )
        if cutlass.const_expr(self.stage_mask & 4):
            w13_view = self._tiled_expert_major_view(w13) if self.fc1_tiled else self._expert_major_view(w13)
            self.fc1.launch(
                a_buf, w13_view, h_buf, m_block_expert, meta, stream, pdl, x=x, row_token=row_token, topk_ids=topk_ids
            )
        if cutlass.const_expr(self.stage_mask & 8):
            self.fc2.launch(
                h_buf, self._expert_major_view(w2), a_buf, m_block_expert, meta, stream, pdl, topk_ids=topk_ids,
                out=out, topk_weights=topk_weights, counters=expert_count,
            )  # fmt: skip
        if cutlass.const_expr(self.stage_mask & 16 and not self.pair_combine):
            pair_rows = self.tile_m if self.pair_blocks else 0
            aux_kernels.combine_kernel(
                a_buf, pair_row, topk_weights, out, topk_ids.shape[1], self.aux_vpt, pair_rows
            ).launch(
                grid=[combine_ctas, 1, 1],
                block=[self.aux_threads, 1, 1],
                stream=stream,
                use_pdl=pdl,
            )
