"""Routing, gather and combine kernels (the non-GEMM stages of the BF16 MoE).

Row space: every (token, k) pair gets one row of the permuted activation buffer. Rows are grouped
by expert (expert-major) and each expert's segment is padded to a multiple of ``tile_m``, so a
GEMM M tile never straddles two experts. Padding rows hold stale data: the GEMMs compute them
(rows are independent) and nothing reads their results.

Routing scales with T: ``route_kernel`` (one CTA per 128 pairs up to one per SM: smem histograms, one
global atomic per CTA and expert, the last CTA does the padded scan and the M-block map; a single CTA,
at T * K <= 128, scans its own histogram and can write the row map too) and ``gather_kernel``, which
turns each pair's in-CTA rank into its final row while it copies the token, or ``row_map_kernel``,
which only records the rows (pair -> row and row -> token) when FC1 gathers its own A rows.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ..common import constants

#: the pair table pairs M blocks by expert when the non-empty experts have at most this many blocks on
#: average (few blocks per expert: many pairs would straddle two experts), else adjacent blocks
PAIR_BY_EXPERT_MAX_BLOCKS = 2
#: pairs per routing CTA when the grid is sized to the pairs (``launch_ctas``): at most ``num_sms`` CTAs
ROUTE_PAIRS_PER_CTA = 128

# meta[] slots written by the routing kernel.
META_NUM_M_BLOCKS = 0
META_NUM_ROWS = 1
META_LEN = 4


@cute.kernel
def route_kernel(
    topk_ids: cute.Tensor,  # (T, K) int32
    pair_rank: cute.Tensor,  # (>= T*K,) int32 out: rank of the pair inside its CTA's chunk
    expert_count: cute.Tensor,  # (E + 1,) int32: counts, then the CTA done-counter; zero on entry
    cta_base: cute.Tensor,  # (G1, E) int32 out: this CTA's first slot inside each expert
    expert_off: cute.Tensor,  # (E,) int32 out: first (padded) row of each expert segment
    m_block_expert: cute.Tensor,  # (M_cap / tile_m,) int32 out: expert | real_rows << 16
    meta: cute.Tensor,  # (META_LEN,) int32 out
    pair_row: cute.Tensor | None,  # (>= T*K,) int32 out with ``map_rows`` on a grid of one CTA (else not touched)
    row_token: cute.Tensor | None,  # (>= M_cap,) int32 out likewise (both may be None without ``map_rows``)
    num_experts: cutlass.Constexpr[int],
    tile_m: cutlass.Constexpr[int],
    block_multiple: cutlass.Constexpr[int],
    pair_by_expert: cutlass.Constexpr[bool],
    map_rows: cutlass.Constexpr[bool],
    trigger_after_wait: cutlass.Constexpr[bool] = False,
):
    """Routing in one launch (grid G1 <= the rows of ``cta_base``, ROUTING_THREADS threads; the
    gathers take G1 as ``num_route_ctas``).

    Every CTA builds a smem histogram of a contiguous chunk of pairs (ranks from smem atomics) and
    reserves its slots in each expert segment with one global atomic per (CTA, expert). The last
    CTA to finish (done-counter) runs the padded exclusive scan over the experts, writes the
    M-block map and re-zeroes the counters for the next call. A grid of one CTA skips the global
    counters: its histogram is the counts (``expert_count`` stays zero); with ``map_rows`` it also
    writes what ``row_map_kernel`` would (``pair_row``, ``row_token``), so the caller launches no row
    map after a single routing CTA (drop v21: one kernel less in the decode chain at T * K <= 128).

    Slot order depends on atomic order; the GEMM result of a row does not depend on its position,
    so the final output stays bitwise deterministic.

    ``trigger_after_wait``: the next kernel launches only once this kernel's wait has returned, so it may
    read the layer's inputs (``x``) before its own wait (a gather with ``early_rows``).
    """
    nthr = constants.ROUTING_THREADS
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    if cutlass.const_expr(not trigger_after_wait):
        cute.arch.griddepcontrol_launch_dependents()
    # Under PDL the previous call's combine may still read pair_row: wait before any write.
    cute.arch.griddepcontrol_wait()
    if cutlass.const_expr(trigger_after_wait):
        cute.arch.griddepcontrol_launch_dependents()
    num_pairs = topk_ids.shape[0] * topk_ids.shape[1]
    chunk = chunk_size(num_pairs, nblk)
    smem = cutlass.utils.SmemAllocator()
    s_hist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(nthr), byte_alignment=16)
    s_flag = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), byte_alignment=16)
    s_hist[tid] = cutlass.Int32(0)
    cute.arch.sync_threads()
    ids_flat = cute.make_tensor(topk_ids.iterator, cute.make_layout(num_pairs))
    start = bid * chunk
    stop = cutlass.min(start + chunk, num_pairs)
    for p in cutlass.range(start + tid, stop, nthr):
        e = ids_flat[p]
        pair_rank[p] = cute.arch.atomic_add((s_hist.iterator + e).llvm_ptr, cutlass.Int32(1))
    cute.arch.sync_threads()
    if nblk == 1:
        # One CTA holds every pair (small T with a grid sized to the pairs): its histogram is the
        # expert counts, so no global reservations, done-counter or count reloads (three dependent
        # round trips to L2 on the path of every later kernel).
        cnt = cutlass.Int32(0)
        if tid < num_experts:
            cnt = s_hist[tid]
            if cnt > 0:
                cta_base[0, tid] = cutlass.Int32(0)
        _scan_experts(
            cnt, expert_off, m_block_expert, meta, s_hist, num_experts, tile_m, block_multiple, pair_by_expert
        )
        if cutlass.const_expr(map_rows):
            cute.arch.sync_threads()  # every expert's offset written (global writes, visible in the CTA)
            top_k = topk_ids.shape[1]
            for p in cutlass.range(tid, num_pairs, nthr):  # the pairs this thread ranked above
                row = expert_off[ids_flat[p]] + pair_rank[p]
                pair_row[p] = row
                row_token[row] = p // top_k
    else:
        if tid < num_experts:
            c = s_hist[tid]
            if c > 0:
                cta_base[bid, tid] = cute.arch.atomic_add(
                    (expert_count.iterator + tid).llvm_ptr, c, sem="relaxed", scope="gpu"
                )
        # Publish our reservations, then count this CTA as done; the last one does the scan.
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tid == 0:
            done = cute.arch.atomic_add(
                (expert_count.iterator + num_experts).llvm_ptr, cutlass.Int32(1), sem="acq_rel", scope="gpu"
            )
            s_flag[0] = done
        cute.arch.sync_threads()
        if s_flag[0] == nblk - 1:
            cute.arch.fence_acq_rel_gpu()
            cnt = cutlass.Int32(0)
            if tid < num_experts:
                cnt = cute.arch.load((expert_count.iterator + tid).llvm_ptr, cutlass.Int32, sem="relaxed", scope="gpu")
                expert_count[tid] = cutlass.Int32(0)
            if tid == 0:
                expert_count[num_experts] = cutlass.Int32(0)  # re-zeroed for the next call
            _scan_experts(
                cnt, expert_off, m_block_expert, meta, s_hist, num_experts, tile_m, block_multiple, pair_by_expert
            )


def launch_ctas(items, per_cta: int, max_ctas: int):
    """CTAs for a grid-stride kernel over ``items`` (dynamic): one per ``per_cta`` items, at least one (T = 0),
    at most ``max_ctas``. At small T the routing, row-map and combine grids shrink to a CTA or a few, so they
    are resident at once: a dependent launch waits until every CTA of its primary has started, and a full
    aux grid (8 per SM) next to the routing CTAs did not fit (measured, TUNING.md "Session 12")."""
    return cutlass.min(cutlass.max((items + (per_cta - 1)) // per_cta, 1), max_ctas)


def chunk_size(num_pairs, num_ctas):
    """Pairs per routing CTA (>= 1 so that T = 0 divides safely)."""
    return cutlass.max((num_pairs + num_ctas - 1) // num_ctas, 1)


@cute.jit
def _cta_inclusive_scan(v: cutlass.Int32, s_scan: cute.Tensor, tid: cutlass.Int32) -> cutlass.Int32:
    """Inclusive scan over the CTA (ROUTING_THREADS threads, all of them call it): warp shuffles, then
    the 32 warp totals by warp 0. ``s_scan`` (32 ints) may be reused after it returns."""
    lane = tid % 32
    warp = tid // 32
    for i in cutlass.range_constexpr(5):
        o = cute.arch.shuffle_sync_up(v, 1 << i)
        if lane >= (1 << i):
            v = v + o
    cute.arch.sync_threads()  # s_scan may alias data the caller read before
    if lane == 31:
        s_scan[warp] = v
    cute.arch.sync_threads()
    if warp == 0:
        w = s_scan[lane]
        for i in cutlass.range_constexpr(5):
            o = cute.arch.shuffle_sync_up(w, 1 << i)
            if lane >= (1 << i):
                w = w + o
        s_scan[lane] = w
    cute.arch.sync_threads()
    incl = v
    if warp > 0:
        incl = v + s_scan[warp - 1]
    cute.arch.sync_threads()
    return incl


@cute.jit
def _scan_experts(
    cnt: cutlass.Int32,  # this thread's expert's pair count (0 for threads >= num_experts)
    expert_off: cute.Tensor,
    m_block_expert: cute.Tensor,
    meta: cute.Tensor,
    s_scan: cute.Tensor,
    num_experts: cutlass.Constexpr[int],
    tile_m: cutlass.Constexpr[int],
    block_multiple: cutlass.Constexpr[int],
    pair_by_expert: cutlass.Constexpr[bool],
):
    """Padded exclusive scan over the experts (one per thread, its count ``cnt``) by the last routing CTA.

    With ``block_multiple = 2`` (GEMM clusters of two M blocks) an odd block count gets one
    phantom block after the last: expert 0, no real rows, so a cluster's second CTA reads a
    defined entry and skips its MMAs. With ``pair_by_expert`` the second half of
    ``m_block_expert`` receives the pair table (``_write_pair_table``).
    """
    nthr = constants.ROUTING_THREADS
    tid, _, _ = cute.arch.thread_idx()
    # Segments padded to tile_m: a GEMM M tile never straddles two experts.
    padded = (cnt + (tile_m - 1)) // tile_m * tile_m
    incl = _cta_inclusive_scan(padded, s_scan, tid)  # s_scan aliases the histogram, read above
    start = incl - padded
    if tid < num_experts:
        expert_off[tid] = start
        # Packed: expert in bits 0..15, real (non-padding) rows of the block in bits 16..31.
        first = start // tile_m
        for b in cutlass.range(first, incl // tile_m):
            valid = cutlass.min(cutlass.max(cnt - (b - first) * tile_m, 0), tile_m)
            m_block_expert[b] = tid | (valid << 16)
    if tid == nthr - 1:
        num_blocks = incl // tile_m
        meta[META_NUM_M_BLOCKS] = num_blocks
        meta[META_NUM_ROWS] = incl
        if cutlass.const_expr(block_multiple > 1):
            for b in cutlass.range(num_blocks, (num_blocks + block_multiple - 1) // block_multiple * block_multiple):
                m_block_expert[b] = cutlass.Int32(0)
    if cutlass.const_expr(pair_by_expert):
        _write_pair_table(m_block_expert, s_scan, tid, start // tile_m, padded // tile_m, incl // tile_m)


@cute.jit
def _write_pair_table(
    m_block_expert: cute.Tensor,
    s_scan: cute.Tensor,
    tid: cutlass.Int32,
    first: cutlass.Int32,
    blocks: cutlass.Int32,
    incl_blocks: cutlass.Int32,  # this thread's inclusive block count (the last thread's: every block)
):
    """The cluster schedule: ``m_block_expert[half + 2 g + r]`` = the M block that CTA r of cluster
    group g takes (``half`` = len / 2). The group count is ceil(blocks / 2) either way.

    Expert-aware (at most ``PAIR_BY_EXPERT_MAX_BLOCKS`` M blocks per non-empty expert on average, e.g.
    deepseek-v3 at T = 4096): thread e (expert e, ``blocks`` M blocks from ``first``) owns
    ``blocks // 2`` shared pairs (two blocks of e: one weight tile for both) and, for an odd count,
    one leftover block. Leftovers pair up in expert order (two experts: unshared); an odd leftover
    count ends with the phantom block. Groups run in expert order: expert e's shared pairs, then the
    leftover pair that e's leftover opens, so every group's weights are read close in time to the
    other groups of its experts (L2 reuse).

    Adjacent (more blocks per expert): group g takes blocks 2g and 2g + 1 (the phantom closes an odd
    count). Measured (TUNING.md, drop v7): with many blocks per expert the two schedules pair almost
    the same blocks and the adjacent one was 2-4 % faster at some of those points.
    """
    half = m_block_expert.shape[0] // 2
    shared = blocks // 2
    left = blocks - 2 * shared
    s_incl = _cta_inclusive_scan(shared, s_scan, tid)
    l_excl = _cta_inclusive_scan(left, s_scan, tid) - left
    busy = _cta_inclusive_scan(cutlass.Int32(blocks > 0), s_scan, tid)
    last = constants.ROUTING_THREADS - 1
    if tid == last:
        s_scan[0] = l_excl + left  # leftover total
        s_scan[1] = incl_blocks  # block total: the phantom block's index
        s_scan[2] = busy  # non-empty experts
    cute.arch.sync_threads()
    l_tot = s_scan[0]
    num_blocks = s_scan[1]
    by_expert = num_blocks <= PAIR_BY_EXPERT_MAX_BLOCKS * s_scan[2]
    cute.arch.sync_threads()  # s_scan[0..2] read by everyone before the slots below reuse it
    if not by_expert:
        for g in cutlass.range(tid, (num_blocks + 1) // 2, constants.ROUTING_THREADS):
            m_block_expert[half + 2 * g] = 2 * g
            m_block_expert[half + 2 * g + 1] = 2 * g + 1  # = num_blocks (the phantom) for an odd count
    else:
        _write_expert_pairs(m_block_expert, s_scan, half, first, blocks, shared, left, s_incl, l_excl, l_tot,
                            num_blocks)  # fmt: skip


@cute.jit
def _write_expert_pairs(
    m_block_expert: cute.Tensor,
    s_scan: cute.Tensor,
    half: cutlass.Int32,
    first: cutlass.Int32,
    blocks: cutlass.Int32,
    shared: cutlass.Int32,
    left: cutlass.Int32,
    s_incl: cutlass.Int32,
    l_excl: cutlass.Int32,
    l_tot: cutlass.Int32,
    num_blocks: cutlass.Int32,
):
    """The expert-aware table of ``_write_pair_table`` (every routing thread calls it)."""
    # Shared pair j of e: after the j shared pairs and the ceil(l_excl / 2) leftover pairs opened
    # by experts before e.
    s_excl = s_incl - shared
    lead = (l_excl + 1) // 2
    for i in cutlass.range(shared):
        pos = s_excl + i + lead
        m_block_expert[half + 2 * pos] = first + 2 * i
        m_block_expert[half + 2 * pos + 1] = first + 2 * i + 1
    # A leftover with an even index opens pair q = l_excl / 2 right after e's shared pairs; the
    # expert holding index l_excl + 1 (or the phantom) fills its second slot.
    if left > 0:
        q = l_excl // 2
        if l_excl % 2 == 0:
            pos = s_incl + q
            m_block_expert[half + 2 * pos] = first + blocks - 1
            s_scan[2 + q] = pos
            if l_excl == l_tot - 1:  # odd leftover count: the phantom block closes the last pair
                m_block_expert[half + 2 * pos + 1] = num_blocks
    cute.arch.sync_threads()
    if left > 0:
        if l_excl % 2 == 1:
            m_block_expert[half + 2 * s_scan[2 + l_excl // 2] + 1] = first + blocks - 1


def item_grid(num_tokens, top_k, num_route_ctas: int, trigger_after_wait: bool = False, wait: bool = True):
    """(first item, item stride) of this thread in a gather's grid-stride loop over its items, and the
    routing chunk size; waits for the routing kernel's results first (a no-op without PDL; ``wait=False``:
    the caller does, with ``wait_for_routing``). ``trigger_after_wait``: the next kernel launches only once
    this wait has returned (it reads the routing's block map before its own wait: a GEMM with early
    weight loads)."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    bdim, _, _ = cute.arch.block_dim()
    if wait:
        wait_for_routing(trigger_after_wait)
    return bid * bdim + tid, nblk * bdim, chunk_size(num_tokens * top_k, num_route_ctas)


def wait_for_routing(trigger_after_wait: bool = False) -> None:
    """``griddepcontrol.wait`` for the routing, with the dependents' trigger before it or after it."""
    if not trigger_after_wait:
        cute.arch.griddepcontrol_launch_dependents()
    cute.arch.griddepcontrol_wait()
    if trigger_after_wait:
        cute.arch.griddepcontrol_launch_dependents()


@cute.kernel
def gather_kernel(
    x: cute.Tensor,  # (T, H) bf16
    topk_ids: cute.Tensor,  # (T, K) int32
    pair_rank: cute.Tensor,  # (>= T*K,) int32: rank inside the routing CTA's chunk
    expert_off: cute.Tensor,  # (E,) int32
    cta_base: cute.Tensor,  # (G1, E) int32
    pair_row: cute.Tensor,  # (>= T*K,) int32 out: final row of each pair
    a_buf: cute.Tensor,  # (M_cap, H) bf16
    num_route_ctas: cutlass.Int32,  # the routing kernel's grid (its chunking)
    vpt: cutlass.Constexpr[int],
):
    """Final rows of the pairs, and a_buf[row] = x[token].

    A thread item is ``vpt`` 16-byte vectors of one token (strided by nvec/vpt so that a warp's
    accesses stay contiguous): the K rows are computed once per item, the x vectors are read once
    and written to the token's K rows, with all loads of an item in flight together.

    TODO(EP): world size 1 reads ``x`` directly. The expert-parallel variant (peer token rows read
    through a table of per-rank base addresses) lives in ``ep_kernels`` (``ep_gather``).
    """
    vec = constants.BF16_PER_16B
    hidden = x.shape[1]
    num_tokens = x.shape[0]
    top_k = topk_ids.shape[1]
    ngrp = hidden // (vec * vpt)
    first, stride, chunk = item_grid(num_tokens, top_k, num_route_ctas)
    frags = [cute.make_rmem_tensor((1, vec), x.element_type) for _ in range(vpt)]
    rows = cute.make_rmem_tensor((top_k,), cutlass.Int32)
    for item in cutlass.range(first, num_tokens * ngrp, stride):
        t = item // ngrp
        g = item - t * ngrp
        for j in cutlass.range_constexpr(vpt):
            cute.autovec_copy(cute.local_tile(x, (1, vec), (t, g + j * ngrp)), frags[j])
        for k in cutlass.range_constexpr(top_k):
            p = t * top_k + k
            e = topk_ids[t, k]
            rows[k] = expert_off[e] + cta_base[p // chunk, e] + pair_rank[p]
        for k in cutlass.range_constexpr(top_k):
            for j in cutlass.range_constexpr(vpt):
                cute.autovec_copy(frags[j], cute.local_tile(a_buf, (1, vec), (rows[k], g + j * ngrp)))
        if g == 0:
            for k in cutlass.range_constexpr(top_k):
                pair_row[t * top_k + k] = rows[k]


@cute.kernel
def row_map_kernel(
    topk_ids: cute.Tensor,  # (T, K) int32
    pair_rank: cute.Tensor,  # (>= T*K,) int32: rank inside the routing CTA's chunk
    expert_off: cute.Tensor,  # (E,) int32
    cta_base: cute.Tensor,  # (G1, E) int32
    pair_row: cute.Tensor,  # (>= T*K,) int32 out: final row of each pair
    row_token: cute.Tensor,  # (>= M_cap,) int32 out: token of each real row (padding rows untouched)
    num_route_ctas: cutlass.Int32,  # the routing kernel's grid (its chunking)
):
    """The gather's bookkeeping without its copy: ``pair_row[p]`` and ``row_token[pair_row[p]] = p // K``
    for every pair p, so FC1 can load its A rows from ``x`` itself (``GroupedGemmSm90(gather_a=True)``)."""
    num_tokens = topk_ids.shape[0]
    top_k = topk_ids.shape[1]
    first, stride, chunk = item_grid(num_tokens, top_k, num_route_ctas)
    ids_flat = cute.make_tensor(topk_ids.iterator, cute.make_layout(num_tokens * top_k))
    for p in cutlass.range(first, num_tokens * top_k, stride):
        e = ids_flat[p]
        row = expert_off[e] + cta_base[p // chunk, e] + pair_rank[p]
        pair_row[p] = row
        row_token[row] = p // top_k


@cute.kernel
def combine_kernel(
    y: cute.Tensor,  # (M_cap, H) bf16: FC2 output rows
    pair_row: cute.Tensor,  # (>= T*K,) int32
    topk_weights: cute.Tensor,  # (T, K) fp32
    out: cute.Tensor,  # (T, H) bf16
    top_k: cutlass.Constexpr[int],
    vpt: cutlass.Constexpr[int],
    pair_rows: cutlass.Constexpr[int] = 0,
):
    """out[t] = bf16(sum_k w[t,k] * float(y[pair_row[t*K+k]])), k in order, fp32 accumulation.
    ``pair_rows`` > 0 (the GEMMs' ``pair_blocks``): pair p's row is ``p * pair_rows`` (no ``pair_row`` map).

    A thread item is ``vpt`` 16-byte vectors (8 columns each) of one token; its K * vpt row loads
    are in flight together. No atomics: deterministic.
    """
    vec = constants.BF16_PER_16B
    hidden = out.shape[1]
    num_tokens = out.shape[0]
    ngrp = hidden // (vec * vpt)
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    bdim, _, _ = cute.arch.block_dim()
    cute.arch.griddepcontrol_launch_dependents()
    cute.arch.griddepcontrol_wait()  # FC2 output (no-op without PDL)
    frags = [cute.make_rmem_tensor((1, vec), y.element_type) for _ in range(top_k * vpt)]
    frag_out = cute.make_rmem_tensor((1, vec), out.element_type)
    for item in cutlass.range(bid * bdim + tid, num_tokens * ngrp, nblk * bdim):
        t = item // ngrp
        g = item - t * ngrp
        for k in cutlass.range_constexpr(top_k):
            if cutlass.const_expr(pair_rows > 0):
                r = (t * top_k + k) * pair_rows
            else:
                r = pair_row[t * top_k + k]
            for j in cutlass.range_constexpr(vpt):
                cute.autovec_copy(cute.local_tile(y, (1, vec), (r, g + j * ngrp)), frags[k * vpt + j])
        for j in cutlass.range_constexpr(vpt):
            acc = cute.make_rmem_tensor((1, vec), cutlass.Float32)
            acc.fill(0.0)
            for k in cutlass.range_constexpr(top_k):
                acc.store(acc.load() + topk_weights[t, k] * frags[k * vpt + j].load().to(cutlass.Float32))
            frag_out.store(acc.load().to(out.element_type))
            cute.autovec_copy(frag_out, cute.local_tile(out, (1, vec), (t, g + j * ngrp)))
