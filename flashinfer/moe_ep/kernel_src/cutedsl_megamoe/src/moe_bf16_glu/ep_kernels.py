"""Device kernels of the expert-parallel (EP) BF16 MoE: dispatch (pull or push) and combine (DRAFT).

One forward on rank ``r`` of ``R`` (global experts ``E = R * E_loc``, expert ``e`` lives on rank
``e // E_loc`` as local expert ``e % E_loc``) is this chain, all on one stream:

====  =====================  ======  =======================================================
 K    kernel                 grid    role
====  =====================  ======  =======================================================
 0    ep_begin               1       epoch += 1 (device-side protocol state), abort word := 0
 1    ep_route_count         G       x -> x_sym (own symmetric copy); per-CTA expert histogram
 2    ep_route_scan          1       per-expert counts/starts (symmetric), per-CTA bases
 3    ep_route_place         G       stable (token-order) send list sorted by global expert
 4    ep_signal              1       ready[r] = epoch into EVERY rank's flag array
 5    ep_owner_scan          1       WAIT ready[*] >= epoch, finished[*] >= prev_epoch; row plan
 6    ep_gather              G       peer reads of x rows into a_buf (expert-major, padded)
 7/8  FC1 / FC2              G       ``GroupedGemmSm90`` exactly as the world-1 kernel
 8b   ep_wire_quant          G       (``combine_dtype="mxfp8"``) y rows rewritten in place as MXFP8
 9    ep_done_and_wait       1       done[r] = epoch into every rank; WAIT done[*] >= epoch
 10   ep_combine             G       out[t] = bf16(sum_k w * y) with y read from the owners
 11   ep_signal              1       finished[r] = epoch into every rank
====  =====================  ======  =======================================================

Push dispatch (``dispatch="push"``) replaces kernel 6 by five (the sources write their rows into the
owners' ``a_buf``; NVLink writes need no round trip per load) and kernel 1 skips the x_sym copy:

====  =====================  ======  =======================================================
 6a   ep_signal              1       planned[r] = epoch into every rank (row_base is final)
 6b   ep_wait_all            1       WAIT planned[*] >= epoch (every owner planned its rows)
 6c   ep_push                4G      x rows -> owner's a_buf[row_base_owner[r, le] + j]
 6d   ep_signal              1       pushed[r] = epoch into every rank
 6e   ep_wait_all            1       WAIT pushed[*] >= epoch; fence.proxy.async (TMA reads next)
====  =====================  ======  =======================================================

The pushes of epoch e land after the owner's stage-2 wait (``finished[*] >= e-1``: nobody reads its
``a_buf`` of e-1 any more), because the owner signals ``planned`` only after that wait.

Flags: ``flags[NUM_FLAG_KINDS, R]`` int32 in every rank's symmetric arena; ``flags[KIND, s]`` is written only
by rank ``s`` (st.release.sys after a fence.acq_rel.sys) and read only by its owner rank
(ld.acquire.sys). Epochs grow monotonically from 1 (int32), so a wait is ``flag >= target``.

Device-side state, so that a CUDA graph of the chain replays correctly: the epoch lives in the
rank's ``ep_state`` (kernel 0 increments it; every later kernel reads it), never in a launch
argument, and the live token count is read from the ``live_tokens`` device scalar (clamped to the
rows of ``x``), never from a host shape. The host writes ``ep_state`` only while every rank is idle
(allocation: zeros; recovery after an abort: ``(largest epoch of any rank, 0, 0, 0)``).

Every wait (kernels 5 and 9) runs in a single CTA, one thread per awaited peer, with a deadline
``%globaltimer + timeout_ns``; on expiry the first failing thread claims the abort word
(``abort[0]`` 0 -> 1 by CAS) and writes ``abort[1..3] = (stage, peer, epoch)``. Every EP kernel
reads ``abort[0]`` first and returns when it is set; kernel 5 then also writes ``meta[0] = 0`` so
the GEMMs (which do not read the abort word) have no tiles. No trap, no hang.

Combine wire (``WIRE_*``): ``"bf16"`` (default) reads each y row as bf16 (2 bytes per element);
``"mxfp8"`` has the owner rewrite each y row of its ``a_buf`` in place (kernel 8b) as E4M3 codes in the
row's first H bytes and one UE8M0 scale per 32 after them (``core.quant.quantize_mxfp8``'s rule), and
the combine reads those 1 + 1/32 bytes per element and dequantizes them exactly (48 % fewer bytes over
the links; the semantics of ``core.reference.combine_wire``).

Placement (owner side, deterministic): a source's send list is its pairs sorted by global expert,
token order inside an expert (kernel 3 ranks with ``match.any`` inside one warp per chunk, so
the order does not depend on atomics). The owner lays rows out expert-major, each local expert
padded to ``tile_m``, and inside an expert by source ``s = 0..R-1`` then list order::

    row(s, le, j) = row_base[s, le] + j,  row_base[s, le] = expert_off[le] + sum_{s'<s} cnt[s', le]

``row_base`` ([R, E_loc] int32, symmetric) is the per-source table the owner publishes; a source
knows ``j`` of each of its pairs (``pair_pos``), so it finds the row of every pair.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ..common import constants
from ..src import block_quant as bq
from .ep_workspace import (  # noqa: F401  (one definition)
    ABORT_LEN,
    NUM_FLAG_KINDS,
    STATE_EPOCH,
    STATE_NEXT_PREV,
    STATE_PREV,
)

# flags[KIND, rank] rows
FLAG_READY = 0
FLAG_DONE = 1
FLAG_FINISHED = 2
FLAG_PLANNED = 3  # push dispatch: the owner's row_base of this epoch is final
FLAG_PUSHED = 4  # push dispatch: the source wrote all its rows into the owner's a_buf

# abort[] slots and stage ids written to abort[1]
ABORT_FLAG = 0
ABORT_STAGE = 1
ABORT_PEER = 2
ABORT_EPOCH = 3
STAGE_OWNER_READY = 1  # owner waits ready[s] (source s has published its send list)
STAGE_OWNER_REUSE = 2  # owner waits finished[s] of the previous epoch (buffer reuse)
STAGE_SOURCE_DONE = 3  # source waits done[d] (owner d has its y rows and row table)
STAGE_SOURCE_PLANNED = 4  # push: source waits planned[d] (owner d published its row table)
STAGE_OWNER_PUSHED = 5  # push: owner waits pushed[s] (source s wrote its rows)

# meta[] slots (local workspace of the owner)
META_NUM_M_BLOCKS = 0
META_NUM_ROWS = 1
META_NUM_PAIRS = 2  # pairs received from all sources
META_LEN = 4

# src_meta[s, :] (local workspace of the owner)
SRC_START = 0  # first index of the owner's range in source s's send list
SRC_TOTAL = 1  # pairs from s to the owner
SRC_PREFIX = 2  # sum of SRC_TOTAL over sources < s
SRC_META_LEN = 4

# combine wire formats (``ep_combine_kernel``)
WIRE_BF16 = "bf16"
WIRE_MXFP8 = "mxfp8"
WIRES = (WIRE_BF16, WIRE_MXFP8)
WIRE_BLOCK = 32  # elements per UE8M0 scale on the mxfp8 wire
WIRE_LANE = 16  # codes a combine lane reads per step (one 16-byte load; half a scale block)

SIGNAL_THREADS = 64  # threads of the single-CTA signal/wait kernels (>= R, so R <= 64)
POLL_NS = 128  # nanosleep between polls


# ------------------------------------------------------------------------------------- helpers
def _peer_ptr(table: cute.Tensor, peer, dtype, align: int):
    """Pointer to rank ``peer``'s copy of a symmetric buffer (``table`` is int64 [R] of addresses)."""
    return cute.make_ptr(dtype, table[peer], cute.AddressSpace.gmem, assumed_align=align)


def _load_sys(ptr) -> cutlass.Int32:
    """Strong (relaxed, system-scope) int32 load of metadata another rank wrote (no stale L1)."""
    return cute.arch.load(ptr, cutlass.Int32, sem="relaxed", scope="sys")


def aborted(abort: cute.Tensor):
    """The forward in flight aborted (a cross-rank wait expired): every EP kernel returns at once."""
    return abort[ABORT_FLAG] != 0


@cute.jit
def _record_abort(abort: cute.Tensor, stage: cutlass.Int32, peer: cutlass.Int32, epoch: cutlass.Int32):
    old = cute.arch.atomic_cas(
        abort.iterator + ABORT_FLAG, cmp=cutlass.Int32(0), val=cutlass.Int32(1), sem="relaxed", scope="gpu"
    )
    if old == 0:
        abort[ABORT_STAGE] = stage
        abort[ABORT_PEER] = peer
        abort[ABORT_EPOCH] = epoch


@cute.jit
def _spin_wait_ge(
    flag_ptr,
    target: cutlass.Int32,
    deadline: cutlass.Int64,
    abort: cute.Tensor,
    stage: cutlass.Int32,
    peer: cutlass.Int32,
    epoch: cutlass.Int32,
) -> cutlass.Int32:
    """Spin (ld.acquire.sys + nanosleep) until ``*flag_ptr >= target`` or the deadline passes.

    Returns 0 on success, 1 on timeout (then the abort word is claimed and filled)."""
    state = cutlass.Int32(1)  # 1 waiting, 0 done, 2 timed out
    v = cute.arch.load(flag_ptr, cutlass.Int32, sem="acquire", scope="sys")
    if v >= target:
        state = cutlass.Int32(0)
    while state == 1:
        cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[cutlass.Int32(POLL_NS)])
        v = cute.arch.load(flag_ptr, cutlass.Int32, sem="acquire", scope="sys")
        if v >= target:
            state = cutlass.Int32(0)
        else:
            if cute.arch.globaltimer() > deadline:
                state = cutlass.Int32(2)
    failed = cutlass.Int32(0)
    if state == 2:
        _record_abort(abort, stage, peer, epoch)
        failed = cutlass.Int32(1)
    return failed


@cute.jit
def _block_inclusive_scan(v: cutlass.Int32, s_scan: cute.Tensor, tid: cutlass.Int32) -> cutlass.Int32:
    """Inclusive scan over the CTA (ROUTING_THREADS threads, every thread calls it)."""
    lane = tid % 32
    warp = tid // 32
    for i in cutlass.range_constexpr(5):
        o = cute.arch.shuffle_sync_up(v, 1 << i)
        if lane >= (1 << i):
            v = v + o
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
    cute.arch.sync_threads()  # s_scan may be reused by the caller
    return incl


def chunk_size(num_pairs, num_ctas):
    return cutlass.max((num_pairs + num_ctas - 1) // num_ctas, 1)


def live_count(live_tokens: cute.Tensor, rows):
    """The live token count: ``live_tokens[0]`` clamped to [0, rows] (rows of the token buffers)."""
    return cutlass.min(cutlass.max(live_tokens[0], cutlass.Int32(0)), rows)


# ------------------------------------------------------------------------- protocol state
@cute.kernel
def ep_begin_kernel(ep_state: cute.Tensor, abort: cute.Tensor):
    """Kernel 0 (one warp): start a forward. epoch += 1; this forward's reuse-wait target is the
    previous forward's epoch (or 0 after a recovery); the abort word is cleared."""
    tid, _, _ = cute.arch.thread_idx()
    if tid == 0:
        epoch = ep_state[STATE_EPOCH] + 1
        ep_state[STATE_PREV] = ep_state[STATE_NEXT_PREV]
        ep_state[STATE_NEXT_PREV] = epoch
        ep_state[STATE_EPOCH] = epoch
    if tid < ABORT_LEN:
        abort[tid] = cutlass.Int32(0)


# --------------------------------------------------------------------- source side: routing
@cute.kernel
def ep_route_count_kernel(
    x: cute.Tensor,  # (T, H) bf16
    topk_ids: cute.Tensor,  # (T, K) int32, global experts
    live_tokens: cute.Tensor,  # (1,) int32: rows of x/topk_ids to route (clamped to T)
    x_sym: cute.Tensor,  # (T_cap, H) bf16, symmetric: receives x (peers gather from it)
    cta_cnt: cute.Tensor,  # (G, E) int32: pairs of each expert in this CTA's chunk
    abort: cute.Tensor,
    num_experts: cutlass.Constexpr[int],
    copy_x: cutlass.Constexpr[bool],  # pull: the owners read x from x_sym (push reads x itself)
):
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    nthr, _, _ = cute.arch.block_dim()
    if not aborted(abort):
        vec = constants.BF16_PER_16B
        hidden = x.shape[1]
        num_tokens = live_count(live_tokens, x.shape[0])
        num_pairs = num_tokens * topk_ids.shape[1]
        # x -> x_sym, one warp per token (16-byte vectors).
        lane = tid % 32
        warps = nthr // 32
        frag = cute.make_rmem_tensor((vec,), x.element_type)
        if cutlass.const_expr(copy_x):
            for t in cutlass.range(bid * warps + tid // 32, num_tokens, nblk * warps):
                for c in cutlass.range(lane, hidden // vec, 32):
                    cute.autovec_copy(cute.local_tile(x, (1, vec), (t, c)), frag)
                    cute.autovec_copy(frag, cute.local_tile(x_sym, (1, vec), (t, c)))
        # Histogram of this CTA's contiguous chunk of pairs.
        smem = cutlass.utils.SmemAllocator()
        s_hist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(num_experts), byte_alignment=16)
        for e in cutlass.range(tid, num_experts, nthr):
            s_hist[e] = cutlass.Int32(0)
        cute.arch.sync_threads()
        ids_flat = cute.make_tensor(topk_ids.iterator, cute.make_layout(num_pairs))
        chunk = chunk_size(num_pairs, nblk)
        start = bid * chunk
        stop = cutlass.min(start + chunk, num_pairs)
        for p in cutlass.range(start + tid, stop, nthr):
            cute.arch.atomic_add((s_hist.iterator + ids_flat[p]).llvm_ptr, cutlass.Int32(1))
        cute.arch.sync_threads()
        for e in cutlass.range(tid, num_experts, nthr):
            cta_cnt[bid, e] = s_hist[e]


@cute.kernel
def ep_route_scan_kernel(
    cta_cnt: cute.Tensor,  # (G, E) int32: in counts; out: first position of the CTA inside the expert
    expert_cnt: cute.Tensor,  # (E,) int32 symmetric: this source's pairs per global expert
    expert_start: cute.Tensor,  # (E,) int32 symmetric: first send-list index of each expert
    abort: cute.Tensor,
    num_experts: cutlass.Constexpr[int],
    num_route_ctas: cutlass.Constexpr[int],
):
    tid, _, _ = cute.arch.thread_idx()
    if not aborted(abort):
        smem = cutlass.utils.SmemAllocator()
        s_scan = smem.allocate_tensor(cutlass.Int32, cute.make_layout(32), byte_alignment=16)
        total = cutlass.Int32(0)
        if tid < num_experts:
            for c in cutlass.range(num_route_ctas):
                n = cta_cnt[c, tid]
                cta_cnt[c, tid] = total
                total = total + n
        incl = _block_inclusive_scan(total, s_scan, tid)
        if tid < num_experts:
            expert_cnt[tid] = total
            expert_start[tid] = incl - total


@cute.kernel
def ep_route_place_kernel(
    topk_ids: cute.Tensor,  # (T, K) int32
    live_tokens: cute.Tensor,  # (1,) int32
    cta_cnt: cute.Tensor,  # (G, E) int32: per-CTA base inside each expert (from the scan)
    expert_start: cute.Tensor,  # (E,) int32 symmetric
    send_list: cute.Tensor,  # (P_cap, 2) int32 symmetric: (pair index t*K+k, global expert)
    pair_pos: cute.Tensor,  # (P_cap,) int32: position j of the pair inside (this source, expert)
    abort: cute.Tensor,
    num_experts: cutlass.Constexpr[int],
):
    """One warp per CTA walks its chunk in order, 32 pairs at a time: the rank among equal experts
    comes from ``match.any`` (stable, token order), so the send list is deterministic."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    if not aborted(abort):
        smem = cutlass.utils.SmemAllocator()
        s_run = smem.allocate_tensor(cutlass.Int32, cute.make_layout(num_experts), byte_alignment=16)
        for e in cutlass.range(tid, num_experts, 32):
            s_run[e] = cta_cnt[bid, e]
        cute.arch.sync_warp()
        num_pairs = live_count(live_tokens, topk_ids.shape[0]) * topk_ids.shape[1]
        ids_flat = cute.make_tensor(topk_ids.iterator, cute.make_layout(num_pairs))
        chunk = chunk_size(num_pairs, nblk)
        start = bid * chunk
        stop = cutlass.min(start + chunk, num_pairs)
        lt = cutlass.Int32(cute.arch.lanemask_lt())
        for q in cutlass.range(start, stop, 32):
            p = q + tid
            e = cutlass.Int32(-1)
            if p < stop:
                e = ids_flat[p]
            peers = cutlass.Int32(cute.arch.match_sync(0xFFFFFFFF, e))
            rank_in = cute.arch.popc(peers & lt)
            base = cutlass.Int32(0)
            if p < stop:
                base = s_run[e]
            cute.arch.sync_warp()
            if p < stop:
                pos = base + rank_in
                idx = expert_start[e] + pos
                send_list[idx, 0] = p
                send_list[idx, 1] = e
                pair_pos[p] = pos
                if rank_in == 0:
                    s_run[e] = base + cute.arch.popc(peers)
            cute.arch.sync_warp()


@cute.kernel
def ep_signal_kernel(
    flags_tab: cute.Tensor,  # (R,) int64: every rank's flags[NUM_FLAG_KINDS, R]
    rank: cutlass.Int32,
    ep_state: cute.Tensor,  # (STATE_LEN,) int32: the epoch
    abort: cute.Tensor,
    kind: cutlass.Constexpr[int],
    world: cutlass.Constexpr[int],
):
    """flags[kind, rank] = epoch in every rank's flag array (fence.acq_rel.sys + st.release.sys).

    The data the flag publishes was written by earlier kernels of this stream (complete)."""
    tid, _, _ = cute.arch.thread_idx()
    if not aborted(abort):
        if tid < world:
            cute.arch.fence_acq_rel_sys()
            ptr = _peer_ptr(flags_tab, tid, cutlass.Int32, 4) + (kind * world + rank)
            cute.arch.store(ptr, ep_state[STATE_EPOCH], sem="release", scope="sys")


# ------------------------------------------------------------------------- owner side
@cute.kernel
def ep_owner_scan_kernel(
    flags: cute.Tensor,  # (NUM_FLAG_KINDS, R) int32 symmetric (this rank's)
    cnt_tab: cute.Tensor,  # (R,) int64: every rank's expert_cnt (E,)
    start_tab: cute.Tensor,  # (R,) int64: every rank's expert_start (E,)
    row_base: cute.Tensor,  # (R, E_loc) int32 symmetric: published row table
    m_block_expert: cute.Tensor,  # (M_cap / tile_m,) int32
    meta: cute.Tensor,  # (META_LEN,) int32
    src_meta: cute.Tensor,  # (R, SRC_META_LEN) int32
    rank: cutlass.Int32,
    ep_state: cute.Tensor,  # (STATE_LEN,) int32: epoch and reuse-wait target
    timeout_ns: cutlass.Int64,
    abort: cute.Tensor,
    world: cutlass.Constexpr[int],
    local_experts: cutlass.Constexpr[int],
    tile_m: cutlass.Constexpr[int],
    block_multiple: cutlass.Constexpr[int],
):
    """WAIT ready[s] >= epoch (stage 1) and finished[s] >= prev_epoch (stage 2) for every s, then
    plan the rows: padded expert offsets, the M-block map, ``row_base`` and the source ranges.
    ``block_multiple = 2`` (GEMM clusters): an odd block count gets a phantom block after the last
    (expert 0, no real rows), so a cluster's second CTA reads a defined entry and skips its MMAs."""
    tid, _, _ = cute.arch.thread_idx()
    epoch = ep_state[STATE_EPOCH]
    prev_epoch = ep_state[STATE_PREV]
    smem = cutlass.utils.SmemAllocator()
    s_scan = smem.allocate_tensor(cutlass.Int32, cute.make_layout(32), byte_alignment=16)
    s_fail = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), byte_alignment=16)
    if tid == 0:
        s_fail[0] = cutlass.Int32(0)
        if aborted(abort):
            s_fail[0] = cutlass.Int32(1)
    cute.arch.sync_threads()
    if s_fail[0] == 0:
        deadline = cute.arch.globaltimer() + timeout_ns
        if tid < world:
            f = _spin_wait_ge(flags.iterator + (FLAG_READY * world + tid), epoch, deadline, abort,
                              cutlass.Int32(STAGE_OWNER_READY), tid, epoch)  # fmt: skip
            if f != 0:
                s_fail[0] = cutlass.Int32(1)
        if tid >= 32 and tid < 32 + world:
            s = tid - 32
            if prev_epoch > 0:
                f = _spin_wait_ge(flags.iterator + (FLAG_FINISHED * world + s), prev_epoch, deadline, abort,
                                  cutlass.Int32(STAGE_OWNER_REUSE), s, epoch)  # fmt: skip
                if f != 0:
                    s_fail[0] = cutlass.Int32(1)
    cute.arch.sync_threads()
    if s_fail[0] != 0:
        if tid == 0:
            meta[META_NUM_M_BLOCKS] = cutlass.Int32(0)  # the GEMMs get no tiles
            meta[META_NUM_ROWS] = cutlass.Int32(0)
            meta[META_NUM_PAIRS] = cutlass.Int32(0)
    else:
        first_e = rank * local_experts
        cnt = cute.make_rmem_tensor((world,), cutlass.Int32)
        total = cutlass.Int32(0)
        for s in cutlass.range_constexpr(world):
            cnt[s] = cutlass.Int32(0)
            if tid < local_experts:
                cnt[s] = _load_sys(_peer_ptr(cnt_tab, s, cutlass.Int32, 4) + (first_e + tid))
            total = total + cnt[s]
        padded = (total + (tile_m - 1)) // tile_m * tile_m
        incl = _block_inclusive_scan(padded, s_scan, tid)
        start = incl - padded
        if tid < local_experts:
            acc = start
            for s in cutlass.range_constexpr(world):
                row_base[s, tid] = acc
                acc = acc + cnt[s]
            first = start // tile_m
            for b in cutlass.range(first, incl // tile_m):
                valid = cutlass.min(total - (b - first) * tile_m, tile_m)
                m_block_expert[b] = tid | (valid << 16)
        if tid == constants.ROUTING_THREADS - 1:
            meta[META_NUM_M_BLOCKS] = incl // tile_m
            meta[META_NUM_ROWS] = incl
            if cutlass.const_expr(block_multiple > 1):
                num_blocks = incl // tile_m
                rounded = (num_blocks + block_multiple - 1) // block_multiple * block_multiple
                for b in cutlass.range(num_blocks, rounded):
                    m_block_expert[b] = cutlass.Int32(0)
        if tid == 0:
            prefix = cutlass.Int32(0)
            last_e = first_e + local_experts - 1
            for s in cutlass.range_constexpr(world):
                st_ptr = _peer_ptr(start_tab, s, cutlass.Int32, 4)
                first_idx = _load_sys(st_ptr + first_e)
                end_idx = _load_sys(st_ptr + last_e) + _load_sys(_peer_ptr(cnt_tab, s, cutlass.Int32, 4) + last_e)
                src_meta[s, SRC_START] = first_idx
                src_meta[s, SRC_TOTAL] = end_idx - first_idx
                src_meta[s, SRC_PREFIX] = prefix
                prefix = prefix + end_idx - first_idx
            meta[META_NUM_PAIRS] = prefix


@cute.kernel
def ep_gather_kernel(
    x_sym: cute.Tensor,  # (T_cap, H) bf16 symmetric (layout of every rank's copy)
    x_tab: cute.Tensor,  # (R,) int64
    send_tab: cute.Tensor,  # (R,) int64: every rank's send_list (P_cap, 2)
    start_tab: cute.Tensor,  # (R,) int64: every rank's expert_start (E,)
    row_base: cute.Tensor,  # (R, E_loc) int32 (own)
    src_meta: cute.Tensor,  # (R, SRC_META_LEN) int32
    meta: cute.Tensor,
    a_buf: cute.Tensor,  # (M_cap, H) bf16 symmetric (own)
    rank: cutlass.Int32,
    abort: cute.Tensor,
    world: cutlass.Constexpr[int],
    local_experts: cutlass.Constexpr[int],
    top_k: cutlass.Constexpr[int],
):
    """One warp per received pair g: find its source s, read (pair, expert) from s's send list and
    the token row from s's x_sym (16-byte peer reads), write it to a_buf[row_base[s, le] + j]."""
    vec = constants.BF16_PER_16B
    hidden = a_buf.shape[1]
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    bdim, _, _ = cute.arch.block_dim()
    if not aborted(abort):
        warps = bdim // 32
        lane = tid % 32
        num_pairs = meta[META_NUM_PAIRS]
        first_e = rank * local_experts
        frag = cute.make_rmem_tensor((vec,), a_buf.element_type)
        for g in cutlass.range(bid * warps + tid // 32, num_pairs, nblk * warps):
            src = cutlass.Int32(0)
            for s in cutlass.range_constexpr(1, world):
                if src_meta[s, SRC_PREFIX] <= g:
                    src = cutlass.Int32(s)
            i = src_meta[src, SRC_START] + g - src_meta[src, SRC_PREFIX]
            lst = _peer_ptr(send_tab, src, cutlass.Int32, 8)
            p = _load_sys(lst + 2 * i)
            e = _load_sys(lst + (2 * i + 1))
            j = i - _load_sys(_peer_ptr(start_tab, src, cutlass.Int32, 4) + e)
            row = row_base[src, e - first_e] + j
            t = p // top_k
            row_addr = x_tab[src] + cutlass.Int64(t) * (x_sym.layout.stride[0] * 2)
            for c in cutlass.range(lane, hidden // vec, 32, unroll=4):  # 4 peer loads in flight per lane
                src_vec = cute.make_tensor(
                    cute.make_ptr(x_sym.element_type, row_addr + cutlass.Int64(c) * (vec * 2),
                                  cute.AddressSpace.gmem, assumed_align=16),
                    cute.make_layout(vec),
                )  # fmt: skip
                cute.autovec_copy(src_vec, frag)
                cute.autovec_copy(frag, cute.local_tile(a_buf, (1, vec), (row, c)))
        # a_buf is read next by TMA (async proxy): order these generic-proxy writes before it.
        cute.arch.fence_proxy("async.global")


# ------------------------------------------------------------------ push dispatch (dispatch="push")
@cute.kernel
def ep_wait_all_kernel(
    flags: cute.Tensor,  # (NUM_FLAG_KINDS, R) int32 symmetric (own)
    meta: cute.Tensor,  # (META_LEN,) int32: the GEMMs get no tiles when this rank's chain aborted
    ep_state: cute.Tensor,  # (STATE_LEN,) int32: the epoch
    timeout_ns: cutlass.Int64,
    abort: cute.Tensor,
    kind: cutlass.Constexpr[int],
    stage: cutlass.Constexpr[int],
    world: cutlass.Constexpr[int],
    proxy_fence: cutlass.Constexpr[bool],
):
    """WAIT flags[kind, s] >= epoch for every rank s (one thread per peer). ``proxy_fence``: the
    peers wrote this rank's ``a_buf`` with generic stores and TMA reads it next (async proxy)."""
    tid, _, _ = cute.arch.thread_idx()
    if not aborted(abort):
        epoch = ep_state[STATE_EPOCH]
        if tid < world:
            deadline = cute.arch.globaltimer() + timeout_ns
            _spin_wait_ge(flags.iterator + (kind * world + tid), epoch, deadline, abort,
                          cutlass.Int32(stage), tid, epoch)  # fmt: skip
    cute.arch.sync_threads()
    if tid == 0:
        if aborted(abort):
            meta[META_NUM_M_BLOCKS] = cutlass.Int32(0)
            meta[META_NUM_ROWS] = cutlass.Int32(0)
    if cutlass.const_expr(proxy_fence):
        cute.arch.fence_proxy("async.global")


@cute.kernel
def ep_push_kernel(
    x: cute.Tensor,  # (T, H) bf16: this rank's tokens
    live_tokens: cute.Tensor,  # (1,) int32
    send_list: cute.Tensor,  # (P_cap, 2) int32 symmetric (own): (pair, global expert), by expert
    expert_start: cute.Tensor,  # (E,) int32 symmetric (own)
    row_base_tab: cute.Tensor,  # (R,) int64: every rank's row_base (R, E_loc)
    y_tab: cute.Tensor,  # (R,) int64: every rank's a_buf (M_cap, H)
    rank: cutlass.Int32,
    abort: cute.Tensor,
    local_experts: cutlass.Constexpr[int],
    top_k: cutlass.Constexpr[int],
):
    """One warp per own pair i of the send list: write x[token] into the owner's a_buf at
    ``row_base_owner[rank, le] + j`` (16-byte peer stores); every thread then fences at system
    scope, so the ``pushed`` flag of the next kernel publishes the rows."""
    vec = constants.BF16_PER_16B
    hidden = x.shape[1]
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    bdim, _, _ = cute.arch.block_dim()
    if not aborted(abort):
        warps = bdim // 32
        lane = tid % 32
        num_pairs = live_count(live_tokens, x.shape[0]) * top_k
        frag = cute.make_rmem_tensor((vec,), x.element_type)
        for i in cutlass.range(bid * warps + tid // 32, num_pairs, nblk * warps):
            p = send_list[i, 0]
            e = send_list[i, 1]
            d = e // local_experts
            le = e - d * local_experts
            j = i - expert_start[e]
            row = _load_sys(_peer_ptr(row_base_tab, d, cutlass.Int32, 4) + (rank * local_experts + le)) + j
            t = p // top_k
            row_addr = y_tab[d] + cutlass.Int64(row) * (hidden * 2)
            for c in cutlass.range(lane, hidden // vec, 32, unroll=4):
                dst = cute.make_tensor(
                    cute.make_ptr(x.element_type, row_addr + cutlass.Int64(c) * (vec * 2),
                                  cute.AddressSpace.gmem, assumed_align=16),
                    cute.make_layout(vec),
                )  # fmt: skip
                cute.autovec_copy(cute.local_tile(x, (1, vec), (t, c)), frag)
                cute.autovec_copy(frag, dst)
        cute.arch.fence_acq_rel_sys()


@cute.kernel
def ep_wire_quant_kernel(
    a_buf: cute.Tensor,  # (M_cap, H) bf16 (own): y rows, rewritten in place
    a_words: cute.Tensor,  # (M_cap, H/2) uint32: the same memory
    a_bytes: cute.Tensor,  # (M_cap, 2H) uint8: the same memory
    meta: cute.Tensor,  # (META_LEN,) int32: META_NUM_ROWS rows of a_buf hold y
    abort: cute.Tensor,
):
    """Kernel 8b (``combine_dtype="mxfp8"``, owner side, after FC2): every y row becomes its MXFP8 wire
    form in place, codes in bytes [0, H) (element order), UE8M0 scales in bytes [H, H + H/32). One CTA
    per row at a time: the row is staged in shared memory first, since its codes overwrite the first
    half of the row while other threads still read their blocks."""
    vec = constants.BF16_PER_16B
    hidden = a_buf.shape[1]
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    nthr, _, _ = cute.arch.block_dim()
    if not aborted(abort):
        smem = cutlass.utils.SmemAllocator()
        s_row = smem.allocate_tensor(a_buf.element_type, cute.make_layout(hidden), byte_alignment=16)
        frag = cute.make_rmem_tensor((WIRE_BLOCK,), a_buf.element_type)
        vals = cute.make_rmem_tensor((WIRE_BLOCK,), cutlass.Float32)
        words = cute.make_rmem_tensor((WIRE_BLOCK // 4,), cutlass.Uint32)
        for row in cutlass.range(bid, meta[META_NUM_ROWS], nblk):
            for c in cutlass.range(tid, hidden // vec, nthr):
                cute.autovec_copy(cute.local_tile(a_buf, (1, vec), (row, c)), cute.local_tile(s_row, (vec,), (c,)))
            cute.arch.sync_threads()
            for g in cutlass.range(tid, hidden // WIRE_BLOCK, nthr):
                cute.autovec_copy(cute.local_tile(s_row, (WIRE_BLOCK,), (g,)), frag)
                vals.store(frag.load().to(cutlass.Float32))
                v = [vals[i] for i in range(WIRE_BLOCK)]
                sbyte, codes = bq.mxfp8_codes(v, bq.block_amax(v))
                for i in cutlass.range_constexpr(WIRE_BLOCK // 4):
                    words[i] = codes[i]
                cute.autovec_copy(words, cute.local_tile(a_words, (1, WIRE_BLOCK // 4), (row, g)))
                a_bytes[row, hidden + g] = cutlass.Uint8(sbyte)
            cute.arch.sync_threads()  # the row's reads are done before the next row is staged


@cute.kernel
def ep_done_and_wait_kernel(
    flags: cute.Tensor,  # (NUM_FLAG_KINDS, R) int32 symmetric (own)
    flags_tab: cute.Tensor,  # (R,) int64
    rank: cutlass.Int32,
    ep_state: cute.Tensor,  # (STATE_LEN,) int32: the epoch
    timeout_ns: cutlass.Int64,
    abort: cute.Tensor,
    world: cutlass.Constexpr[int],
):
    """Owner role: done[rank] = epoch in every rank (y rows and row_base are final). Source role:
    WAIT done[d] >= epoch for every owner d (stage 3)."""
    tid, _, _ = cute.arch.thread_idx()
    if not aborted(abort):
        epoch = ep_state[STATE_EPOCH]
        if tid < world:
            cute.arch.fence_acq_rel_sys()
            ptr = _peer_ptr(flags_tab, tid, cutlass.Int32, 4) + (FLAG_DONE * world + rank)
            cute.arch.store(ptr, epoch, sem="release", scope="sys")
            deadline = cute.arch.globaltimer() + timeout_ns
            _spin_wait_ge(flags.iterator + (FLAG_DONE * world + tid), epoch, deadline, abort,
                          cutlass.Int32(STAGE_SOURCE_DONE), tid, epoch)  # fmt: skip


# ------------------------------------------------------------------------- source side: combine
@cute.kernel
def ep_combine_kernel(
    topk_ids: cute.Tensor,  # (T, K) int32
    topk_weights: cute.Tensor,  # (T, K) fp32
    live_tokens: cute.Tensor,  # (1,) int32: rows of out to write (the rest are left untouched)
    pair_pos: cute.Tensor,  # (P_cap,) int32
    row_base_tab: cute.Tensor,  # (R,) int64: every rank's row_base (R, E_loc)
    y_tab: cute.Tensor,  # (R,) int64: every rank's a_buf (M_cap, H) = FC2 output
    out: cute.Tensor,  # (T, H) bf16
    rank: cutlass.Int32,
    abort: cute.Tensor,
    world: cutlass.Constexpr[int],
    local_experts: cutlass.Constexpr[int],
    top_k: cutlass.Constexpr[int],
    wire: cutlass.Constexpr[str],
):
    """out[t] = bf16(sum_k w[t,k] * float(y_owner[row])), k in order, fp32, no atomics; with the
    mxfp8 wire y is read as codes and scales (kernel 8b) and dequantized exactly first."""
    vec = constants.BF16_PER_16B
    hidden = out.shape[1]
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    bdim, _, _ = cute.arch.block_dim()
    if not aborted(abort):
        num_tokens = live_count(live_tokens, out.shape[0])
        warps = bdim // 32
        lane = tid % 32
        frag_in = cute.make_rmem_tensor((vec,), out.element_type)
        frag_out = cute.make_rmem_tensor((vec,), out.element_type)
        for t in cutlass.range(bid * warps + tid // 32, num_tokens, nblk * warps):
            addr = cute.make_rmem_tensor((top_k,), cutlass.Int64)
            wts = cute.make_rmem_tensor((top_k,), cutlass.Float32)
            for k in cutlass.range_constexpr(top_k):
                e = topk_ids[t, k]
                d = e // local_experts
                le = e - d * local_experts
                rb = _peer_ptr(row_base_tab, d, cutlass.Int32, 4)
                row = _load_sys(rb + (rank * local_experts + le)) + pair_pos[t * top_k + k]
                addr[k] = y_tab[d] + cutlass.Int64(row) * (hidden * 2)
                wts[k] = topk_weights[t, k]
            if cutlass.const_expr(wire == WIRE_MXFP8):
                _combine_mxfp8_row(out, t, lane, addr, wts, top_k)
            else:
                for c in cutlass.range(lane, hidden // vec, 32):
                    acc = cute.make_rmem_tensor((vec,), cutlass.Float32)
                    acc.fill(0.0)
                    for k in cutlass.range_constexpr(top_k):
                        src = cute.make_tensor(
                            cute.make_ptr(out.element_type, addr[k] + cutlass.Int64(c) * (vec * 2),
                                          cute.AddressSpace.gmem, assumed_align=16),
                            cute.make_layout(vec),
                        )  # fmt: skip
                        cute.autovec_copy(src, frag_in)
                        acc.store(acc.load() + wts[k] * frag_in.load().to(cutlass.Float32))
                    frag_out.store(acc.load().to(out.element_type))
                    cute.autovec_copy(frag_out, cute.local_tile(out, (1, vec), (t, c)))


@cute.jit
def _combine_mxfp8_row(out: cute.Tensor, t, lane, addr: cute.Tensor, wts: cute.Tensor, top_k: cutlass.Constexpr[int]):
    """One token's output row from the owners' mxfp8 wire rows (``addr[k]``: the byte address of pair
    k's row): 16 codes per lane step and their block's scale byte, dequantized exactly in fp32."""
    hidden = out.shape[1]
    codes = cute.make_rmem_tensor((WIRE_LANE,), cutlass.Uint8)
    frag = cute.make_rmem_tensor((WIRE_LANE,), out.element_type)
    for c in cutlass.range(lane, hidden // WIRE_LANE, 32):
        acc = cute.make_rmem_tensor((WIRE_LANE,), cutlass.Float32)
        acc.fill(0.0)
        for k in cutlass.range_constexpr(top_k):
            src = cute.make_tensor(
                cute.make_ptr(cutlass.Uint8, addr[k] + cutlass.Int64(c) * WIRE_LANE, cute.AddressSpace.gmem,
                              assumed_align=16),
                cute.make_layout(WIRE_LANE),
            )  # fmt: skip
            cute.autovec_copy(src, codes)
            sptr = cute.make_ptr(cutlass.Uint8, addr[k] + hidden + c // (WIRE_BLOCK // WIRE_LANE),
                                 cute.AddressSpace.gmem, assumed_align=1)  # fmt: skip
            scale = bq.ue8m0_to_f32(cutlass.Uint32(cute.make_tensor(sptr, cute.make_layout(1))[0]))
            for i in cutlass.range_constexpr(WIRE_LANE):
                acc[i] = acc[i] + wts[k] * (bq.e4m3_to_f32(cutlass.Uint32(codes[i])) * scale)
        frag.store(acc.load().to(out.element_type))
        cute.autovec_copy(frag, cute.local_tile(out, (1, WIRE_LANE), (t, c)))
