"""The combine done by the last FC2 work unit of a token (``pair_combine``): the device helpers that the
BF16 grouped GEMM (``moe_bf16_glu.grouped_gemm``) and the block-scaled GEMV (``moe_quant_glu.gemv``)
share.

With one M block per (token, k) pair (``pair_blocks``), the FC2 unit that computes pair ``t * K + k``'s
output columns ``[c0, c0 + n)`` stores them to its y row; then one warp fences them (``publish_stores``) and
counts itself in at the counter of (token ``t``, column block) (``count_in``). The last of the token's
``top_k`` arrivals (``count_in`` returns True) zeroes the counter again (``reset_counter``) and sums the
token's k rows of those columns, a 32-bit word (two BF16 columns) per lane and call (``combine_word``):
``out[t, c] = bf16(sum_k w[t, k] * y_k[c])`` with one ``fma.rn.f32`` per k from zero, k in order. That is the
combine kernel's arithmetic (``moe_bf16_glu.aux_kernels.combine_kernel``: its SASS is that FFMA chain), so
the bits do not depend on which unit comes last.

Memory order: every lane fences its own y stores (``fence.acq_rel.gpu``) before the warp's one
``atom.add.acq_rel.gpu``; the last arrival fences again and reads the rows with ``ld.global.cg`` (past
L1, which other SMs' stores do not update).

With a cluster per (token, column block) (the GEMV's ``pair_cluster``) the k rows meet in the shared memory of
the cluster's rank-0 CTA instead (``st_cluster_b32``, a cluster barrier) and ``combine_words`` sums them: the
same arithmetic on the same BF16 words.
"""

import cutlass
import cutlass.cute as cute


def st_global_bf16x2(addr: cutlass.Int64, lo: cutlass.Float32, hi: cutlass.Float32) -> None:
    """Store ``lo`` and ``hi`` rounded to BF16 (to nearest even) as one 32-bit word at ``addr`` (``lo`` first)."""
    cute.arch.inline_ptx(
        "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, {$r2}, {$r1}; st.global.b32 [{$r0}], t; }",
        read_only_args=[addr, lo, hi],
    )


def ld_global_cg_b32(addr: cutlass.Int64) -> cutlass.Int32:
    """32 bits at ``addr`` from L2 (``ld.global.cg``: past L1, which other SMs' stores do not update)."""
    return cute.arch.inline_ptx(
        "ld.global.cg.b32 {$w0}, [{$r0}];", write_only_types=[cutlass.Int32], read_only_args=[addr]
    )


def bf16_lo_to_f32(word: cutlass.Int32) -> cutlass.Float32:
    """The low BF16 of a 32-bit word as fp32 (exact)."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 t; shl.b32 t, {$r0}, 16; mov.b32 {$w0}, t; }",
        write_only_types=[cutlass.Float32],
        read_only_args=[word],
    )


def bf16_hi_to_f32(word: cutlass.Int32) -> cutlass.Float32:
    """The high BF16 of a 32-bit word as fp32 (exact)."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 t; and.b32 t, {$r0}, 0xFFFF0000; mov.b32 {$w0}, t; }",
        write_only_types=[cutlass.Float32],
        read_only_args=[word],
    )


def fma_f32(a: cutlass.Float32, b: cutlass.Float32, c: cutlass.Float32) -> cutlass.Float32:
    """``a * b + c`` rounded once (the combine kernel's FFMA)."""
    return cute.arch.inline_ptx(
        "fma.rn.f32 {$w0}, {$r0}, {$r1}, {$r2};", write_only_types=[cutlass.Float32], read_only_args=[a, b, c]
    )


def st_cluster_b32(addr: cutlass.Int32, rank, word: cutlass.Uint32) -> None:
    """Store ``word`` at shared address ``addr`` of the cluster's CTA ``rank`` (``mapa`` + ``st.shared::cluster``;
    ``addr``: the same allocation's address in this CTA)."""
    cute.arch.inline_ptx(
        "{ .reg .b32 r; mapa.shared::cluster.u32 r, {$r0}, {$r1}; st.shared::cluster.b32 [r], {$r2}; }",
        read_only_args=[addr, cutlass.Int32(rank), word],
    )


def publish_stores() -> None:
    """Warp-collective, after the lanes' y stores: every lane fences its own stores (``fence.acq_rel.gpu``), then
    the warp meets, so that the count (``count_in``) follows them all."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_warp()


@cute.jit
def count_in(counter, top_k):
    """Warp-collective, after ``publish_stores``: count this unit in at ``counter`` (an LLVM pointer to an int32)
    with lane 0's ``atom.add.acq_rel.gpu``; True in every lane when it was the last of ``top_k`` arrivals."""
    lane = cute.arch.lane_idx()
    arrived = cutlass.Int32(0)
    if lane == 0:
        arrived = cute.arch.atomic_add(counter, cutlass.Int32(1), sem="acq_rel", scope="gpu")
    arrived = cute.arch.shuffle_sync(arrived, 0)
    return arrived == top_k - 1


@cute.jit
def reset_counter(counter) -> None:
    """The last arrival, before it reads the rows: order them after the count, and zero the counter for the
    next call (every arrival of this call is in)."""
    cute.arch.fence_acq_rel_gpu()
    if cute.arch.lane_idx() == 0:
        cute.arch.store(counter, cutlass.Int32(0))


def combine_word(
    y_base: cutlass.Int64,
    out: cute.Tensor,
    hidden,
    topk_weights: cute.Tensor,
    tok,
    top_k: int,
    pair_rows: int,
    col,
) -> None:
    """``out[tok, col:col + 2] = bf16(sum_k w[tok, k] * y[(tok * top_k + k) * pair_rows, col:col + 2])``, k in
    order, one FMA each from zero (y: BF16 rows of ``hidden`` elements at ``y_base``; ``out`` [T, hidden])."""
    words = []
    for k in range(top_k):
        y_row = cutlass.Int64((tok * top_k + k) * pair_rows)
        words.append(ld_global_cg_b32(y_base + (y_row * hidden + col) * 2))
    combine_words(words, out, hidden, topk_weights, tok, col)


def combine_words(words: list, out: cute.Tensor, hidden, topk_weights: cute.Tensor, tok, col) -> None:
    """``out[tok, col:col + 2] = bf16(sum_k w[tok, k] * words[k])``, k in order, one FMA each from zero
    (``words[k]``: pair k's two BF16 y values of those columns as one 32-bit word)."""
    lo = cutlass.Float32(0.0)
    hi = cutlass.Float32(0.0)
    for k in range(len(words)):
        w = topk_weights[tok, k]
        lo = fma_f32(w, bf16_lo_to_f32(words[k]), lo)
        hi = fma_f32(w, bf16_hi_to_f32(words[k]), hi)
    st_global_bf16x2(out.iterator.toint() + (cutlass.Int64(tok) * hidden + col) * 2, lo, hi)
