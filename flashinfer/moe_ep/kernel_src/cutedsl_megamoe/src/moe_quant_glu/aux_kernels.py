"""The gathers of the quantized kernel: rows of the pairs, with the activation quantized on the way
(BF16 inputs) or dequantized (pre-quantized inputs); or, when FC1 gathers its own rows, each token's
row once plus the row map.

Routing and combine are the BF16 kernel's (``moe_bf16_glu.aux_kernels``); only the gather differs:
every 32 consecutive hidden elements of a token (an item: MXFP8 one block, NVFP4 two blocks) are
quantized-dequantized (``quant_gather_kernel``; NVFP4 with the static global scale ``act_gscale[0]``)
or dequantized from the given codes and block scales (``dequant_gather_kernel``) and written as
exact BF16 to the token's K rows of ``a_buf``. The NVFP4 global scale is left to the GEMMs (applied
to their fp32 accumulators) either way.

With ``per_token`` (FC1 gathers its rows, ``swap_gemm`` ``gather_b``) the item goes once to the
token's row of ``x_rows`` instead, and item 0 writes the row map: ``pair_row`` and, for each pair's
row, its token in ``row_token``. A prefill of T tokens then writes T rows, not T * K (qwen3-30b-a3b
T = 4096: 16 MB instead of 134 MB), and FC1 reads them where they sit in L2.

An item takes ``LANES`` = 8 lanes of a warp, 4 elements each: the block amax meets over the block's
lanes by shuffles, lane j looks up the rows of pairs j, j + 8, ... and shuffles them to the others, and
every lane stores its 8 bytes to each of the K rows (8 lanes: 64 contiguous bytes). One thread per item
(drop v21 and before) left a decode-sized batch with a few CTAs, each thread a chain of loads, 32
conversions and 32 stores: 9.5 us at T = 16 on qwen3-30b-a3b (Nsight Compute, TUNING.md session 14).
With ``per_token`` there is one row to store, so an item takes ``TOKEN_LANES`` = 4 lanes of 8 elements
(16-byte loads and stores).

The expert-parallel kernel (``ep_kernel``) prepares the rows on the source rank instead:
``quant_rows_kernel`` writes every live token's row, quantized-dequantized or dequantized the same
way, into the rank's symmetric ``x_sym`` once; the EP dispatch then moves exact BF16 rows.
"""

import cutlass
import cutlass.cute as cute

from ..common import constants
from ..moe_bf16_glu.aux_kernels import item_grid, wait_for_routing
from ..moe_bf16_glu.ep_kernels import aborted, live_count
from ..src import block_quant as bq

ITEM = 32  # hidden elements per item: one MXFP8 block, two NVFP4 blocks
LANES = 8  # lanes per item in the world-size-1 gathers to the pair rows
PER_LANE = ITEM // LANES  # hidden elements per lane
TOKEN_LANES = 4  # lanes per item with per_token: one row to store, so 16-byte loads and stores


def item_lanes(per_token: bool) -> int:
    """Lanes per item of a world-size-1 gather (``gather_threads``)."""
    return TOKEN_LANES if per_token else LANES


@cute.kernel
def quant_gather_kernel(
    x: cute.Tensor,  # (T, H) bf16
    topk_ids: cute.Tensor,  # (T, K) int32
    pair_rank: cute.Tensor,
    expert_off: cute.Tensor,
    cta_base: cute.Tensor,
    pair_row: cute.Tensor,  # out: final row of each pair
    a_buf: cute.Tensor,  # out: (M_cap, H) bf16, the rows of the pairs; with per_token, (T, H) the token rows
    act_gscale: cute.Tensor,  # (2,) fp32: NVFP4 global scales of x and of the FC2 input
    num_route_ctas: cutlass.Int32,  # the routing kernel's grid (its chunking)
    row_token: cute.Tensor,  # out with per_token: (M_cap,) int32, the token of each pair's row
    fmt: cutlass.Constexpr[str],
    per_token: cutlass.Constexpr[bool],
    trigger_after_wait: cutlass.Constexpr[bool] = False,
    early_rows: cutlass.Constexpr[bool] = False,
):
    """The grid covers ``item_lanes(per_token)`` threads per item (``gather_threads``). ``early_rows``:
    each warp loads and quantizes its first item before it waits for the routing (the routing kernel
    must trigger after its own wait, so ``x`` is complete); only the stores need the routing."""
    num_tokens = x.shape[0]
    top_k = topk_ids.shape[1]
    nitem = x.shape[1] // ITEM
    first, stride, chunk = item_grid(num_tokens, top_k, num_route_ctas, trigger_after_wait, wait=not early_rows)
    lanes = item_lanes(per_token)
    per_lane = ITEM // lanes
    lane = cute.arch.lane_idx()
    j = lane % lanes
    frag = cute.make_rmem_tensor((1, per_lane), x.element_type)
    vals = cute.make_rmem_tensor((1, per_lane), cutlass.Float32)
    qfrag = cute.make_rmem_tensor((1, per_lane), x.element_type)
    gs = None  # the NVFP4 per-tensor constants
    if cutlass.const_expr(fmt == constants.FMT_NVFP4):
        gs = bq.nvfp4_global(act_gscale[0])
    slots = num_tokens * nitem * lanes
    first_base = first - lane  # warp-uniform
    if cutlass.const_expr(early_rows):
        if first_base < slots:
            qdq_slot(x, cutlass.min(first_base + lane, slots - 1), nitem, lanes, j, frag, vals, qfrag, fmt, gs)
        wait_for_routing(trigger_after_wait)
    # Warp-uniform trip count (the shuffles need every lane); lanes past the end redo the last slot and store nothing.
    for base in cutlass.range(first_base, slots, stride):
        slot = cutlass.min(base + lane, slots - 1)
        t = slot // (nitem * lanes)
        g = slot // lanes - t * nitem
        if cutlass.const_expr(early_rows):
            if base != first_base:  # the first item is in qfrag already
                qdq_slot(x, slot, nitem, lanes, j, frag, vals, qfrag, fmt, gs)
        else:
            qdq_slot(x, slot, nitem, lanes, j, frag, vals, qfrag, fmt, gs)
        _store_lane(
            qfrag, t, g, j, lane - j, base + lane < slots, topk_ids, pair_rank, expert_off, cta_base, pair_row, a_buf,
            chunk, row_token, per_token,
        )  # fmt: skip


@cute.jit
def qdq_slot(x, slot, nitem, lanes: cutlass.Constexpr, j, frag, vals, qfrag, fmt: cutlass.Constexpr, gs) -> None:
    """Lane ``j``'s part of the item in ``slot`` of ``quant_gather_kernel``, quantized-dequantized into ``qfrag``
    (the block amax over the item's lanes: every lane of the warp takes part)."""
    per_lane = ITEM // lanes
    t = slot // (nitem * lanes)
    g = slot // lanes - t * nitem
    cute.autovec_copy(cute.local_tile(x, (1, per_lane), (t, g * lanes + j)), frag)
    vals.store(frag.load().to(cutlass.Float32))
    v = [vals[0, i] for i in range(per_lane)]
    if cutlass.const_expr(fmt == constants.FMT_MXFP8):
        q = bq.mxfp8_qdq(v, _lanes_amax(bq.block_amax(v), ITEM // per_lane))
    else:
        q = bq.nvfp4_qdq(v, _lanes_amax(bq.block_amax(v), constants.QUANT_BLOCK[fmt] // per_lane), gs)
    for i in cutlass.range_constexpr(per_lane):
        vals[0, i] = q[i]
    qfrag.store(vals.load().to(x.element_type))


@cute.kernel
def dequant_gather_kernel(
    xq: cute.Tensor,  # (T, H) uint8 E4M3 codes (MXFP8) or (T, H/2) uint8 E2M1 pairs (NVFP4)
    x_scale: cute.Tensor,  # (T, H/32) uint8 UE8M0 (MXFP8) or (T, H/16) uint8 E4M3 (NVFP4)
    topk_ids: cute.Tensor,  # (T, K) int32
    pair_rank: cute.Tensor,
    expert_off: cute.Tensor,
    cta_base: cute.Tensor,
    pair_row: cute.Tensor,  # out: final row of each pair
    a_buf: cute.Tensor,  # out: as quant_gather_kernel's
    num_route_ctas: cutlass.Int32,  # the routing kernel's grid (its chunking)
    row_token: cute.Tensor,  # out with per_token: as quant_gather_kernel's
    fmt: cutlass.Constexpr[str],
    per_token: cutlass.Constexpr[bool],
    trigger_after_wait: cutlass.Constexpr[bool] = False,
    early_rows: cutlass.Constexpr[bool] = False,
):
    """Pre-quantized activations: each item of 32 elements dequantized exactly (MXFP8 ``e4m3 *
    2**(s - 127)``, NVFP4 ``e2m1 * block scale``) and written to the token's K rows, with no
    requantization, so the GEMMs see the given values whatever rule chose their scales. ``early_rows``
    as ``quant_gather_kernel``'s."""
    num_tokens = xq.shape[0]
    top_k = topk_ids.shape[1]
    block = constants.QUANT_BLOCK[fmt]
    nitem = x_scale.shape[1] // (ITEM // block)
    first, stride, chunk = item_grid(num_tokens, top_k, num_route_ctas, trigger_after_wait, wait=not early_rows)
    lanes = item_lanes(per_token)
    per_lane = ITEM // lanes
    lane = cute.arch.lane_idx()
    j = lane % lanes
    lane_bytes = item_bytes(fmt) // lanes  # 8 lanes: MXFP8 4 codes, NVFP4 2 bytes of E2M1 pairs
    raw = cute.make_rmem_tensor((1, lane_bytes), cutlass.Uint8)
    vals = cute.make_rmem_tensor((1, per_lane), cutlass.Float32)
    qfrag = cute.make_rmem_tensor((1, per_lane), a_buf.element_type)
    slots = num_tokens * nitem * lanes
    first_base = first - lane  # warp-uniform
    if cutlass.const_expr(early_rows):
        if first_base < slots:
            slot0 = cutlass.min(first_base + lane, slots - 1)
            dequant_slot(xq, x_scale, slot0, nitem, lanes, j, lane_bytes, raw, vals, qfrag, fmt)
        wait_for_routing(trigger_after_wait)
    for base in cutlass.range(first_base, slots, stride):  # warp-uniform, as in quant_gather_kernel
        slot = cutlass.min(base + lane, slots - 1)
        t = slot // (nitem * lanes)
        g = slot // lanes - t * nitem
        if cutlass.const_expr(early_rows):
            if base != first_base:  # the first item is in qfrag already
                dequant_slot(xq, x_scale, slot, nitem, lanes, j, lane_bytes, raw, vals, qfrag, fmt)
        else:
            dequant_slot(xq, x_scale, slot, nitem, lanes, j, lane_bytes, raw, vals, qfrag, fmt)
        _store_lane(
            qfrag, t, g, j, lane - j, base + lane < slots, topk_ids, pair_rank, expert_off, cta_base, pair_row, a_buf,
            chunk, row_token, per_token,
        )  # fmt: skip


@cute.jit
def dequant_slot(
    xq,
    x_scale,
    slot,
    nitem,
    lanes: cutlass.Constexpr,
    j,
    lane_bytes: cutlass.Constexpr,
    raw,
    vals,
    qfrag,
    fmt: cutlass.Constexpr,
) -> None:
    """Lane ``j``'s part of the item in ``slot`` of ``dequant_gather_kernel``, dequantized into ``qfrag``."""
    block = constants.QUANT_BLOCK[fmt]
    per_lane = ITEM // lanes
    t = slot // (nitem * lanes)
    g = slot // lanes - t * nitem
    cute.autovec_copy(cute.local_tile(xq, (1, lane_bytes), (t, g * lanes + j)), raw)
    scale_byte = cutlass.Uint32(x_scale[t, g * (ITEM // block) + j * per_lane // block])
    _dequant_codes(raw, 0, lane_bytes, scale_byte, vals, fmt)
    qfrag.store(vals.load().to(qfrag.element_type))


@cute.kernel
def quant_rows_kernel(
    x: cute.Tensor,  # (T, H) bf16, or with ``prequantized`` the codes (as ``dequant_gather_kernel``)
    x_scale: cute.Tensor,  # with ``prequantized`` the block scales, else not read
    live_tokens: cute.Tensor,  # (1,) int32: rows of x to prepare (clamped to T)
    x_sym: cute.Tensor,  # (T_cap, H) bf16, symmetric: receives the rows (the EP dispatch moves them)
    act_gscale: cute.Tensor,  # (2,) fp32: NVFP4 global scales of x and of the FC2 input
    abort: cute.Tensor,  # (4,) int32: the EP abort word
    fmt: cutlass.Constexpr[str],
    prequantized: cutlass.Constexpr[bool],
):
    """EP source side: every live token's row as exact BF16 into ``x_sym``, item by item (32
    elements): quantized-dequantized from BF16 ``x`` (``quant_gather_kernel``'s rule) or dequantized
    from the given codes and scales (``dequant_gather_kernel``'s), so every owner's GEMMs see the
    values the world-size-1 kernel would."""
    vec = constants.BF16_PER_16B
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    nthr, _, _ = cute.arch.block_dim()
    if not aborted(abort):
        num_tokens = live_count(live_tokens, x.shape[0])
        nitem = x_sym.shape[1] // ITEM
        frag = cute.make_rmem_tensor((1, ITEM), x_sym.element_type)
        raw = cute.make_rmem_tensor((1, item_bytes(fmt)), cutlass.Uint8)
        vals = cute.make_rmem_tensor((1, ITEM), cutlass.Float32)
        qfrag = cute.make_rmem_tensor((1, ITEM), x_sym.element_type)
        gs = None  # the NVFP4 per-tensor constants
        if cutlass.const_expr(fmt == constants.FMT_NVFP4 and not prequantized):
            gs = bq.nvfp4_global(act_gscale[0])
        for item in cutlass.range(bid * nthr + tid, num_tokens * nitem, nblk * nthr):
            t = item // nitem
            g = item - t * nitem
            if cutlass.const_expr(prequantized):
                _dequant_item(x, x_scale, t, g, raw, vals, fmt)
            else:
                _qdq_item(x, t, g, frag, vals, fmt, gs)
            qfrag.store(vals.load().to(x_sym.element_type))
            for j in cutlass.range_constexpr(ITEM // vec):
                dst = cute.local_tile(x_sym, (1, vec), (t, g * (ITEM // vec) + j))
                cute.autovec_copy(cute.local_tile(qfrag, (1, vec), (0, j)), dst)


def gather_threads(num_tokens, hidden: int, per_token: bool = False):
    """Threads of a world-size-1 gather's grid: ``item_lanes(per_token)`` per item."""
    return num_tokens * (hidden // ITEM) * item_lanes(per_token)


def item_bytes(fmt: str) -> int:
    """Code bytes of one item: 32 E4M3 codes, or 16 bytes of E2M1 pairs."""
    return ITEM if fmt == constants.FMT_MXFP8 else ITEM // 2


def _qdq_item(x, t, g, frag, vals, fmt: str, gs) -> None:
    """Item ``g`` of BF16 row ``t`` of ``x``, quantized to ``fmt`` and dequantized, into ``vals``
    (fp32, exact in BF16): MXFP8 one UE8M0 block of 32, NVFP4 two E4M3-scaled blocks of 16 with the
    per-tensor constants ``gs`` (``bq.nvfp4_global``)."""
    vec = constants.BF16_PER_16B
    nvec = ITEM // vec
    for j in range(nvec):
        cute.autovec_copy(cute.local_tile(x, (1, vec), (t, g * nvec + j)), cute.local_tile(frag, (1, vec), (0, j)))
    vals.store(frag.load().to(cutlass.Float32))
    v = [vals[0, i] for i in range(ITEM)]
    if fmt == constants.FMT_MXFP8:
        q = bq.mxfp8_qdq(v, bq.block_amax(v))
    else:
        b = constants.QUANT_BLOCK[constants.FMT_NVFP4]
        q = []
        for s in range(0, ITEM, b):
            q.extend(bq.nvfp4_qdq(v[s : s + b], bq.block_amax(v[s : s + b]), gs))
    for i in range(ITEM):
        vals[0, i] = q[i]


def _dequant_item(xq, x_scale, t, g, raw, vals, fmt: str) -> None:
    """Item ``g`` of token ``t`` from its codes and block scales into ``vals`` (fp32, exact): MXFP8
    ``e4m3 * 2**(s - 127)``, NVFP4 ``e2m1 * e4m3 block scale`` (the global scale stays with the GEMMs)."""
    nraw = item_bytes(fmt) // 16
    for j in range(nraw):
        cute.autovec_copy(cute.local_tile(xq, (1, 16), (t, g * nraw + j)), cute.local_tile(raw, (1, 16), (0, j)))
    scales = ITEM // constants.QUANT_BLOCK[fmt]  # block scales per item: MXFP8 1, NVFP4 2
    per_scale = item_bytes(fmt) // scales  # code bytes under one scale
    for b in range(scales):
        _dequant_codes(raw, b * per_scale, per_scale, cutlass.Uint32(x_scale[t, g * scales + b]), vals, fmt)


def _dequant_codes(raw, first: int, nbytes: int, scale_byte, vals, fmt: str) -> None:
    """Code bytes ``raw[first : first + nbytes]``, all under the block scale ``scale_byte``, into ``vals`` from
    element ``first * (elements per byte)`` (fp32, exact): MXFP8 ``e4m3 * 2**(s - 127)`` (one code per
    byte), NVFP4 ``e2m1 * e4m3 scale`` (two codes per byte, the element of even index low). The one
    conversion of given codes: the world-size-1 gather (a lane's bytes) and the EP row preparation (an
    item's blocks)."""
    if fmt == constants.FMT_MXFP8:
        scale = bq.ue8m0_to_f32(scale_byte)
        for i in range(nbytes):
            vals[0, first + i] = bq.e4m3_to_f32(cutlass.Uint32(raw[0, first + i])) * scale
    else:
        scale = bq.e4m3_to_f32(scale_byte)
        for i in range(first, first + nbytes):
            byte = cutlass.Uint32(raw[0, i])
            vals[0, 2 * i] = bq.e2m1_to_f32(byte & cutlass.Uint32(0xF)) * scale
            vals[0, 2 * i + 1] = bq.e2m1_to_f32(byte >> 4) * scale


def _lanes_amax(m: cutlass.Float32, lanes: int) -> cutlass.Float32:
    """Max of ``m`` over the ``lanes`` (2, 4 or 8) lanes of an aligned lane group (butterfly shuffles)."""
    step = 1
    while step < lanes:
        m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, step))
        step *= 2
    return m


@cute.jit
def _store_lane(
    qfrag: cute.Tensor,
    t: cutlass.Int32,
    g: cutlass.Int32,
    j: cutlass.Int32,
    group0: cutlass.Int32,
    active: cutlass.Boolean,
    topk_ids: cute.Tensor,
    pair_rank: cute.Tensor,
    expert_off: cute.Tensor,
    cta_base: cute.Tensor,
    pair_row: cute.Tensor,
    a_buf: cute.Tensor,
    chunk: cutlass.Int32,
    row_token: cute.Tensor,
    per_token: cutlass.Constexpr[bool],
) -> None:
    """This lane's part of item ``g`` of token ``t``: to the token's K pair rows (``_write_lane_rows``) or,
    with ``per_token``, to the token's own row, lane j of item 0 also mapping pairs j, j + TOKEN_LANES, ...
    (``pair_row`` and ``row_token``)."""
    if cutlass.const_expr(per_token):
        if active:
            lanes = TOKEN_LANES
            cute.autovec_copy(qfrag, cute.local_tile(a_buf, (1, ITEM // lanes), (t, g * lanes + j)))
            if g == 0:
                top_k = topk_ids.shape[1]
                for r in cutlass.range_constexpr((top_k + lanes - 1) // lanes):
                    k = j + r * lanes
                    if k < top_k:
                        p = t * top_k + k
                        row = _pair_row(p, topk_ids[t, k], pair_rank, expert_off, cta_base, chunk)
                        pair_row[p] = row
                        row_token[row] = t
    else:
        _write_lane_rows(
            qfrag, t, g, j, group0, active, topk_ids, pair_rank, expert_off, cta_base, pair_row, a_buf, chunk
        )


def _pair_row(p, e, pair_rank: cute.Tensor, expert_off: cute.Tensor, cta_base: cute.Tensor, chunk):
    """The row of pair ``p`` (routed to expert ``e``) in the expert-major row space."""
    return expert_off[e] + cta_base[p // chunk, e] + pair_rank[p]


@cute.jit
def _write_lane_rows(
    qfrag: cute.Tensor,  # this lane's PER_LANE BF16 values of item g
    t: cutlass.Int32,
    g: cutlass.Int32,
    j: cutlass.Int32,  # this lane's place in the item's lane group
    group0: cutlass.Int32,  # the group's first lane
    active: cutlass.Boolean,
    topk_ids: cute.Tensor,
    pair_rank: cute.Tensor,
    expert_off: cute.Tensor,
    cta_base: cute.Tensor,
    pair_row: cute.Tensor,
    a_buf: cute.Tensor,
    chunk: cutlass.Int32,
) -> None:
    """This lane's part of item ``g`` of token ``t`` to the token's K rows of ``a_buf``: lane j of the group
    finds the rows of pairs j, j + LANES, ... and shuffles them to the group (item 0 also records them in
    ``pair_row``)."""
    top_k = topk_ids.shape[1]
    mine = []
    for r in cutlass.range_constexpr((top_k + LANES - 1) // LANES):
        k = cutlass.min(j + r * LANES, top_k - 1)  # lanes past K look up a valid pair, unused
        p = t * top_k + k
        mine.append(_pair_row(p, topk_ids[t, k], pair_rank, expert_off, cta_base, chunk))
    for k in cutlass.range_constexpr(top_k):
        row = cute.arch.shuffle_sync(mine[k // LANES], group0 + k % LANES)
        if active:
            cute.autovec_copy(qfrag, cute.local_tile(a_buf, (1, PER_LANE), (row, g * LANES + j)))
            if g == 0:
                if j == k % LANES:
                    pair_row[t * top_k + k] = row
