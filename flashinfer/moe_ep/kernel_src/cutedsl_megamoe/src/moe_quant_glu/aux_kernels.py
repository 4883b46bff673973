"""The gathers of the quantized kernel: rows of the pairs, with the activation quantized on the way
(BF16 inputs) or dequantized (pre-quantized inputs).

Routing and combine are the BF16 kernel's (``moe_bf16_glu.aux_kernels``); only the gather differs:
every 32 consecutive hidden elements of a token (MXFP8: one block; NVFP4: two blocks) are
quantized-dequantized (``quant_gather_kernel``; NVFP4 with the static global scale ``act_gscale[0]``)
or dequantized from the given codes and block scales (``dequant_gather_kernel``) and written as
exact BF16 to the token's K rows of ``a_buf``. The NVFP4 global scale is left to the GEMMs (applied
to their fp32 accumulators) either way.
"""

import cutlass
import cutlass.cute as cute

from ..common import constants
from ..moe_bf16_glu.aux_kernels import item_grid
from ..src import block_quant as bq

ITEM = 32  # hidden elements per thread item: one MXFP8 block, two NVFP4 blocks


@cute.kernel
def quant_gather_kernel(
    x: cute.Tensor,  # (T, H) bf16
    topk_ids: cute.Tensor,  # (T, K) int32
    pair_rank: cute.Tensor,
    expert_off: cute.Tensor,
    cta_base: cute.Tensor,
    pair_row: cute.Tensor,  # out: final row of each pair
    a_buf: cute.Tensor,  # (M_cap, H) bf16: dequantized activations
    act_gscale: cute.Tensor,  # (2,) fp32: NVFP4 global scales of x and of the FC2 input
    num_route_ctas: cutlass.Constexpr[int],
    fmt: cutlass.Constexpr[str],
):
    vec = constants.BF16_PER_16B
    nvec = ITEM // vec
    hidden = x.shape[1]
    num_tokens = x.shape[0]
    top_k = topk_ids.shape[1]
    nitem = hidden // ITEM
    first, stride, chunk = item_grid(num_tokens, top_k, num_route_ctas)
    frag = cute.make_rmem_tensor((1, ITEM), x.element_type)
    vals = cute.make_rmem_tensor((1, ITEM), cutlass.Float32)
    qfrag = cute.make_rmem_tensor((1, ITEM), x.element_type)
    rows = cute.make_rmem_tensor((top_k,), cutlass.Int32)
    gs = cutlass.Float32(1.0)
    if cutlass.const_expr(fmt == constants.FMT_NVFP4):
        gs = act_gscale[0]
    for item in cutlass.range(first, num_tokens * nitem, stride):
        t = item // nitem
        g = item - t * nitem
        for j in cutlass.range_constexpr(nvec):
            cute.autovec_copy(cute.local_tile(x, (1, vec), (t, g * nvec + j)), cute.local_tile(frag, (1, vec), (0, j)))
        vals.store(frag.load().to(cutlass.Float32))
        v = [vals[0, i] for i in range(ITEM)]
        if cutlass.const_expr(fmt == constants.FMT_MXFP8):
            q = bq.mxfp8_qdq(v, bq.block_amax(v))
        else:
            b = constants.QUANT_BLOCK[constants.FMT_NVFP4]
            q = []
            for s in cutlass.range_constexpr(0, ITEM, b):
                q.extend(bq.nvfp4_qdq(v[s : s + b], bq.block_amax(v[s : s + b]), gs))
        for i in cutlass.range_constexpr(ITEM):
            vals[0, i] = q[i]
        qfrag.store(vals.load().to(x.element_type))
        _write_rows(qfrag, t, g, topk_ids, pair_rank, expert_off, cta_base, a_buf, rows, chunk)
        if g == 0:
            for k in cutlass.range_constexpr(top_k):
                pair_row[t * top_k + k] = rows[k]


@cute.kernel
def dequant_gather_kernel(
    xq: cute.Tensor,  # (T, H) uint8 E4M3 codes (MXFP8) or (T, H/2) uint8 E2M1 pairs (NVFP4)
    x_scale: cute.Tensor,  # (T, H/32) uint8 UE8M0 (MXFP8) or (T, H/16) uint8 E4M3 (NVFP4)
    topk_ids: cute.Tensor,  # (T, K) int32
    pair_rank: cute.Tensor,
    expert_off: cute.Tensor,
    cta_base: cute.Tensor,
    pair_row: cute.Tensor,  # out: final row of each pair
    a_buf: cute.Tensor,  # (M_cap, H) bf16: dequantized activations
    num_route_ctas: cutlass.Constexpr[int],
    fmt: cutlass.Constexpr[str],
):
    """Pre-quantized activations: each item of 32 elements dequantized exactly (MXFP8 ``e4m3 *
    2**(s - 127)``, NVFP4 ``e2m1 * block scale``) and written to the token's K rows, with no
    requantization, so the GEMMs see the given values whatever rule chose their scales."""
    num_tokens = xq.shape[0]
    top_k = topk_ids.shape[1]
    scales_per_item = ITEM // constants.QUANT_BLOCK[fmt]
    nitem = x_scale.shape[1] // scales_per_item
    item_bytes = ITEM if fmt == constants.FMT_MXFP8 else ITEM // 2
    nraw = item_bytes // 16
    first, stride, chunk = item_grid(num_tokens, top_k, num_route_ctas)
    raw = cute.make_rmem_tensor((1, item_bytes), cutlass.Uint8)
    vals = cute.make_rmem_tensor((1, ITEM), cutlass.Float32)
    qfrag = cute.make_rmem_tensor((1, ITEM), a_buf.element_type)
    rows = cute.make_rmem_tensor((top_k,), cutlass.Int32)
    for item in cutlass.range(first, num_tokens * nitem, stride):
        t = item // nitem
        g = item - t * nitem
        for j in cutlass.range_constexpr(nraw):
            cute.autovec_copy(cute.local_tile(xq, (1, 16), (t, g * nraw + j)), cute.local_tile(raw, (1, 16), (0, j)))
        if cutlass.const_expr(fmt == constants.FMT_MXFP8):
            scale = bq.ue8m0_to_f32(cutlass.Uint32(x_scale[t, g]))
            for i in cutlass.range_constexpr(ITEM):
                vals[0, i] = bq.e4m3_to_f32(cutlass.Uint32(raw[0, i])) * scale
        else:
            for b in cutlass.range_constexpr(scales_per_item):
                scale = bq.e4m3_to_f32(cutlass.Uint32(x_scale[t, g * scales_per_item + b]))
                for i in cutlass.range_constexpr(8):  # 8 bytes = the block's 16 codes, element 2i low
                    byte = cutlass.Uint32(raw[0, 8 * b + i])
                    vals[0, 16 * b + 2 * i] = bq.e2m1_to_f32(byte & cutlass.Uint32(0xF)) * scale
                    vals[0, 16 * b + 2 * i + 1] = bq.e2m1_to_f32(byte >> 4) * scale
        qfrag.store(vals.load().to(a_buf.element_type))
        _write_rows(qfrag, t, g, topk_ids, pair_rank, expert_off, cta_base, a_buf, rows, chunk)
        if g == 0:
            for k in cutlass.range_constexpr(top_k):
                pair_row[t * top_k + k] = rows[k]


def _write_rows(qfrag, t, g, topk_ids, pair_rank, expert_off, cta_base, a_buf, rows, chunk) -> None:
    """Item ``g`` (32 BF16 values in ``qfrag``) of token ``t`` to the token's K rows of ``a_buf``
    (their indices left in ``rows``)."""
    vec = constants.BF16_PER_16B
    top_k = topk_ids.shape[1]
    for k in range(top_k):
        p = t * top_k + k
        e = topk_ids[t, k]
        rows[k] = expert_off[e] + cta_base[p // chunk, e] + pair_rank[p]
    nvec = ITEM // vec
    for k in range(top_k):
        for j in range(nvec):
            cute.autovec_copy(
                cute.local_tile(qfrag, (1, vec), (0, j)), cute.local_tile(a_buf, (1, vec), (rows[k], g * nvec + j))
            )
