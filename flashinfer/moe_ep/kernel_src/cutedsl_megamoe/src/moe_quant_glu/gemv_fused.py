"""The GEMV pair chain as one persistent launch (``gemv_fused``): FC1, a grid barrier, FC2 and the combine.

The pair chain (``gemv``: ``pair_blocks`` + ``pair_combine``) runs the decode layer as two kernels of one CTA
per (pair, 64-row row warp). At qwen3-30b-a3b T = 1 FC1 is 192 such CTAs on 132 SMs: one uneven wave, the SMs
holding two CTAs setting its end (TUNING.md, sessions 43-44: the last FC1 CTA ends 3 us after the median one).
Here one CTA per SM streams an equal share of the layer's weights:

- work items: (pair, row warp, K unit) of FC1 (``P * 2I/64 * H/unit`` items), then of FC2 (``P * H/64 *
  I/unit``); CTA c takes the items ``[c N / G, (c + 1) N / G)`` of each phase (``N`` items, ``G`` CTAs), so
  every CTA converts and multiplies the same number of weight bytes, give or take one K unit.
- a CTA's range cuts at most two units (pair, row warp) short, one at each end. Its items run in the order
  *tail* (the unit that goes on into the next CTA), whole units, *head* (the unit begun in the CTA before),
  so a CTA publishes its tail's partial sums (``part_ws``, a flag per CTA) before it waits for its
  predecessors' partials of its head (added to its own in CTA order): no CTA waits for one that is itself waiting.
- ``k_warps`` streaming warps take the CTA's items in turn (warp w: the CTA's items w, w + k_warps, ...), each
  through its own ``cp.async`` ring (``gemv``'s copies, conversions and ``mma.sync``: the same products), whose
  copies run ``stages - 1`` items ahead across unit and phase boundaries: FC2's first weights are in flight before
  the grid barrier. At the end of each unit's segment they leave their fp32 partial sums in shared memory
  (``PART_BUFS`` buffers, reused in turn, handed over with named barriers) and go on: they never fence, so their
  rings stay in flight (a memory fence waits for them: session 52's first version, whose warps fenced and
  counted in at every segment, streamed at half the rate).
- one service warp sums the partials in warp order, publishes a tail's, adds the earlier CTAs' partials of a head
  and runs ``gemv``'s epilogue: FC1's activation and requantization into ``h_buf``, FC2's y row and
  ``pair_combine``'s count and combine (the combine kernel's bits). It alone stores to global memory, so it alone
  fences, and it holds the grid barrier. The fp32 summation order of K differs from the two-kernel chain's (fixed
  for a given T and grid).
- FC1 prepares the token rows of its pairs itself (``gemv``'s ``gather_x``: the gather's functions, so the same
  values); after the grid barrier FC2 reads its pairs' activation rows from L2 into shared memory.

A CTA's range spans at most two pairs while ``T * top_k <= G`` (the frontend's launch limit), so the CTA holds
at most ``MAX_ROWS`` token rows and ``MAX_ROWS`` activation rows. The grid barrier needs every CTA resident at
once: ``G`` is at most the SM count, and the kernel lets its dependents launch only after its own wait (every CTA
has started by then).

Workspaces (``common.host_utils.gemv_fused_workspace``): ``part_ws`` fp32 ``[G * 16 * 32]`` (a CTA's tail
partials), ``flags`` int32 ``[G + 2]`` (a flag per CTA, then the barrier's count and generation): ZERO-INITIALIZED
ONCE; every call leaves them so but for the generation, which only grows.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from ..common.host_utils import GEMV_LANE_ACCS, SM90_SMEM_BYTES, gemv_fused_shared_bytes
from ..src import block_quant as bq
from ..src.pair_combine import combine_word, count_in, ld_global_cg_b32, publish_stores, reset_counter
from ..src.warp_ring import cp_async_commit, cp_async_wait
from .gemv import ROW_WARP_ROWS, GemvDequantSm90

#: segment partial-sum buffers in shared memory, reused in turn (``host_utils.gemv_fused_shared_bytes``)
PART_BUFS = 2
#: named barriers: the streaming warps' partials are in buffer b (``BAR_FULL + b``), the service warp has read buffer
#: b (``BAR_FREE + b``), FC2's activation rows are in shared memory (``BAR_GO2``); 0 is the CTA's
BAR_FULL, BAR_FREE, BAR_GO2 = 1, 1 + PART_BUFS, 1 + 2 * PART_BUFS
#: token rows (FC1) and activation rows (FC2) a CTA's range touches at most (while ``T * top_k <= G``)
MAX_ROWS = 2
N_ACC = GEMV_LANE_ACCS


def ld_global_cg_v4(addr: Int64) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """16 bytes at ``addr`` from L2 (``ld.global.cg``: past L1, which other SMs' stores do not update)."""
    return cute.arch.inline_ptx(
        "ld.global.cg.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Uint32, Uint32, Uint32, Uint32],
        read_only_args=[addr],
    )


def _flag(cond) -> Int32:
    """1 where ``cond`` holds, else 0 (flags combined with ``&`` / ``|`` and used as factors)."""
    return Int32(cutlass.select_(cond, Int32(1), Int32(0)))


class _Phase:
    """Trace-time geometry of one phase (FC1 or FC2) and its CTA's range, cut into tail, whole units, head."""

    def __init__(self, gemv: GemvDequantSm90, mW, mS, n_rows: int, k: int, pairs, cta, grid) -> None:
        self.gemv = gemv
        self.mW, self.mS = mW, mS
        self.n_rows = n_rows
        self.k_tiles = mW.shape[1]
        self.row_warps = n_rows // ROW_WARP_ROWS
        self.ku = k // gemv.unit_k  # K units per (pair, row warp)
        per_pair = self.row_warps * self.ku
        total = pairs * per_pair
        s = cta * total // grid
        e = (cta + 1) * total // grid
        ku = self.ku
        nonempty = _flag(s < e)
        us = s // ku
        ue = (e - 1) // ku
        cut_end = _flag(e % ku != 0)
        cut_start = _flag(s % ku != 0)
        # tail: the unit going on past e; head: the unit begun before s and ending here (a range inside one unit
        # is that unit's tail)
        self.has_tail = nonempty & cut_end
        self.has_head = nonempty & cut_start & (_flag(us != ue) | (1 - cut_end))
        t0 = cutlass.max(s, ue * ku)
        f0 = (us + cut_start) * ku
        f1 = cutlass.max((ue + 1 - cut_end) * ku, f0)
        h1 = cutlass.min(e, (us + 1) * ku)
        self.t0 = t0
        self.n0 = self.has_tail * (e - t0)
        self.f0 = f0
        self.n1 = nonempty * (f1 - f0)
        self.h0 = s
        self.n2 = self.has_head * (h1 - s)
        self.items = self.n0 + self.n1 + self.n2
        self.whole_units = self.n1 // ku
        self.segments = self.has_tail + self.whole_units + self.has_head
        self.first_pair = us // self.row_warps
        self.last_pair = ue // self.row_warps
        self.experts = mW.shape[0]
        self.total = total

    def item(self, q):
        """The item at position ``q`` of the CTA's order (tail, whole units, head)."""
        n01 = self.n0 + self.n1
        return cutlass.select_(
            q < self.n0, self.t0 + q, cutlass.select_(q < n01, self.f0 + q - self.n0, self.h0 + q - n01)
        )


class GemvFusedPairSm90:
    """FC1 and FC2 of the GEMV pair chain in one persistent grid (module docstring); compile-time knobs only.
    ``fc1`` / ``fc2`` hold the two stages' conversions, copies and epilogues (``gemv.GemvDequantSm90``)."""

    def __init__(
        self,
        fmt: str,
        activation: str,
        limit: float | None,
        k_warps: int = 8,
        stages: int = 4,
        grid: int = 132,
        prequantized: bool = False,
    ) -> None:
        self.fc1 = GemvDequantSm90(
            fmt, 8, activation, limit, requant=True, k_warps=k_warps, stages=stages, pair_blocks=True,
            gather_x=True, prequantized=prequantized,
        )  # fmt: skip
        self.fc2 = GemvDequantSm90(
            fmt, 8, "plain", None, gscale_index=1, k_warps=k_warps, stages=stages, pair_blocks=True, pair_combine=True,
            gather_x=True,
        )  # fmt: skip
        self.fmt = fmt
        self.k_warps = k_warps
        self.stages = stages
        self.grid = grid
        self.prequantized = prequantized
        self.threads = 32 * (k_warps + 1)  # the streaming warps and the service warp
        self.stage_bytes = self.fc1.tokens_at  # weights and scales only: the token operand is a row in shared memory
        self.ring_bytes = stages * self.stage_bytes

    def launch(
        self,
        x: cute.Tensor,
        x_scale: cute.Tensor,
        topk_ids: cute.Tensor,
        topk_weights: cute.Tensor,
        w13: cute.Tensor,
        w13_scale: cute.Tensor,
        w2: cute.Tensor,
        w2_scale: cute.Tensor,
        w13_gscale: cute.Tensor,
        w2_gscale: cute.Tensor,
        act_gscale: cute.Tensor,
        out: cute.Tensor,
        h_buf: cute.Tensor,
        y_buf: cute.Tensor,
        counters: cute.Tensor,
        part_ws: cute.Tensor,
        flags: cute.Tensor,
        stream,
        use_pdl: bool = True,
    ) -> None:
        hidden = w2.shape[2]
        inter = w2.shape[1] * 64
        n1 = w13.shape[2]
        if n1 % 256 and self.fc1.gated or n1 % ROW_WARP_ROWS or hidden % ROW_WARP_ROWS:
            raise ValueError(f"gemv_fused: FC1 N={n1} must divide by 256 (gated) or 64, H={hidden} by 64")
        unit = self.fc1.unit_k
        if hidden % unit or inter % unit:
            raise ValueError(f"gemv_fused ({self.fmt}): H={hidden} and I={inter} must be multiples of {unit}")
        smem = gemv_fused_shared_bytes(self.k_warps, self.stages, hidden, inter)
        if smem > SM90_SMEM_BYTES:
            raise ValueError(
                f"gemv_fused needs {smem} bytes of shared memory with {self.k_warps} warps of {self.stages} stages at "
                f"H={hidden}, I={inter} (at most {SM90_SMEM_BYTES}): fewer warps or stages"
            )
        self.fc1.k = hidden
        self.fc2.k = inter
        self.kernel(
            x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, w13_gscale, w2_gscale, act_gscale, out,
            h_buf, y_buf, counters, part_ws, flags, hidden, inter,
        ).launch(
            grid=[self.grid, 1, 1],
            block=[self.threads, 1, 1],
            stream=stream,
            use_pdl=use_pdl,
            min_blocks_per_mp=1,  # one CTA an SM: its warps may take the whole register file
        )  # fmt: skip

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mXs: cute.Tensor,
        topk_ids: cute.Tensor,
        topk_weights: cute.Tensor,
        mW1: cute.Tensor,
        mS1: cute.Tensor,
        mW2: cute.Tensor,
        mS2: cute.Tensor,
        w13_gscale: cute.Tensor,
        w2_gscale: cute.Tensor,
        act_gscale: cute.Tensor,
        mOut: cute.Tensor,
        mH: cute.Tensor,
        mY: cute.Tensor,
        counters: cute.Tensor,
        part_ws: cute.Tensor,
        flags: cute.Tensor,
        hidden: cutlass.Constexpr,
        inter: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        kw = self.k_warps
        smem = cutlass.utils.SmemAllocator()
        ring = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(kw * self.ring_bytes), 128)
        ring_base = bq.smem_addr(ring.iterator) + warp * self.ring_bytes
        parts = smem.allocate_tensor(
            Float32, cute.make_layout((PART_BUFS, kw, N_ACC, 32), stride=(kw * N_ACC * 32, N_ACC * 32, 32, 1)), 16
        )
        x_rows = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout(MAX_ROWS * hidden), 16)
        a_rows = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout(MAX_ROWS * inter), 16)

        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # after the wait: every CTA of this grid has started

        top_k = topk_ids.shape[1]
        pairs = topk_ids.shape[0] * top_k
        grid = self.grid
        # the phases' geometry on self: the DSL carries no Python object through a run-time if or loop
        self._phases = (
            _Phase(self.fc1, mW1, mS1, mW1.shape[2], hidden, pairs, cta, grid),
            _Phase(self.fc2, mW2, mS2, hidden, inter, pairs, cta, grid),
        )
        fc1, fc2 = self._phases
        mine1 = cutlass.max(fc1.items - warp + kw - 1, 0) // kw  # a streaming warp's items of each phase
        mine2 = cutlass.max(fc2.items - warp + kw - 1, 0) // kw
        steps = mine1 + mine2
        tok_lo = fc1.first_pair // top_k
        tok_hi = fc1.last_pair // top_k
        x_base = bq.smem_addr(x_rows.iterator)
        a_base = bq.smem_addr(a_rows.iterator)
        pair_lo = fc2.first_pair
        pair_hi = fc2.last_pair

        if warp < kw:
            # The ring's first stages - 1 items (FC2's too where FC1 has fewer): one cp.async group each.
            for j in cutlass.range_constexpr(self.stages - 1):
                self._copy_step(Int32(j), steps, mine1, topk_ids, ring_base, warp, lane)
                cp_async_commit()
            # FC1's token rows (its pairs' tokens), prepared while those weights stream in.
            if fc1.items > 0:
                for r in cutlass.range_constexpr(MAX_ROWS):
                    tok = tok_lo + r
                    if tok <= tok_hi:
                        row = cute.make_tensor(
                            x_rows.iterator + r * hidden, cute.make_layout((1, hidden), stride=(hidden, 1))
                        )
                        self.fc1._prepare_token_row(mX, mXs, act_gscale, tok, row, warp, lane)
        cute.arch.barrier()  # the token rows are in shared memory

        if warp < kw:
            acc = cute.make_rmem_tensor(((2, 2, 1), 4, 1), Float32)
            acc.fill(0.0)
            step, seg = self._stream(0, Int32(0), Int32(0), steps, mine1, acc, parts, ring_base, x_base, tok_lo,
                                     hidden, topk_ids, warp, lane)  # fmt: skip
            cute.arch.barrier(barrier_id=BAR_GO2, number_of_threads=self.threads)  # FC2's activation rows are in
            step, seg = self._stream(1, step, seg, steps, mine1, acc, parts, ring_base, a_base, pair_lo, inter,
                                     topk_ids, warp, lane)  # fmt: skip
            # the service warp's last two "buffer free" arrivals (no segment reuses those buffers)
            for b in cutlass.range_constexpr(PART_BUFS):
                if seg > b:
                    cute.arch.barrier(barrier_id=BAR_FREE + b, number_of_threads=self.threads)
            cp_async_wait(0)
        else:
            seg = self._serve(0, Int32(0), parts, topk_ids, topk_weights, w13_gscale, act_gscale, mH, mOut, counters,
                              part_ws, flags, cta, lane)  # fmt: skip
            self._grid_barrier(flags, lane)
            # FC2's activation rows (FC1's outputs of its pairs, in L2) into shared memory, then the streaming
            # warps go on
            if fc2.items > 0:
                chunks = (pair_hi - pair_lo + 1) * (inter * 2 // 16)
                per_row = inter * 2 // 16
                h_base = mH.iterator.toint()
                for c in cutlass.range(lane, chunks, 32, unroll=1):
                    r = c // per_row
                    src = h_base + (Int64(pair_lo + r) * 8 * inter) * 2 + (c - r * per_row) * 16
                    w = ld_global_cg_v4(src)
                    bq.st_shared_v4(a_base + c * 16, w[0], w[1], w[2], w[3])
            cute.arch.barrier_arrive(barrier_id=BAR_GO2, number_of_threads=self.threads)
            seg = self._serve(1, seg, parts, topk_ids, topk_weights, w2_gscale, act_gscale, mY, mOut, counters,
                              part_ws, flags, cta, lane)  # fmt: skip

    @cute.jit
    def _copy_step(self, i, steps, mine1, topk_ids, ring_base, warp, lane) -> None:
        """The weight copies of this warp's step ``i`` (FC1's items first, then FC2's) into ring stage
        ``i % stages``; none past the warp's last step (the caller still commits a group)."""
        stage = ring_base + (i % self.stages) * self.stage_bytes
        if i < steps:
            if i < mine1:
                self._copy_item(self._phases[0], warp + i * self.k_warps, topk_ids, stage, lane)
            else:
                self._copy_item(self._phases[1], warp + (i - mine1) * self.k_warps, topk_ids, stage, lane)

    def _copy_item(self, ph: _Phase, q, topk_ids, stage, lane) -> None:
        """The weight copies of the item at position ``q`` of the phase's order into ring stage ``stage``."""
        item = ph.item(q)
        unit = item // ph.ku
        pair = unit // ph.row_warps
        row_warp = unit - pair * ph.row_warps
        top_k = topk_ids.shape[1]
        expert = topk_ids[pair // top_k, pair % top_k]
        offsets = ph.gemv._row_offsets(row_warp, lane)
        ph.gemv._copy_weights(
            stage, ph.mW, ph.mS, expert, item - unit * ph.ku, True, ph.k_tiles, ph.n_rows, offsets, lane
        )

    def _segment(self, which: int, si):
        """Segment ``si`` of the phase: (is tail, is head, its positions [qs, qe) in the CTA's order, its unit)."""
        ph = self._phases[which]
        is_tail = (ph.has_tail == 1) & (si == 0)
        is_head = (ph.has_head == 1) & (si == ph.segments - 1)
        whole = si - ph.has_tail
        qs = cutlass.select_(is_tail, 0, cutlass.select_(is_head, ph.n0 + ph.n1, ph.n0 + whole * ph.ku))
        qe = cutlass.select_(is_tail, ph.n0, cutlass.select_(is_head, ph.items, qs + ph.ku))
        return is_tail, is_head, qs, qe, ph.item(qs) // ph.ku

    @cute.jit
    def _stream(
        self,
        which: cutlass.Constexpr,
        step,
        seg,
        steps,
        mine1,
        acc,
        parts,
        ring_base,
        rows_base,
        row_lo,
        row_len: cutlass.Constexpr,
        topk_ids,
        warp,
        lane,
    ):
        """A streaming warp's items of one phase, segment by segment: the MMAs, then its partial sums into buffer
        ``seg % PART_BUFS`` for the service warp (``BAR_FULL``), once the service warp is done with that buffer's
        previous segment (``BAR_FREE``). No fence: the warp's ring stays in flight. Returns the step and segment
        counts."""
        kw = self.k_warps
        top_k = topk_ids.shape[1]
        for si in cutlass.range(self._phases[which].segments, unroll=1):
            _, _, qs, qe, unit = self._segment(which, si)
            pair = unit // self._phases[which].row_warps
            row = (pair // top_k - row_lo) if which == 0 else (pair - row_lo)
            row_addr = rows_base + row * (row_len * 2)
            first = qs + (warp - qs % kw + kw) % kw  # this warp's first position in the segment
            for q in cutlass.range(first, qe, kw, unroll=1):
                self._copy_step(step + self.stages - 1, steps, mine1, topk_ids, ring_base, warp, lane)
                cp_async_commit()
                cp_async_wait(self.stages - 1)  # this step's group (and every one before) has landed
                ku = self._phases[which].item(q) - unit * self._phases[which].ku
                self._item_mma(
                    self._phases[which].gemv, acc, ring_base + (step % self.stages) * self.stage_bytes, lane,
                    row_addr, ku,
                )  # fmt: skip
                step = step + 1
            buf = seg % PART_BUFS
            if seg >= PART_BUFS:  # the service warp has read this buffer's previous segment
                cute.arch.barrier(barrier_id=BAR_FREE + buf, number_of_threads=self.threads)
            for r in cutlass.range_constexpr(N_ACC):
                parts[buf, warp, r, lane] = acc[r]
                acc[r] = Float32(0.0)
            cute.arch.barrier_arrive(barrier_id=BAR_FULL + buf, number_of_threads=self.threads)
            seg = seg + 1
        return step, seg

    @cute.jit
    def _serve(
        self,
        which: cutlass.Constexpr,
        seg,
        parts,
        topk_ids,
        topk_weights,
        w_gscale,
        act_gscale,
        mC,
        mOut,
        counters,
        part_ws,
        flags,
        cta,
        lane,
    ):
        """The service warp, segment by segment: the streaming warps' partial sums added in warp order
        (``BAR_FULL``, then ``BAR_FREE``); a tail's published for the next CTA, a whole unit's or a head's (with
        the earlier CTAs' partials) through ``gemv``'s epilogue (FC2: and ``pair_combine``'s count and combine).
        Returns the segment count."""
        kw = self.k_warps
        top_k = topk_ids.shape[1]
        acc = cute.make_rmem_tensor(((2, 2, 1), 4, 1), Float32)
        for si in cutlass.range(self._phases[which].segments, unroll=1):
            is_tail, is_head, _, _, unit = self._segment(which, si)
            row_warps = self._phases[which].row_warps
            pair = unit // row_warps
            row_warp = unit - pair * row_warps
            buf = seg % PART_BUFS
            cute.arch.barrier(barrier_id=BAR_FULL + buf, number_of_threads=self.threads)
            for r in cutlass.range_constexpr(N_ACC):
                v = parts[buf, 0, r, lane]
                for w in cutlass.range_constexpr(1, kw):
                    v = v + parts[buf, w, r, lane]
                acc[r] = v
            cute.arch.barrier_arrive(barrier_id=BAR_FREE + buf, number_of_threads=self.threads)
            if is_tail:
                self._publish_partial(acc, part_ws, flags, cta, lane)
            else:
                if is_head:
                    self._gather_partials(acc, part_ws, flags, which, unit, cta, lane)
                gemv = self._phases[which].gemv
                expert = topk_ids[pair // top_k, pair % top_k]
                alpha = gemv._alpha(expert, w_gscale, act_gscale)
                out_gs = gemv._out_gscale(act_gscale)
                gemv._epilogue(acc, mC, pair, 0, 0, row_warp, lane, 1, alpha, out_gs, None)
                if cutlass.const_expr(which == 1):  # pair_combine: the token's last unit of the row warp sums
                    tok = pair // top_k
                    publish_stores()
                    experts = self._phases[which].experts
                    counter = (counters.iterator + experts + 1 + tok * row_warps + row_warp).llvm_ptr
                    if count_in(counter, top_k):
                        reset_counter(counter)
                        col = row_warp * ROW_WARP_ROWS + 2 * lane
                        combine_word(mC.iterator.toint(), mOut, mOut.shape[1], topk_weights, tok, top_k, 8, col)
            seg = seg + 1
        return seg

    @cute.jit
    def _item_mma(self, gemv: GemvDequantSm90, acc, stage, lane, row_addr, ku) -> None:
        """The MMAs of one item: its weights in ring stage ``stage``, the token fragments of K unit ``ku`` from the
        BF16 row at ``row_addr`` (``gemv``'s ``gather_x`` order: every token column the same row)."""
        q = lane & 3
        byte_shift = Uint32((2 * ((lane >> 2) & 1) + (q >> 1)) * 8)  # MXFP8: the lane's scale byte
        elem = ku * gemv.unit_k + q * (8 * gemv.x_chunks)
        row = row_addr + elem * 2
        x = [list(bq.ld_shared_v4(row + 16 * ch)) for ch in range(gemv.x_chunks)]
        for a in cutlass.range_constexpr(gemv.atoms):
            rows = []
            for h in cutlass.range_constexpr(2):
                r = 2 * a + h
                words = list(bq.ld_shared_v4(stage + r * 512 + lane * 16))
                scale = bq.ld_shared_b32(stage + gemv.scales_at + r * 128 + lane * 4)
                if cutlass.const_expr(gemv.fmt == "mxfp8"):
                    scale = (scale >> byte_shift) & Uint32(0xFF)
                rows.append((words, scale))
            gemv._atom_mma(acc, rows[0], rows[1], x, 0, a, q)

    @cute.jit
    def _publish_partial(self, acc, part_ws, flags, cta, lane) -> None:
        """The tail's summed partials -> ``part_ws`` row ``cta`` (lane-major), then its flag (release)."""
        base = cta * (N_ACC * 32)
        for r in cutlass.range_constexpr(N_ACC):
            part_ws[base + r * 32 + lane] = acc[r]
        publish_stores()
        if lane == 0:
            cute.arch.store((flags.iterator + cta).llvm_ptr, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def _gather_partials(self, acc, part_ws, flags, which: cutlass.Constexpr, unit, cta, lane) -> None:
        """The head: the earlier CTAs' partials of ``unit`` (each their tail) added to this CTA's own (``acc``) in CTA
        order. Each flag is zeroed again once read."""
        ku, total = self._phases[which].ku, self._phases[which].total
        first_item = unit * ku
        c0 = first_item * self.grid // total  # the CTA whose range holds the unit's first item
        if (c0 + 1) * total // self.grid <= first_item:
            c0 = c0 + 1
        pw = part_ws.iterator.toint()
        for c in cutlass.range(c0, cta, unroll=1):
            if (c + 1) * total // self.grid > c * total // self.grid:  # a CTA of no items publishes nothing
                flag = (flags.iterator + c).llvm_ptr
                if lane == 0:
                    v = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
                    while v == 0:
                        v = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
                    cute.arch.store(flag, Int32(0))
                cute.arch.sync_warp()
                cute.arch.fence_acq_rel_gpu()
                for r in cutlass.range_constexpr(N_ACC):
                    word = ld_global_cg_b32(pw + (Int64(c) * (N_ACC * 32) + r * 32 + lane) * 4)
                    acc[r] = acc[r] + bq.f32_from_bits(Uint32(word))

    @cute.jit
    def _grid_barrier(self, flags, lane) -> None:
        """The service warp, once every FC1 epilogue of its CTA is stored: every CTA's FC1 stores before any CTA's
        FC2 reads. A counter (``flags[G]``, zeroed again by the last arrival) and a generation (``flags[G + 1]``)
        that the last arrival advances; only this warp stores to global memory, so only it fences."""
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_warp()
        if lane == 0:
            count = (flags.iterator + self.grid).llvm_ptr
            gen_ptr = (flags.iterator + self.grid + 1).llvm_ptr
            gen = cute.arch.load(gen_ptr, Int32, sem="acquire", scope="gpu")
            arrived = cute.arch.atomic_add(count, Int32(1), sem="acq_rel", scope="gpu")
            if arrived == self.grid - 1:
                cute.arch.store(count, Int32(0))
                cute.arch.atomic_add(gen_ptr, Int32(1), sem="release", scope="gpu")
            else:
                now = cute.arch.load(gen_ptr, Int32, sem="acquire", scope="gpu")
                while now == gen:
                    now = cute.arch.load(gen_ptr, Int32, sem="acquire", scope="gpu")
        cute.arch.sync_warp()
        cute.arch.fence_acq_rel_gpu()
