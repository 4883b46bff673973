"""``Sm90MegaMoEQuantEpKernel``: the expert-parallel MoE forward of one rank with MXFP8 or NVFP4
weights and activations (DRAFT).

The EP protocol of the BF16 EP kernel (``moe_bf16_glu.ep_kernel.EpProtocol``: route, dispatch,
combine, the same buffers and flags, ``moe_bf16_glu.ep_workspace``) around the block-scaled GEMMs of
the world-size-1 quantized kernel (``kernel.Sm90MegaMoEQuantKernel``):

====  =====================  =======================================================================
 0-3  route                  as BF16, without the x -> x_sym copy
 1b   quant_rows             every live row of x, quantized-dequantized (or dequantized from the
                             given codes and scales), as exact BF16 into the rank's ``x_sym``
 4-6  dispatch               as BF16 (pull reads ``x_sym``; push writes the rows of ``x_sym``)
 7/8  FC1 / FC2              ``DequantGroupedGemmSm90`` or, with ``swap_ab``, ``SwapDequantGemmSm90``
                             on the owner's rows: FC1 requantizes its output to the FC2 input format
 9-11 combine                as BF16: y from the owners (bf16 or the mxfp8 wire), weighted top-k sum
====  =====================  =======================================================================

So the dispatch moves BF16 rows whose values are exactly the quantized activations (2 bytes per
element on the wire; the scales are folded in) and every owner applies to each pair what the
world-size-1 kernel applies (the semantics of ``flashinfer.moe_ep.core.reference_quant``). GEMM
clusters are not used (``cluster_m`` 1).
"""

import cutlass
import cutlass.cute as cute

from ..common import constants
from ..moe_bf16_glu.ep_kernel import EpProtocol
from .aux_kernels import quant_rows_kernel
from .kernel import quant_gemms


class Sm90MegaMoEQuantEpKernel(EpProtocol):
    """Compile-time knobs: those of ``Sm90MegaMoEQuantKernel`` (fmt, activation, limit, tile_m,
    fc1/fc2_tile_n, num_sms, fc1/fc2_stages, use_pdl (GEMMs only), swap_ab, swap_wg, swap_atoms,
    swap_stagger, swap_narrow, prequantized) and of ``EpProtocol`` (world_size, ranks_per_gpu, dispatch, combine_dtype).
    Every grid has ``num_sms // ranks_per_gpu`` CTAs, the GEMMs' included."""

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
        swap_ab: bool = False,
        swap_wg: int = 2,
        prequantized: bool = False,
        world_size: int = 1,
        ranks_per_gpu: int = 1,
        dispatch: str = "pull",
        combine_dtype: str = "bf16",
        swap_atoms: int = 4,
        swap_stagger: int = 0,
        swap_narrow: bool = False,
    ) -> None:
        super().__init__(activation, tile_m, num_sms, world_size, ranks_per_gpu, 1, dispatch, use_pdl, combine_dtype)
        if fmt not in constants.QUANT_FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        if swap_ab and tile_m not in constants.SWAP_TOKEN_TILES:
            raise ValueError(f"with swap_ab, tile_m must be one of {constants.SWAP_TOKEN_TILES}, got {tile_m}")
        if not swap_ab and tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {tile_m}")
        self.fmt = fmt
        self.limit = limit
        self.swap_ab = swap_ab
        self.prequantized = prequantized
        self.fc1, self.fc2 = quant_gemms(
            fmt, tile_m, fc1_tile_n, fc2_tile_n, activation, limit, self.grid, fc1_stages, fc2_stages, swap_ab, swap_wg,
            swap_atoms=swap_atoms, swap_stagger=swap_stagger, swap_narrow=swap_narrow,
        )  # fmt: skip

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # [T, H] bf16, or with ``prequantized`` the codes (uint8)
        x_scale: cute.Tensor,  # with ``prequantized`` the block scales (uint8), else not read
        topk_ids: cute.Tensor,  # [T, K] int32, GLOBAL expert ids
        topk_weights: cute.Tensor,  # [T, K] fp32
        w13: cute.Tensor,  # [E_loc, H/64, N1, D] uint8 (weights.pack_quantized_weights, this rank's experts)
        w13_scale: cute.Tensor,  # [E_loc, H/64, N1, S] uint8
        w2: cute.Tensor,  # [E_loc, I/64, H, D] uint8
        w2_scale: cute.Tensor,  # [E_loc, I/64, H, S] uint8
        w13_gscale: cute.Tensor,  # [E_loc] fp32 (NVFP4; ones for MXFP8)
        w2_gscale: cute.Tensor,  # [E_loc] fp32
        act_gscale: cute.Tensor,  # [2] fp32: NVFP4 global scales of x and of the FC2 input
        out: cute.Tensor,  # [T, H] bf16 (rows >= the live count are left untouched)
        live_tokens: cute.Tensor,  # [1] int32
        # symmetric buffers, pointer tables and local workspace: as Sm90MegaMoEBf16EpKernel
        flags: cute.Tensor,
        x_sym: cute.Tensor,  # [T_cap, H] bf16: this rank's prepared rows
        send_list: cute.Tensor,
        expert_cnt: cute.Tensor,
        expert_start: cute.Tensor,
        row_base: cute.Tensor,
        a_buf: cute.Tensor,  # [M_cap, H] bf16 (dispatched rows, then y)
        flags_tab: cute.Tensor,
        x_tab: cute.Tensor,
        send_tab: cute.Tensor,
        cnt_tab: cute.Tensor,
        start_tab: cute.Tensor,
        row_base_tab: cute.Tensor,
        y_tab: cute.Tensor,
        cta_cnt: cute.Tensor,
        pair_pos: cute.Tensor,
        src_meta: cute.Tensor,
        m_block_expert: cute.Tensor,
        meta: cute.Tensor,
        h_buf: cute.Tensor,  # [M_cap, I] bf16 (FC1 output, exact in the FC2 input format)
        ep_state: cute.Tensor,
        abort: cute.Tensor,
        rank: cutlass.Int32,
        timeout_ns: cutlass.Int64,
        stream,
    ):
        local_experts = w13.shape[0]
        top_k = topk_ids.shape[1]
        self.route(x, topk_ids, live_tokens, x_sym, cta_cnt, pair_pos, send_list, expert_cnt, expert_start,
                   ep_state, abort, local_experts * self.world_size, False, stream)  # fmt: skip
        # 1b: the rows as the GEMMs take them, once per token (not per pair)
        quant_rows_kernel(x, x_scale, live_tokens, x_sym, act_gscale, abort, self.fmt, self.prequantized).launch(
            grid=[self.aux_grid, 1, 1], block=[self.aux_threads, 1, 1], stream=stream
        )
        # a push source writes the T rows of x_sym it prepared (x's row count bounds the live count)
        hidden = x_sym.shape[1]
        rows = cute.make_tensor(x_sym.iterator, cute.make_layout((topk_ids.shape[0], hidden), stride=(hidden, 1)))
        self.dispatch(rows, live_tokens, flags, x_sym, send_list, expert_start, row_base, a_buf,
                      flags_tab, x_tab, send_tab, cnt_tab, start_tab, row_base_tab, y_tab, src_meta, m_block_expert,
                      meta, ep_state, abort, rank, timeout_ns, local_experts, top_k, stream)  # fmt: skip
        # 7-8: the block-scaled GEMMs (meta[0] = 0 after an abort: no tiles)
        pdl = self.use_pdl
        self.fc1.launch(a_buf, w13, w13_scale, h_buf, m_block_expert, meta, w13_gscale, act_gscale, stream, pdl)
        self.fc2.launch(h_buf, w2, w2_scale, a_buf, m_block_expert, meta, w2_gscale, act_gscale, stream, pdl)
        self.combine(topk_ids, topk_weights, live_tokens, pair_pos, flags, flags_tab, row_base_tab, y_tab, out,
                     a_buf, meta, ep_state, abort, rank, timeout_ns, local_experts, stream)  # fmt: skip
