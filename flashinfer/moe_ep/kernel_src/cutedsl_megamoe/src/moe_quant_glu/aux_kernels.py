"""The gather of the quantized kernel: rows of the pairs, with the activation quantized on the way.

Routing and combine are the BF16 kernel's (``moe_bf16_glu.aux_kernels``); only the gather differs:
every 32 consecutive hidden elements of a token are quantized-dequantized (MXFP8: one block; NVFP4:
two blocks with the static global scale ``act_gscale[0]``) and written as exact BF16 to the token's
K rows of ``a_buf``.
"""

import cutlass
import cutlass.cute as cute

from ..common import constants
from ..moe_bf16_glu.aux_kernels import chunk_size
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
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    bdim, _, _ = cute.arch.block_dim()
    cute.arch.griddepcontrol_launch_dependents()
    cute.arch.griddepcontrol_wait()
    chunk = chunk_size(num_tokens * top_k, num_route_ctas)
    frag = cute.make_rmem_tensor((1, ITEM), x.element_type)
    vals = cute.make_rmem_tensor((1, ITEM), cutlass.Float32)
    qfrag = cute.make_rmem_tensor((1, ITEM), x.element_type)
    rows = cute.make_rmem_tensor((top_k,), cutlass.Int32)
    gs = cutlass.Float32(1.0)
    if cutlass.const_expr(fmt == constants.FMT_NVFP4):
        gs = act_gscale[0]
    for item in cutlass.range(bid * bdim + tid, num_tokens * nitem, nblk * bdim):
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
        for k in cutlass.range_constexpr(top_k):
            p = t * top_k + k
            e = topk_ids[t, k]
            rows[k] = expert_off[e] + cta_base[p // chunk, e] + pair_rank[p]
        for k in cutlass.range_constexpr(top_k):
            for j in cutlass.range_constexpr(nvec):
                cute.autovec_copy(
                    cute.local_tile(qfrag, (1, vec), (0, j)), cute.local_tile(a_buf, (1, vec), (rows[k], g * nvec + j))
                )
        if g == 0:
            for k in cutlass.range_constexpr(top_k):
                pair_row[t * top_k + k] = rows[k]
