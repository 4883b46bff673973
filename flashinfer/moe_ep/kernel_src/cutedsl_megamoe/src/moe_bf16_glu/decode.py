"""Fused decode kernel: the whole BF16 MoE layer for a few tokens in one launch.

Not a default (TUNING.md, sessions 25-26): at T = 1 the chain of four kernels (``kernel.py``: routing,
FC1, FC2, combine) loses time between the kernels (ramp-up, drain, the wait for the last CTA of the
kernel before), so this kernel does the whole layer in one persistent grid (``num_sms`` CTAs of
``warps`` warps, all co-resident: launched as a cooperative grid, so the driver guarantees that, even
beside kernels on other streams; drop v40). Measured on H200 (drops v39-v40) it ties with the chain per
layer in CUDA graphs at T = 1-4 on the bench contracts (single-call graphs 0.96-1.06x the chain's time;
T = 16 1.1-1.2x); eager calls back to back were even or faster in three runs (one launch instead of
four: qwen3-30b-a3b T = 1 31-34 against 32-42 us per layer), a lone eager call either way (host-bound).
Both stream the weights at about 3.5 TB/s where the layer is all streaming (deepseek-v3 T = 1).
Autotune times it in the ``single`` token bucket. The steps:

1. routing, in every CTA from ``topk_ids`` (at most ``DECODE_MAX_PAIRS`` pairs, one thread each): the
   pairs grouped by expert in expert order, at most 8 pairs a group (one MMA's token columns); for one
   token each pair is its own group, in k order (no grouping: one read and one CTA barrier; session 29:
   outputs bitwise those of the grouping, the layer 1-4 % faster at T = 1);
2. FC1 as a GEMV: work unit = (group, 16 weight rows), its K steps split over ``k_warps`` warps of a
   CTA (all of them by default; their partial sums meet in shared memory, added in warp order); unit j
   goes to CTA j % G first (every SM streams); gated activations take the gate rows of 8 features and
   their up rows (the interleaved layout of ``weights.interleave_gate_up``), so the activation pairs up
   in-thread; ``bf16(act)`` goes to ``h_buf`` at row = pair index;
3. a grid barrier on the two words ``meta[2:4]`` (zero on entry and left zero): each CTA arrives with a
   reduction that awaits no reply, then fills its FC2 ring, then watches the arrival count; it counts
   itself out at its very end, and the last CTA out zeroes both words;
4. FC2 and the combine: CTA round = one output block (token, 16 rows of H), blocks dealt over the
   CTAs; warp (kk, sp) multiplies pairs k = kk, kk + kw, ... (kw = min(top_k, warps)) with ``w2[e]``'s
   16 rows over part sp of I (the warps left over per pair split its K loop); the parts meet in shared
   memory, and 16 threads sum them, round ``y = bf16(acc)``, weight it and sum over k in order
   (deterministic: no atomics on data), storing ``out[t]``'s 16 values.

Every warp streams its weights through a ring of its own (``src.warp_ring``): per 64-K step the warp
copies its 16 weight rows with four ``cp.async`` instructions of 4 rows x 128 bytes (whole 32-byte
sectors: lane-interleaved 16-byte halves of sectors streamed at half the rate) and its token columns;
a ``sync_warp`` after the wait makes the rows visible to every lane. Inside the step the K order is
relabeled so that a lane's 32 bytes of a row (elements ``16 q .. 16 q + 15``, q = lane % 4) are exactly
its fragments of the four ``mma.sync`` m16n8k16 (words ``2 s`` and ``2 s + 1`` for MMA s): no shuffles,
no ``ldmatrix``. The steps of successive units run back to back through the ring (no refill bubble
between units). FC1's stages hold 8 token columns (each lane 32 bytes of its own); FC2's, cut from the
same bytes, only the pair's h column (lanes 0-3), so more of them fit, and the whole FC2 ring is filled
with weight rows before the grid barrier (they do not depend on FC1): a CTA that finishes FC1 early
streams FC2's weights while the others finish theirs.

T is symbolic; the host must keep ``T * top_k <= DECODE_MAX_PAIRS`` (past it the kernel returns
without writing ``out``). Weight bytes are read once per group (FC1) and once per token (FC2): meant
for a few tokens (the ``single`` token bucket).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from ..common import constants
from ..common.host_utils import SM90_SMEM_BYTES, decode_shared_bytes
from ..src import activations
from ..src import block_quant as bq
from ..src.warp_ring import (
    bf16_round,
    cp_async,
    cp_async_commit,
    cp_async_wait,
    mma_bf16_16816,
    red_add_gpu,
    st_global_bf16,
)

DECODE_MAX_PAIRS = constants.DECODE_MAX_PAIRS
DECODE_WARPS = constants.DECODE_WARPS
GROUP_PAIRS = constants.DECODE_GROUP_PAIRS
STAGE_BYTES = constants.DECODE_STAGE_BYTES
ATOM_ROWS = 16  # weight rows per warp unit (one MMA atom)
STEP_K = 64  # K elements per ring step
_TOKENS_AT = 2 * 1024  # the token chunks in a stage, after the two weight rows
# FC2's ring: the same bytes as FC1's, cut into stages of the 16 weight rows and the pair's h column (lanes
# 0-3 of token column 0, 32 bytes each): more of FC2's steps fit than in FC1's stages of 8 token columns.
FC2_STAGE_BYTES = _TOKENS_AT + 4 * 32


def _row_slot(r, chunk):
    """Byte offset in a ring stage of 16-byte chunk ``chunk`` (0-7) of weight row ``r`` (0-15): rows of
    128 bytes, odd rows' chunks swapped in pairs so that lanes reading chunk 2q of rows i and i + 1 hit
    different banks."""
    return r * 128 + ((chunk ^ (r & 1)) << 4)


def _groups_of(pairs):
    """FC1 groups of an expert with ``pairs`` pairs (at most GROUP_PAIRS a group)."""
    return (pairs + GROUP_PAIRS - 1) // GROUP_PAIRS


#: the grid barrier's words in ``meta`` (the routing kernel of the chain writes only meta[0:2])
META_BARRIER_ARRIVE = 2
META_BARRIER_LEAVE = 3


class FusedDecodeSm90:
    """Compile-time knobs of the fused decode kernel (see the module docstring).

    :param fc1_layout_tile_n: the N tile of w13's layout (gate/up interleaved per tile; with
        ``fc1_tiled`` each (tile x 64) block contiguous).
    """

    def __init__(
        self,
        activation: str,
        limit: float | None,
        num_sms: int,
        fc1_layout_tile_n: int,
        fc1_tiled: bool,
        warps: int = 16,
        stages: int = 4,
        k_warps: int | None = None,
    ) -> None:
        if warps not in DECODE_WARPS:
            raise ValueError(f"the fused decode kernel takes {DECODE_WARPS} warps per CTA, got {warps}")
        if stages < 2:
            raise ValueError(f"the fused decode kernel's rings need 2 stages at least, got {stages}")
        if k_warps is None:
            k_warps = warps  # measured fastest (TUNING.md, session 26): every FC1 unit on the whole CTA
        if k_warps not in constants.DECODE_K_WARPS or k_warps > warps:
            raise ValueError(
                f"FC1 units take {constants.DECODE_K_WARPS} warps each, at most the CTA's {warps}; "
                f"got k_warps={k_warps}"
            )
        self.activation = activation
        self.gated = activation in constants.GATED_ACTIVATIONS
        self.limit = limit
        self.num_sms = num_sms
        self.tn = fc1_layout_tile_n
        self.fc1_tiled = fc1_tiled
        self.warps = warps
        self.stages = stages
        self.k_warps = k_warps

    def launch(self, x, topk_ids, topk_weights, w13, w2, out, h_buf, meta, stream, use_pdl: bool) -> None:
        """Trace-time: one launch of ``num_sms`` CTAs (w13 as prepared: [E, N1, H] or tiled 5-D)."""
        smem = decode_shared_bytes(self.warps, self.stages, topk_ids.shape[1])
        if smem > SM90_SMEM_BYTES:
            raise ValueError(f"{self.warps} warps with {self.stages}-stage rings need {smem} bytes of shared memory")
        self.kernel(x, topk_ids, topk_weights, w13, w2, out, h_buf, meta).launch(
            grid=[self.num_sms, 1, 1],
            block=[32 * self.warps, 1, 1],
            stream=stream,
            use_pdl=use_pdl,
            cooperative=True,  # every CTA resident at once (the grid barrier), by the driver's guarantee
        )

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,  # (T, H) bf16
        topk_ids: cute.Tensor,  # (T, K) int32
        topk_weights: cute.Tensor,  # (T, K) fp32
        mW13: cute.Tensor,
        mW2: cute.Tensor,  # (E, H, I) bf16
        mOut: cute.Tensor,  # (T, H) bf16
        mH: cute.Tensor,  # (>= T * K, I) bf16
        meta: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        W = self.warps
        S = self.stages
        G = self.num_sms
        num_tokens = topk_ids.shape[0]
        top_k = topk_ids.shape[1]
        hidden = mX.shape[1]
        inter = mW2.shape[2]
        n1 = 2 * inter if self.gated else inter
        num_pairs = num_tokens * top_k

        smem = cutlass.utils.SmemAllocator()
        s_ids = smem.allocate_tensor(Int32, cute.make_layout(DECODE_MAX_PAIRS), 16)
        s_first = smem.allocate_tensor(Int32, cute.make_layout(DECODE_MAX_PAIRS), 16)
        s_cnt = smem.allocate_tensor(Int32, cute.make_layout(DECODE_MAX_PAIRS), 16)
        s_gexp = smem.allocate_tensor(Int32, cute.make_layout(DECODE_MAX_PAIRS), 16)
        s_gcnt = smem.allocate_tensor(Int32, cute.make_layout(DECODE_MAX_PAIRS), 16)
        s_gpair = smem.allocate_tensor(Int32, cute.make_layout(DECODE_MAX_PAIRS * GROUP_PAIRS), 16)
        s_fc1p = smem.allocate_tensor(Float32, cute.make_layout((W, 4, 32), stride=(128, 32, 1)), 16)
        nsp = self.ksplit(topk_ids.shape[1])
        part_layout = cute.make_layout((topk_ids.shape[1], nsp, ATOM_ROWS), stride=(nsp * ATOM_ROWS, ATOM_ROWS, 1))
        s_part = smem.allocate_tensor(Float32, part_layout, 16)
        ring = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(W * S * STAGE_BYTES), 128)
        ring_base = bq.smem_addr(ring.iterator) + warp * (S * STAGE_BYTES)

        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()  # x and topk_ids come from the kernels before

        if num_pairs <= DECODE_MAX_PAIRS:
            # ---- 1. routing: pair p -> (group, slot); groups in expert order, 8 pairs at most each. One token:
            # each pair is a group of its own, in k order (its experts are distinct, and a repeated one is only
            # computed twice): no grouping, one barrier
            ids_flat = cute.make_tensor(topk_ids.iterator, cute.make_layout(num_pairs))
            num_groups = Int32(0)
            if num_tokens == 1:
                if tidx < num_pairs:
                    e_one = ids_flat[tidx]
                    s_ids[tidx] = e_one
                    s_gexp[tidx] = e_one
                    s_gcnt[tidx] = 1
                    s_gpair[tidx * GROUP_PAIRS] = tidx
                num_groups = num_pairs
                cute.arch.barrier()
            else:
                if tidx < num_pairs:
                    s_ids[tidx] = ids_flat[tidx]
                cute.arch.barrier()
                if tidx < num_pairs:
                    e = s_ids[tidx]
                    first = Int32(1)
                    count = Int32(0)
                    for q in cutlass.range(num_pairs, unroll=1):
                        same = s_ids[q] == e
                        if same:
                            count = count + 1
                            if q < tidx:
                                first = Int32(0)
                    s_first[tidx] = first
                    s_cnt[tidx] = count
                cute.arch.barrier()
                for q in cutlass.range(num_pairs, unroll=1):
                    if s_first[q] != 0:
                        num_groups = num_groups + _groups_of(s_cnt[q])
                cute.arch.barrier()
                if tidx < num_pairs:
                    e = s_ids[tidx]
                    base = Int32(0)
                    slot = Int32(0)
                    total = Int32(0)
                    for q in cutlass.range(num_pairs, unroll=1):
                        eq = s_ids[q]
                        if s_first[q] != 0 and eq < e:
                            base = base + _groups_of(s_cnt[q])
                        if eq == e:
                            if q < tidx:
                                slot = slot + 1
                            if s_first[q] != 0:
                                total = s_cnt[q]
                    g = base + slot // GROUP_PAIRS
                    s_gpair[g * GROUP_PAIRS + slot % GROUP_PAIRS] = tidx
                    if slot % GROUP_PAIRS == 0:
                        s_gexp[g] = e
                        s_gcnt[g] = cutlass.min(total - slot, GROUP_PAIRS)
                cute.arch.barrier()

            # ---- 2. FC1: units (group, 16 rows), each on ``k_warps`` warps of a CTA splitting its K steps;
            # unit j -> CTA j % G first (every SM streams), then the CTA's next slot of k_warps warps
            acc = cute.make_rmem_tensor((4,), Float32)
            acc.fill(0.0)
            kf = self.k_warps
            nk1 = hidden // STEP_K
            spu = (nk1 + kf - 1) // kf  # K steps of a unit per warp
            upg = n1 // ATOM_ROWS  # units per group
            slot = warp // kf
            part = warp - slot * kf
            gs = slot * G + cta
            gsn = G * (W // kf)
            units = num_groups * upg
            my_units = cutlass.max(units - gs + gsn - 1, 0) // gsn
            steps1 = (cutlass.max(units - cta + gsn - 1, 0) // gsn) * spu  # slot 0's: the same in every warp
            for j in cutlass.range_constexpr(S - 1):
                self._fc1_copy(ring_base + j * STAGE_BYTES, j, j < steps1, gs, gsn, spu, part, my_units, nk1, upg,
                               hidden, s_gexp, s_gcnt, s_gpair, mX, mW13, top_k, n1, lane)  # fmt: skip
                cp_async_commit()
            for i in cutlass.range(steps1, unroll=1):
                nxt = i + S - 1
                self._fc1_copy(ring_base + (nxt % S) * STAGE_BYTES, nxt, nxt < steps1, gs, gsn, spu, part, my_units,
                               nk1, upg, hidden, s_gexp, s_gcnt, s_gpair, mX, mW13, top_k, n1, lane)  # fmt: skip
                cp_async_commit()
                cp_async_wait(S - 1)
                cute.arch.sync_warp()  # the stage's rows were copied by the warp's lanes
                self._mma_step(acc, ring_base + (i % S) * STAGE_BYTES, lane)
                cute.arch.sync_warp()  # every lane's reads are done before the stage is refilled
                m = i // spu
                if i - m * spu == spu - 1:  # the unit's last step: K parts summed in order, activation, h rows
                    if cutlass.const_expr(kf > 1):
                        for r in cutlass.range_constexpr(4):
                            s_fc1p[warp, r, lane] = acc[r]
                        cute.arch.barrier()
                    if part == 0 and m < my_units:
                        if cutlass.const_expr(kf > 1):
                            for r in cutlass.range_constexpr(4):
                                v = s_fc1p[warp, r, lane]
                                for pp in cutlass.range_constexpr(1, kf):
                                    v = v + s_fc1p[warp + pp, r, lane]
                                acc[r] = v
                        unit = gs + m * gsn
                        g = unit // upg
                        a = unit - g * upg
                        cnt = s_gcnt[g]
                        for v0 in cutlass.range_constexpr(2):
                            col = 2 * (lane & 3) + v0
                            if col < cnt:
                                p = s_gpair[g * GROUP_PAIRS + col]
                                self._fc1_store(acc, v0, mH, p, a, inter, lane)
                    acc.fill(0.0)
                    if cutlass.const_expr(kf > 1):
                        cute.arch.barrier()  # the partials are read before the next unit's overwrite them
            cp_async_wait(0)  # the ring is free (the token copies past the end wrote zeros)

            # ---- 3a. arrive at the grid barrier: the CTA's h rows are written. Thread 0's fence comes before any
            # FC2 copy is in flight (it would wait for those too); the arrival waits for no reply.
            cute.arch.barrier()
            if tidx == 0:
                cute.arch.fence_acq_rel_gpu()
                red_add_gpu((meta.iterator + META_BARRIER_ARRIVE).toint(), Int32(1))

            # ---- FC2's ring filled before the barrier (weights do not depend on FC1)
            # CTA round m: output block (token, 16 rows of H) cta + m * G; warp (kk, sp) multiplies pairs
            # k = kk, kk + kw, ... over K steps [sp * sps, (sp + 1) * sps) of I.
            hb = hidden // ATOM_ROWS
            nk2 = inter // STEP_K
            sps = (nk2 + self.ksplit(top_k) - 1) // self.ksplit(top_k)
            per_rnd_steps = self.pairs_per_warp(top_k) * sps
            blocks = num_tokens * hb
            my_rounds = cutlass.max(blocks - cta + G - 1, 0) // G
            steps2 = my_rounds * per_rnd_steps
            kk = warp % self.kw(top_k)
            sp = warp // self.kw(top_k)
            S2 = self.fc2_stages
            for j in cutlass.range_constexpr(S2):  # the whole ring: nothing is consumed before the barrier
                self._fc2_copy_w(ring_base + j * FC2_STAGE_BYTES, j, j < steps2, cta, kk, sp,
                                 per_rnd_steps, sps, nk2, hb, s_ids, mW2, top_k, lane)  # fmt: skip

            # ---- 3b. wait at the grid barrier until every CTA arrived: watch the count itself (no flag set by
            # the last CTA: one trip through L2 less)
            if tidx == 0:
                arrive = (meta.iterator + META_BARRIER_ARRIVE).llvm_ptr
                seen = cute.arch.load(arrive, Int32, sem="acquire", scope="gpu")
                while seen < G:
                    seen = cute.arch.load(arrive, Int32, sem="acquire", scope="gpu")
            cute.arch.barrier()

            # ---- 4. FC2 + combine
            for j in cutlass.range_constexpr(S2):  # the h columns of the stages filled before the barrier
                self._fc2_copy_h(ring_base + j * FC2_STAGE_BYTES, j, j < steps2, cta, kk, sp, per_rnd_steps, sps,
                                 nk2, hb, mH, top_k, inter, lane)  # fmt: skip
                cp_async_commit()
            stage2 = Int32(0)
            for i in cutlass.range(steps2, unroll=1):
                cur = ring_base + stage2 * FC2_STAGE_BYTES
                cp_async_wait(S2 - 1)  # step i's group (S2 + i groups committed so far)
                cute.arch.sync_warp()  # the stage's rows were copied by the warp's lanes
                self._mma_step(acc, cur, lane, fc2=True)  # zeros past the pair's work
                cute.arch.sync_warp()  # every lane's reads are done before the stage is refilled
                nxt = i + S2
                self._fc2_copy_w(cur, nxt, nxt < steps2, cta, kk, sp, per_rnd_steps, sps, nk2,
                                 hb, s_ids, mW2, top_k, lane)  # fmt: skip
                self._fc2_copy_h(cur, nxt, nxt < steps2, cta, kk, sp, per_rnd_steps, sps, nk2, hb, mH, top_k,
                                 inter, lane)  # fmt: skip
                cp_async_commit()
                stage2 = stage2 + 1
                if stage2 == S2:
                    stage2 = Int32(0)
                m = i // per_rnd_steps
                r = i - m * per_rnd_steps
                jj = r // sps
                if r - jj * sps == sps - 1:  # this warp's part of pair k is summed: to shared memory
                    k = kk + jj * self.kw(top_k)
                    if sp < self.ksplit(top_k) and k < top_k and lane & 3 == 0:
                        s_part[k, sp, lane >> 2] = acc[0]
                        s_part[k, sp, (lane >> 2) + 8] = acc[2]
                    acc.fill(0.0)
                    if jj == self.pairs_per_warp(top_k) - 1:  # the round's last step: y, weights, k sum
                        cute.arch.barrier()
                        if tidx < ATOM_ROWS:
                            ob = cta + m * G
                            t_o = ob // hb
                            total = Float32(0.0)
                            for k2 in cutlass.range_constexpr(top_k):
                                y = Float32(0.0)
                                for p2 in cutlass.range_constexpr(self.ksplit(top_k)):
                                    y = y + s_part[k2, p2, tidx]
                                total = total + topk_weights[t_o, k2] * bf16_round(y)
                            col = (ob - t_o * hb) * ATOM_ROWS + tidx
                            st_global_bf16(mOut.iterator.toint() + (Int64(t_o) * hidden + col) * 2, total)
                        cute.arch.barrier()
            cp_async_wait(0)
            # ---- 5. leave the grid barrier (off the critical path: after this CTA's work): every CTA counts
            # itself out once it saw the arrivals complete; the last one out zeroes both words (no CTA polls any
            # more, and the next launch waits for this grid)
            if tidx == 0:
                arrive = (meta.iterator + META_BARRIER_ARRIVE).llvm_ptr
                leave = (meta.iterator + META_BARRIER_LEAVE).llvm_ptr
                left = cute.arch.atomic_add(leave, Int32(1), sem="relaxed", scope="gpu")
                if left == G - 1:
                    cute.arch.store(arrive, Int32(0), sem="relaxed", scope="gpu")
                    cute.arch.store(leave, Int32(0), sem="relaxed", scope="gpu")

    # ---------------------------------------------------------------- helpers (straight-line code)
    def _fc1_row(self, f_or_row, up: bool):
        """The interleaved w13 row of a feature's gate (``up``: its up) row; non-gated: the row itself."""
        if cutlass.const_expr(self.gated):
            half = self.tn // 2
            blk = f_or_row // half
            return blk * self.tn + (f_or_row - blk * half) + (half if up else 0)
        return f_or_row

    def _w13_offset(self, e, row, kstep, n1, hidden) -> Int64:
        """Element offset of (expert, row, first element of K step) in the prepared w13."""
        if cutlass.const_expr(self.fc1_tiled):
            kt = hidden // STEP_K
            blk = row // self.tn
            return ((Int64(e) * (n1 // self.tn) + blk) * kt + kstep) * (self.tn * STEP_K) + (
                row - blk * self.tn
            ) * STEP_K
        return (Int64(e) * n1 + row) * hidden + kstep * STEP_K

    def _fc1_copy(self, stage, s, pred, gs, gsn, spu, part, my_units, nk1, upg, hidden, s_gexp, s_gcnt, s_gpair, mX,
                  mW13, top_k, n1, lane):  # fmt: skip
        """Ring step ``s`` of this warp's FC1 units: its 16 weight rows (rows 0-7 the gate rows of the unit's
        8 features and 8-15 their up rows, or 16 consecutive rows; four copies of 4 rows x 128 bytes), and
        its token columns (each lane its own 32 bytes)."""
        i = lane >> 2
        q = lane & 3
        m = s // spu
        u = part * spu + (s - m * spu)
        pred = pred & (m < my_units) & (u < nk1)
        unit = gs + m * gsn
        g = cutlass.min(unit // upg, DECODE_MAX_PAIRS - 1)  # clamped: past the end nothing is copied
        a = unit - (unit // upg) * upg
        e = s_gexp[g]
        cnt = s_gcnt[g]
        w_base = mW13.iterator.toint()
        for c in range(4):  # copy c: rows 4c .. 4c + 3, 8 lanes x 16 bytes each (whole 32-byte sectors)
            r = 4 * c + (lane >> 3)
            if cutlass.const_expr(self.gated):
                row = self._fc1_row(a * 8 + (r & 7), c >= 2)
            else:
                row = a * ATOM_ROWS + r
            src = w_base + self._w13_offset(e, row, u, n1, hidden) * 2 + (lane & 7) * 16
            cp_async(stage + _row_slot(r, lane & 7), src, 16, pred)
        real = pred & (i < cnt)
        p = s_gpair[g * GROUP_PAIRS + i]
        tok = cutlass.select_(real, p // top_k, Int32(0))
        src_x = mX.iterator.toint() + (Int64(tok) * hidden + u * STEP_K + 16 * q) * 2
        for c in range(2):
            cp_async(stage + _TOKENS_AT + c * 512 + lane * 16, src_x + c * 16, 16, real)

    def _fc1_store(self, acc, v0: int, mH, p, a, inter, lane) -> None:
        """Token column ``2 q + v0`` of the unit: activation, bf16 h at row ``p`` (the pair)."""
        i = lane >> 2
        base = mH.iterator.toint() + Int64(p) * inter * 2
        if cutlass.const_expr(self.gated):
            v = activations.gated_act(self.activation, acc[v0], acc[2 + v0], self.limit)
            st_global_bf16(base + (a * 8 + i) * 2, v)
        else:
            v_lo = activations.plain_act(self.activation, acc[v0])
            v_hi = activations.plain_act(self.activation, acc[2 + v0])
            st_global_bf16(base + (a * ATOM_ROWS + i) * 2, v_lo)
            st_global_bf16(base + (a * ATOM_ROWS + 8 + i) * 2, v_hi)

    @property
    def fc2_stages(self) -> int:
        """FC2's stages in a warp's ring (the bytes of ``stages`` FC1 stages)."""
        return self.stages * STAGE_BYTES // FC2_STAGE_BYTES

    def kw(self, top_k: int) -> int:
        """Warps per output block by pair: ``min(top_k, warps)``."""
        return min(top_k, self.warps)

    def ksplit(self, top_k: int) -> int:
        """Parts of I each pair's FC2 K loop is split into (the warps left over per pair)."""
        return self.warps // self.kw(top_k)

    def pairs_per_warp(self, top_k: int) -> int:
        return -(-top_k // self.kw(top_k))

    def _fc2_step(self, s, cta, kk, sp, per_rnd_steps, sps, nk2, hb, top_k, pred):
        """(token, row block, k, K step, copy?) of ring step ``s`` of this warp's FC2 work."""
        m = s // per_rnd_steps
        r = s - m * per_rnd_steps
        jj = r // sps
        u = sp * sps + (r - jj * sps)
        ob = cta + m * self.num_sms
        k = kk + jj * self.kw(top_k)
        real = pred & (sp < self.ksplit(top_k)) & (k < top_k) & (u < nk2)
        t = ob // hb
        return cutlass.select_(real, t, Int32(0)), ob - t * hb, cutlass.select_(real, k, Int32(0)), u, real

    def _fc2_copy_w(self, stage, s, pred, cta, kk, sp, per_rnd_steps, sps, nk2, hb, s_ids, mW2, top_k, lane):
        """The 16 w2 rows of ring step ``s`` (rows rb * 16 .. rb * 16 + 15 of pair (t, k)'s expert; zeros past
        the pair's work)."""
        t, rb, k, u, real = self._fc2_step(s, cta, kk, sp, per_rnd_steps, sps, nk2, hb, top_k, pred)
        e = s_ids[cutlass.min(t * top_k + k, DECODE_MAX_PAIRS - 1)]
        hidden = mW2.shape[1]
        inter = mW2.shape[2]
        w_base = mW2.iterator.toint()
        for c in range(4):  # copy c: rows 4c .. 4c + 3 of the block, 8 lanes x 16 bytes each
            r = 4 * c + (lane >> 3)
            src = w_base + ((Int64(e) * hidden + rb * ATOM_ROWS + r) * inter + u * STEP_K) * 2 + (lane & 7) * 16
            cp_async(stage + _row_slot(r, lane & 7), src, 16, real)

    @cute.jit
    def _fc2_copy_h(self, stage, s, pred, cta, kk, sp, per_rnd_steps, sps, nk2, hb, mH, top_k, inter, lane):
        """Token column 0 of ring step ``s``: pair (t, k)'s h row (lanes 0-3, 32 bytes each; the MMA takes
        zeros for the other columns; zeros past the pair's work)."""
        q = lane & 3
        t, rb, k, u, real = self._fc2_step(s, cta, kk, sp, per_rnd_steps, sps, nk2, hb, top_k, pred)
        src = mH.iterator.toint() + ((Int64(t) * top_k + k) * inter + u * STEP_K + 16 * q) * 2
        if lane < 4:
            for c in range(2):
                cp_async(stage + _TOKENS_AT + c * 64 + lane * 16, src + c * 16, 16, real)

    def _mma_step(self, acc, stage, lane, fc2: bool = False) -> None:
        """The four m16n8k16 MMAs of one 64-K ring step (the lane's 32 bytes per row and token column; ``fc2``:
        column 0 only, from the compact FC2 stage, zeros in the other lanes' columns)."""
        i = lane >> 2
        q = lane & 3
        row_lo = [*bq.ld_shared_v4(stage + _row_slot(i, 2 * q)), *bq.ld_shared_v4(stage + _row_slot(i, 2 * q + 1))]
        row_hi = [
            *bq.ld_shared_v4(stage + _row_slot(i + 8, 2 * q)),
            *bq.ld_shared_v4(stage + _row_slot(i + 8, 2 * q + 1)),
        ]
        if fc2:
            col0 = lane < 4
            tok = [
                cutlass.select_(col0, w, Uint32(0))
                for c in range(2)
                for w in bq.ld_shared_v4(stage + _TOKENS_AT + c * 64 + q * 16)
            ]
        else:
            tok = [
                *bq.ld_shared_v4(stage + _TOKENS_AT + lane * 16),
                *bq.ld_shared_v4(stage + _TOKENS_AT + 512 + lane * 16),
            ]
        for s in range(4):
            a = [row_lo[2 * s], row_hi[2 * s], row_lo[2 * s + 1], row_hi[2 * s + 1]]
            d = mma_bf16_16816(a, [tok[2 * s], tok[2 * s + 1]], [acc[0], acc[1], acc[2], acc[3]])
            for r in range(4):
                acc[r] = d[r]
