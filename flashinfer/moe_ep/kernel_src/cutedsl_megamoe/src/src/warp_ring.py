"""Per-warp copy rings and warp-level MMAs: the device helpers of the GEMV-style kernels
(``moe_quant_glu.gemv``, ``moe_bf16_glu.decode``).

A *warp ring* is a few stages of shared memory that one warp fills with 16-byte ``cp.async`` copies
(one commit group per stage) and reads back itself, so no CTA barrier guards it. ``cp.async.wait_group``
covers only the thread's own copies: where every lane reads only the bytes it copied (the GEMV) it is
the only synchronization; where lanes read rows other lanes copied (``decode``: whole 32-byte sectors
per copy instruction) a ``sync_warp`` follows it, and precedes the refill of a stage the warp has read.
Copies into shared memory cannot be moved by ptxas past the wait that consumes them and hold no
registers while in flight (register prefetches were sunk below the MMAs: SKILL.md).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64


def cp_async(dst: Int32, src: Int64, size: int, pred) -> None:
    """``size`` bytes (4 or 16) global -> shared, asynchronously (this thread's ``cp.async`` group); zeros
    where ``pred`` does not hold (source size 0: nothing is read)."""
    cache = "cg" if size == 16 else "ca"  # 16-byte copies bypass L1
    cute.arch.inline_ptx(
        "{ .reg .pred p; .reg .b32 n; setp.ne.b32 p, {$r2}, 0; selp.b32 n, "
        + str(size)
        + ", 0, p;\n"
        + f"cp.async.{cache}.shared.global [{{$r0}}], [{{$r1}}], {size}, n; }}",
        read_only_args=[dst, src, Int32(pred)],
    )


def prefetch_l2(src: Int64, size: Int32) -> None:
    """``size`` bytes (a multiple of 16; ``src`` 16-byte aligned) of global memory into L2, asynchronously
    (``cp.async.bulk.prefetch``: nothing to wait for, no registers or shared memory held while in flight)."""
    cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};", read_only_args=[src, size])


def bulk_copy_g2s(dst: Int32, src: Int64, size: int, mbar: Int32) -> None:
    """``size`` bytes (a multiple of 16; both addresses 16-byte aligned) global -> shared through the TMA unit
    (``cp.async.bulk``), completing ``size`` transaction bytes on the shared mbarrier at ``mbar`` (the caller
    arrives on it with ``expect_tx`` first). Not a ``cp.async`` group: wait on the mbarrier."""
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{$r0}], [{$r1}], {$r2}, [{$r3}];",
        read_only_args=[dst, src, Int32(size), mbar],
    )


def cp_async_commit() -> None:
    cute.arch.inline_ptx("cp.async.commit_group;")


def cp_async_wait(pending: int) -> None:
    """Until at most ``pending`` of this thread's most recent ``cp.async`` groups are in flight."""
    cute.arch.inline_ptx(f"cp.async.wait_group {pending};")


def mma_bf16_16816(a: list, b: list, c: list) -> tuple[Float32, Float32, Float32, Float32]:
    """``mma.sync`` m16n8k16, BF16 operands, fp32 accumulators: D = A B + C (fragments as in the PTX ISA)."""
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, "
        "{{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, {{$r6}, {$r7}, {$r8}, {$r9}};",
        write_only_types=[Float32, Float32, Float32, Float32],
        read_only_args=[*a, *b, *c],
    )


def bf16_round(x: Float32) -> Float32:
    """``x`` rounded to BF16 (round to nearest even), as fp32."""
    return cute.arch.inline_ptx(
        "{ .reg .b16 t; cvt.rn.bf16.f32 t, {$r0}; cvt.f32.bf16 {$w0}, t; }",
        write_only_types=[Float32],
        read_only_args=[x],
    )


def red_add_gpu(addr: Int64, v: Int32) -> None:
    """``*addr += v`` at GPU scope, relaxed, without waiting for the old value (``red``)."""
    cute.arch.inline_ptx("red.relaxed.gpu.global.add.s32 [{$r0}], {$r1};", read_only_args=[addr, v])


def st_global_bf16(addr: Int64, x: Float32) -> None:
    """Store ``x`` rounded to BF16 at global address ``addr``."""
    cute.arch.inline_ptx(
        "{ .reg .b16 t; cvt.rn.bf16.f32 t, {$r1}; st.global.b16 [{$r0}], t; }",
        read_only_args=[addr, x],
    )
