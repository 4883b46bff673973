#!/usr/bin/env python3
"""How fast can one kernel read a decode layer's worth of bytes? (a probe; TUNING.md, session 27)

The decode bars divide the weight bytes by the copy rate of a 4 GB copy. A decode layer reads 25-700 MB
once, in a graph of layers back to back. This times pure reads of such sizes, each kernel on its own
buffer, 8 kernels to a CUDA graph (the buffers together far larger than L2), by the ways a kernel can
stream bytes into an SM:

- ``cp``: every lane copies 16-byte pieces into a per-warp shared ring with ``cp.async`` (the fused
  decode kernel's and the GEMV's way), ``S`` stages of ``C`` bytes per warp;
- ``bulk``: lane 0 of each warp issues one ``cp.async.bulk`` of ``C`` bytes per stage into the warp's ring,
  completion by mbarrier (the TMA engine's bulk path, no tensor map);
- ``ldg``: every lane loads 16-byte words straight into registers (``ld.global.nc``), ``U`` chunks of ``C``
  bytes per warp a round (ptxas keeps only one chunk's four loads of a lane in flight: SASS);

in two orders: ``contig`` (chunk j of C bytes to warp j mod (132 x warps)) and ``unit`` (the fused decode
kernel's FC1 order at qwen3-30b-a3b: per step two 1 KB pieces 16 KB apart, the gate and up rows of 8
features in w13's tiled layout; unit j on CTA j mod 132, its 32 K steps over the 16 warps);

and, for scale, torch's ``amax`` over the same buffer and cuBLAS's batched GEMV (``torch.bmm``: 8
experts' [N, K] bf16 weights times one column, as FC1 at T = 1).

``layers`` (session 54) asks what a decode *layer* of pure reads costs: per format, a CUDA graph of 8 layers,
each two launches of the contiguous variants (FC1's weight bytes, then FC2's, as the pair chain reads them) or
one launch of both (as a fused layer would), us a layer. The bytes are qwen3-30b-a3b's touched weights and
scales at T = 1 and 2 (8 and 16 experts) in each format. It bounds from below what any kernel of that shape
can reach; no arithmetic, no routing, no dependency between the launches but the stream order.

    CUTE_DSL_ARCH=sm_90a python scripts/stream_probe.py build --out .kcache_stream      # CPU
    source .gpu/env.sh && python scripts/stream_probe.py run --lib .kcache_stream        # GPU
    source .gpu/env.sh && python scripts/stream_probe.py layers --lib .kcache_stream     # GPU

Every kernel XORs what it read into a word per thread (written out, so nothing is optimized away).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NUM_SMS = 132
# (name, method, pattern, warps, stages or chunks in flight, chunk bytes, pdl)
VARIANTS = [
    ("cp_w16_s4_c2k", "cp", "contig", 16, 4, 2048, True),
    ("cp_w16_s6_c2k", "cp", "contig", 16, 6, 2048, True),
    ("cp_unit_w16_s4", "cp", "unit", 16, 4, 2048, True),
    ("bulk_w16_s4_c2k", "bulk", "contig", 16, 4, 2048, True),
    ("bulk_unit_w16_s4", "bulk", "unit", 16, 4, 2048, True),
    ("bulk_w16_s3_c4k", "bulk", "contig", 16, 3, 4096, True),
    ("bulk_w8_s4_c4k", "bulk", "contig", 8, 4, 4096, True),
    ("bulk_w4_s6_c8k", "bulk", "contig", 4, 6, 8192, True),
    ("ldg_w16_u4_c2k", "ldg", "contig", 16, 4, 2048, True),
    ("ldg_w16_u8_c1k", "ldg", "contig", 16, 8, 1024, True),
    ("cp_w16_s4_c2k_nopdl", "cp", "contig", 16, 4, 2048, False),
]
ROUND = NUM_SMS * 16 * 2048  # bytes per round of every variant (warps x chunk is 32 KB in each)
SIZES_ROUNDS = [6, 12, 17, 163]  # ~26, 52, 74, 705 MB
# the "unit" pattern: w13's tiled layout at qwen3-30b-a3b (H 2048: 32 K steps of 64; 256-row N tiles of
# 16 units of 8 gated features): a block of 256 rows x 2048 K is 1 MiB, a K step of it 32 KB
UNIT_BLOCK = 1 << 20
UNIT_PER_BLOCK = 16
UNIT_K_STEPS = 32


def build(out: Path) -> None:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64, Uint32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe.shim._paths import src_module

    bq = src_module("src.block_quant")
    wr = src_module("src.warp_ring")
    link_library = src_module("moe_bf16_glu.export").link_library

    def ldg_v4(addr):
        return cute.arch.inline_ptx(
            "ld.global.nc.L1::no_allocate.v4.u32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
            write_only_types=[Uint32, Uint32, Uint32, Uint32],
            read_only_args=[addr],
        )

    def bulk_g2s(dst, src, size: int, mbar) -> None:
        cute.arch.inline_ptx(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
            f"[{{$r0}}], [{{$r1}}], {size}, [{{$r2}}];",
            read_only_args=[dst, src, mbar],
        )

    class StreamRead:
        def __init__(self, method, pattern, warps, depth, chunk, pdl):
            self.method, self.pattern, self.warps, self.depth, self.chunk, self.pdl = (
                method, pattern, warps, depth, chunk, pdl)  # fmt: skip
            if pattern == "unit":
                assert chunk == 2048 and UNIT_K_STEPS % warps == 0

        @cute.jit
        def __call__(self, src: cute.Tensor, out: cute.Tensor, stream):
            self.kernel(src, out).launch(
                grid=[NUM_SMS, 1, 1], block=[32 * self.warps, 1, 1], stream=stream, use_pdl=self.pdl
            )

        def steps(self, nbytes, cta, warp):
            """This warp's ring steps."""
            if cutlass.const_expr(self.pattern == "contig"):
                gws = NUM_SMS * self.warps
                gw = cta * self.warps + warp
                return cutlass.max(Int32(nbytes // self.chunk) - gw + gws - 1, 0) // gws
            units = Int32(nbytes // UNIT_BLOCK) * UNIT_PER_BLOCK
            return cutlass.max(units - cta + NUM_SMS - 1, 0) // NUM_SMS * (UNIT_K_STEPS // self.warps)

        def piece(self, i, c: int, cta, warp) -> Int64:
            """Byte offset of 512-byte piece ``c`` of ring step ``i`` (contig: C contiguous bytes per step
            of warp gw, steps dealt round robin over every warp; unit: the fused decode kernel's FC1 order at
            qwen3-30b-a3b, a step = 8 gate rows' and 8 up rows' 128 bytes of one 64-K step in w13's tiled
            layout, two 1 KB pieces 16 KB apart, unit j on CTA j % G, each warp 2 of the unit's 32 K steps)."""
            if cutlass.const_expr(self.pattern == "contig"):
                gw = cta * self.warps + warp
                return Int64(gw + i * (NUM_SMS * self.warps)) * self.chunk + c * 512
            spu = UNIT_K_STEPS // self.warps
            m = i // spu
            unit = cta + m * NUM_SMS
            blk = unit // UNIT_PER_BLOCK
            a = unit - blk * UNIT_PER_BLOCK
            kstep = warp * spu + (i - m * spu)
            half = (c // 2) * (UNIT_BLOCK // UNIT_K_STEPS // 2)
            return Int64(blk) * UNIT_BLOCK + kstep * (UNIT_BLOCK // UNIT_K_STEPS) + half + a * 1024 + (c % 2) * 512

        @cute.kernel
        def kernel(self, src: cute.Tensor, out: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tidx % 32
            W, D, C = self.warps, self.depth, self.chunk  # noqa: N806
            per_lane = C // 512  # 16-byte pieces per lane and chunk
            smem = cutlass.utils.SmemAllocator()
            ring_bytes = 16 if cutlass.const_expr(self.method == "ldg") else W * D * C
            ring = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(ring_bytes), 128)
            mbar = smem.allocate_tensor(Int64, cute.make_layout(W * D), 8)
            ring_base = bq.smem_addr(ring.iterator) + warp * (D * C)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
                cute.arch.griddepcontrol_wait()
            nbytes = Int64(src.shape[0]) * 4
            mine = self.steps(nbytes, cta, warp)
            base = src.iterator.toint()
            acc = Uint32(0)
            if cutlass.const_expr(self.method == "cp"):
                for j in cutlass.range_constexpr(D - 1):
                    for c in cutlass.range_constexpr(per_lane):
                        off = self.piece(Int32(j), c, cta, warp) + lane * 16
                        wr.cp_async(ring_base + j * C + c * 512 + lane * 16, base + off, 16, j < mine)
                    wr.cp_async_commit()
                for i in cutlass.range(mine, unroll=1):
                    nxt = i + D - 1
                    for c in cutlass.range_constexpr(per_lane):
                        off = self.piece(nxt, c, cta, warp) + lane * 16
                        wr.cp_async(ring_base + (nxt % D) * C + c * 512 + lane * 16, base + off, 16, nxt < mine)
                    wr.cp_async_commit()
                    wr.cp_async_wait(D - 1)
                    for c in cutlass.range_constexpr(per_lane):
                        w = bq.ld_shared_v4(ring_base + (i % D) * C + c * 512 + lane * 16)
                        acc = acc ^ w[0] ^ w[1] ^ w[2] ^ w[3]
                wr.cp_async_wait(0)
            elif cutlass.const_expr(self.method == "bulk"):
                bars = mbar.iterator + warp * D
                if lane == 0:
                    for s in cutlass.range_constexpr(D):
                        cute.arch.mbarrier_init(bars + s, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.sync_warp()
                if lane == 0:
                    for s in cutlass.range_constexpr(D):
                        if s < mine:
                            self.issue_bulk(ring_base + s * C, base, Int32(s), cta, warp, bars + s)
                for i in cutlass.range(mine, unroll=1):
                    s = i % D
                    cute.arch.mbarrier_wait(bars + s, (i // D) % 2)
                    for c in cutlass.range_constexpr(per_lane):
                        w = bq.ld_shared_v4(ring_base + s * C + c * 512 + lane * 16)
                        acc = acc ^ w[0] ^ w[1] ^ w[2] ^ w[3]
                    cute.arch.sync_warp()  # every lane has read the stage before it is refilled
                    nxt = i + D
                    if lane == 0 and nxt < mine:
                        self.issue_bulk(ring_base + s * C, base, nxt, cta, warp, bars + s)
            else:
                gws = NUM_SMS * W
                gw = cta * W + warp
                rounds = mine // D
                for i in cutlass.range(rounds, unroll=1):
                    words = []
                    for u in cutlass.range_constexpr(D):
                        for c in cutlass.range_constexpr(per_lane):
                            off = Int64(gw + (i * D + u) * gws) * C + c * 512 + lane * 16
                            words.append(ldg_v4(base + off))
                    for w in words:
                        acc = acc ^ w[0] ^ w[1] ^ w[2] ^ w[3]
                for i in cutlass.range(rounds * D, mine, unroll=1):
                    for c in cutlass.range_constexpr(per_lane):
                        w = ldg_v4(base + Int64(gw + i * gws) * C + c * 512 + lane * 16)
                        acc = acc ^ w[0] ^ w[1] ^ w[2] ^ w[3]
            out[cta * (32 * W) + tidx] = Int32(acc)

        def issue_bulk(self, dst, base, i, cta, warp, bar) -> None:
            """Lane 0: step ``i``'s bytes into the stage at ``dst``, completing on ``bar``."""
            cute.arch.mbarrier_arrive_and_expect_tx(bar, self.chunk)
            if cutlass.const_expr(self.pattern == "contig"):
                bulk_g2s(dst, base + self.piece(i, 0, cta, warp), self.chunk, bq.smem_addr(bar))
            else:
                for h in range(2):  # the gate rows' and the up rows' 1 KB
                    bulk_g2s(dst + h * 1024, base + self.piece(i, 2 * h, cta, warp), 1024, bq.smem_addr(bar))

    out.mkdir(parents=True, exist_ok=True)
    for name, method, pattern, warps, depth, chunk, pdl in VARIANTS:
        k = StreamRead(method, pattern, warps, depth, chunk, pdl)
        args = [
            make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(divisibility=4096),), assumed_align=16),
            make_fake_compact_tensor(cutlass.Int32, (NUM_SMS * 32 * warps,), assumed_align=16),
            make_fake_stream(use_tvm_ffi_env_stream=True),
        ]
        compiled = cute.compile(k, *args, options="--enable-tvm-ffi")
        print(name, link_library(compiled, out, name), flush=True)


def run(lib: Path, reps: int, out_json: Path | None) -> None:
    import numpy as np
    import torch
    import tvm_ffi

    dev = torch.device("cuda")
    L = 8  # noqa: N806
    rows = []

    mods = {name: tvm_ffi.load_module(str((lib / f"lib{name}.so").resolve())) for name, *_ in VARIANTS}
    for r in SIZES_ROUNDS:
        nbytes = r * ROUND
        bufs = [torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=dev) for _ in range(L)]
        # the check: a variant's per-thread words XOR to the XOR of the bytes it was to read
        word0 = bufs[0].cpu().numpy()
        for name, _method, pattern, warps, _depth, _chunk, _pdl in VARIANTS:
            read = nbytes if pattern == "contig" else (nbytes // UNIT_BLOCK) * UNIT_BLOCK
            want = int(np.bitwise_xor.reduce(word0[: read // 4]))
            outs = [torch.zeros(NUM_SMS * 32 * warps, dtype=torch.int32, device=dev) for _ in range(L)]
            fn = getattr(mods[name], name)
            fn(bufs[0], outs[0])
            torch.cuda.synchronize()
            ok = int(np.bitwise_xor.reduce(outs[0].cpu().numpy())) == want
            us = _graph_us([lambda i=i, f=fn, b=bufs, o=outs: f(b[i], o[i]) for i in range(L)], reps)
            rows.append((nbytes, name, us, read / us / 1e6, ok))
            print(f"{read / 1e6:8.1f} MB {name:24s} {us:8.2f} us {read / us / 1e6:6.3f} TB/s xor_ok={ok}", flush=True)
        half = [b.view(torch.bfloat16) for b in bufs]
        us = _graph_us([lambda i=i, h=half: torch.amax(h[i]) for i in range(L)], reps)
        rows.append((nbytes, "torch.amax", us, nbytes / us / 1e6, True))
        print(f"{nbytes / 1e6:8.1f} MB {'torch.amax':24s} {us:8.2f} us {nbytes / us / 1e6:6.3f} TB/s", flush=True)
        # cuBLAS batched GEMV: 8 experts' [N, 2048] bf16 weights, N from the bytes
        n = nbytes // (8 * 2048 * 2)
        ws = [b.view(torch.bfloat16)[: 8 * n * 2048].view(8, n, 2048) for b in bufs]
        xs = torch.randn(8, 2048, 1, dtype=torch.bfloat16, device=dev)
        us = _graph_us([lambda i=i, w=ws, x=xs: torch.bmm(w[i], x) for i in range(L)], reps)
        rows.append((nbytes, "torch.bmm gemv", us, 8 * n * 2048 * 2 / us / 1e6, True))
        print(
            f"{nbytes / 1e6:8.1f} MB {'torch.bmm gemv':24s} {us:8.2f} us {8 * n * 4096 / us / 1e6:6.3f} TB/s",
            flush=True,
        )
        del bufs, half, ws
        torch.cuda.empty_cache()
    print("\nvariant | " + " | ".join(f"{r * ROUND / 1e6:.0f} MB: us, TB/s" for r in SIZES_ROUNDS))
    for name in dict.fromkeys(r[1] for r in rows):
        cells = [f"{r[2]:.1f}, {r[3]:.2f}" + ("" if r[4] else " WRONG") for r in rows if r[1] == name]
        print(f"{name} | " + " | ".join(cells))
    if out_json:
        out_json.write_text(json.dumps(rows))


#: the contract whose touched weight bytes (with scales, `bench.BYTES_PER_WEIGHT`) a pure-read layer reads
LAYER_CONTRACT = "qwen3-30b-a3b"
LAYER_VARIANTS = ["cp_w16_s4_c2k", "bulk_w8_s4_c4k"]


def layers(lib: Path, reps: int) -> None:
    """Pure-read decode layers: two launches (FC1's bytes, FC2's) or one, 8 layers to a graph, us a layer."""
    import numpy as np
    import torch
    import tvm_ffi

    from flashinfer.moe_ep.cli.bench import BYTES_PER_WEIGHT
    from flashinfer.moe_ep.core.activations import fc1_rows
    from flashinfer.moe_ep.core.contracts import get_contract

    c = get_contract(LAYER_CONTRACT)
    dev = torch.device("cuda")
    L = 8  # noqa: N806
    mods = {name: tvm_ffi.load_module(str((lib / f"lib{name}.so").resolve())) for name in LAYER_VARIANTS}
    warps = {name: w for name, _m, _p, w, *_ in VARIANTS}
    print(f"device: {torch.cuda.get_device_name()}")
    print("format | T | FC1 MB | FC2 MB | variant | two launches us | one launch us | TB/s (two, one)")
    for fmt, bpw in BYTES_PER_WEIGHT.items():
        for t in (1, 2):
            experts = c.top_k * t  # distinct experts at most
            rows1 = fc1_rows(c.activation, c.intermediate_size)
            fc1 = int(experts * rows1 * c.hidden_size * bpw) // 16384 * 16384  # kernels take 16 KiB multiples
            fc2 = int(experts * c.hidden_size * c.intermediate_size * bpw) // 16384 * 16384
            mk = [torch.randint(-(2**31), 2**31 - 1, (n // 4,), dtype=torch.int32, device=dev)
                  for n in (fc1, fc2, fc1 + fc2) for _ in range(L)]  # fmt: skip
            b1, b2, b12 = mk[:L], mk[L : 2 * L], mk[2 * L :]
            for name in LAYER_VARIANTS:
                fn = getattr(mods[name], name)
                outs = [torch.zeros(NUM_SMS * 32 * warps[name], dtype=torch.int32, device=dev) for _ in range(L)]
                fn(b12[0], outs[0])
                torch.cuda.synchronize()
                ok = int(np.bitwise_xor.reduce(outs[0].cpu().numpy())) == int(
                    np.bitwise_xor.reduce(b12[0].cpu().numpy())
                )
                two = []
                for i in range(L):
                    two += [lambda f=fn, b=b1[i], o=outs[i]: f(b, o), lambda f=fn, b=b2[i], o=outs[i]: f(b, o)]
                us2 = _graph_us(two, reps) * 2
                us1 = _graph_us([lambda f=fn, b=b12[i], o=outs[i]: f(b, o) for i in range(L)], reps)
                tot = fc1 + fc2
                print(
                    f"{fmt} | {t} | {fc1 / 1e6:.1f} | {fc2 / 1e6:.1f} | {name} | {us2:.2f} | {us1:.2f} | "
                    f"{tot / us2 / 1e6:.2f}, {tot / us1 / 1e6:.2f}" + ("" if ok else " WRONG"),
                    flush=True,
                )
            del mk
            torch.cuda.empty_cache()


def _graph_us(fns, reps: int) -> float:
    """Median over ``reps`` replays of one CUDA graph of ``fns``, us per launch."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(fns))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--lib", type=Path, required=True)
    r.add_argument("--reps", type=int, default=30)
    r.add_argument("--json", type=Path)
    lay = sub.add_parser("layers", help="pure-read decode layers, two launches against one (session 54)")
    lay.add_argument("--lib", type=Path, required=True)
    lay.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    if a.cmd == "build":
        build(a.out)
    elif a.cmd == "layers":
        layers(a.lib, a.reps)
    else:
        run(a.lib, a.reps, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
