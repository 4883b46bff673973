#!/usr/bin/env python3
"""Per-CTA phase timestamps inside the block-scaled GEMVs of the decode pair chain (a diagnostic, TUNING.md session 44).

Where does a T = 1-2 layer's time go inside FC1 and FC2? ``patch`` rewrites a *copy* of the drop's ``gemv.py``
(a git worktree, never this checkout: the drop changes only as a recorded drop) so that thread 0 of every GEMV CTA
stores ``%globaltimer`` (low word, ns) and ``%clock`` at each phase, and its SM id, into the second half of the
GEMV's own output buffer (rows that no pair uses at T <= 8). ``run`` (on the GPU, with that copy first on
``PYTHONPATH`` so that the kernel keys match its source) replays a CUDA graph of L layers once and prints, per
phase, the spread over the CTAs in us after FC1's first CTA passed its ``griddepcontrol.wait``:

    here:  git worktree add /tmp/stamps HEAD && python scripts/gemv_phase_stamps.py patch /tmp/stamps
           (cd /tmp/stamps && CUTE_DSL_ARCH=sm_90a PYTHONPATH=. python -m flashinfer.moe_ep build --cache \\
               /work/main/.kcache-stamps --max-tokens 16 --backend <B> --contract qwen3-30b-a3b \\
               --knobs '<the bucket's knobs>')
           mkdir -p .run/stamps && cp -r /tmp/stamps/flashinfer .run/stamps/      (carry .run and the cache)
    there: PYTHONPATH=$PWD/.run/stamps:$PYTHONPATH FLASHINFER_MOE_EP_KERNEL_CACHE=.kcache-stamps \\
           python scripts/gemv_phase_stamps.py run --contract qwen3-30b-a3b --fmt mxfp8 nvfp4 --tokens 1 2

The patch anchors on drop v57's ``gemv.py`` text (v56's anchors all hold in it; with ``gemv_row_tma`` the "x row"
stamp follows the mbarrier wait for the bulk-copied row and its quantization) and refuses a source it does not
match. The stamps cost the layer about 1.5 us (qwen3-30b-a3b T = 1 on an H100).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

GEMV = "flashinfer/moe_ep/kernel_src/cutedsl_megamoe/src/moe_quant_glu/gemv.py"
SLOTS = 20  # int32 words a CTA: slots 0-8 (globaltimer low word, clock), slot 9 (SM id, block entry)
FC1_PHASES = ["entry", "", "wait", "topk", "x row", "unit 0", "K loop", "reduce", "epilogue"]
FC2_PHASES = ["entry", "early", "wait", "topk", "combine", "unit 0", "K loop", "reduce", "epilogue"]
BACKENDS = {"mxfp8": "sm90_mxfp8_mxfp8_bf16_cutedsl", "nvfp4": "sm90_nvfp4_nvfp4_bf16_cutedsl"}

_HELPER = """SLOTS = 20


def _stamp(addr):
    lo = cute.arch.globaltimer_lo()
    clk = cute.arch.clock()
    cute.arch.inline_ptx("st.global.v2.u32 [{$r0}], {{$r1}, {$r2}};", read_only_args=[addr, lo, clk])


ROW_WARP_ROWS = constants.GEMV_ROW_WARP_ROWS"""

#: (anchor in v57's gemv.py, replacement): each anchor must occur exactly once
EDITS = [
    ("ROW_WARP_ROWS = constants.GEMV_ROW_WARP_ROWS", _HELPER),
    (
        "        m_blk = bidx // row_warps\n",
        "        st_ok = (tidx == 0) & (Int64(bidx) * SLOTS * 4 + SLOTS * 4 <= Int64(mC.shape[0]) * mC.shape[1])\n"
        "        st_base = mC.iterator.toint() + Int64(mC.shape[0]) * mC.shape[1] + Int64(bidx * SLOTS) * 4\n"
        "        if st_ok:\n            _stamp(st_base)\n"
        "        m_blk = bidx // row_warps\n",
    ),
    (
        "        if cutlass.const_expr(not self.trigger_after_wait):\n"
        "            cute.arch.griddepcontrol_launch_dependents()\n        cute.arch.griddepcontrol_wait()\n",
        "        if cutlass.const_expr(self.early_w):\n            if st_ok:\n                _stamp(st_base + 8)\n"
        "        if cutlass.const_expr(not self.trigger_after_wait):\n"
        "            cute.arch.griddepcontrol_launch_dependents()\n        cute.arch.griddepcontrol_wait()\n"
        "        if st_ok:\n            _stamp(st_base + 16)\n",
    ),
    (
        "            valid_rows = block >> 16\n",
        "            valid_rows = block >> 16\n            if st_ok:\n"
        '                cute.arch.inline_ptx("st.global.v2.u32 [{$r0}], {{$r1}, {$r2}};",\n'
        "                                     read_only_args=[st_base + 72, cute.arch.smid(), block])\n"
        "                _stamp(st_base + 24)\n",
    ),
    (
        "x_row, warp, lane)\n                cute.arch.barrier()\n",
        "x_row, warp, lane)\n                cute.arch.barrier()\n"
        "                if st_ok:\n                    _stamp(st_base + 32)\n",
    ),
    (
        "                cp_async_wait(self.stages - 1)  # unit i's group (and every one before) has landed\n",
        "                cp_async_wait(self.stages - 1)  # unit i's group (and every one before) has landed\n"
        "                if st_ok & (i == 0):\n                    _stamp(st_base + 40)\n",
    ),
    (
        "            # K slices -> warp 0, summed in warp order\n",
        "            if st_ok:\n                _stamp(st_base + 48)\n"
        "            # K slices -> warp 0, summed in warp order\n",
    ),
    (
        "            if warp == 0:\n                for r in cutlass.range_constexpr(n_acc):\n",
        "            if st_ok:\n                _stamp(st_base + 56)\n"
        "            if warp == 0:\n                for r in cutlass.range_constexpr(n_acc):\n",
    ),
    (
        "                if cutlass.const_expr(self.pair_combine and not self.pair_cluster):\n",
        "                if st_ok:\n                    _stamp(st_base + 64)\n"
        "                if cutlass.const_expr(self.pair_combine and not self.pair_cluster):\n",
    ),
    (
        "self.tok_tile, col)\n",
        "self.tok_tile, col)\n                        if st_ok:\n                            _stamp(st_base + 32)\n",
    ),
    (  # gemv_pair_cluster (drop v56): rank 0's combine ends the token's row warp
        "m_blk // n_pairs, col)\n",
        "m_blk // n_pairs, col)\n                        if st_ok:\n                            _stamp(st_base + 32)\n",
    ),
]


def patch(tree: Path) -> int:
    """Apply ``EDITS`` to ``tree``'s ``gemv.py`` (a worktree copy); refuse a source that does not match."""
    path = tree / GEMV
    if path.resolve() == (Path(__file__).resolve().parents[1] / GEMV).resolve():
        print("patch: refusing this checkout's drop; give a git worktree copy", file=sys.stderr)
        return 1
    src = path.read_text()
    if "def _stamp(" in src:
        print(f"patch: {path} is stamped already", file=sys.stderr)
        return 1
    for anchor, new in EDITS:
        if src.count(anchor) != 1:
            print(f"patch: {path} does not match drop v57 at {anchor.strip()[:60]!r}", file=sys.stderr)
            return 1
        src = src.replace(anchor, new)
    path.write_text(src)
    print(f"patched {path}")
    return 0


def _us(stamps, ref: int):
    """``%globaltimer`` low words -> us after ``ref`` (the low word wraps every 4.3 s)."""
    import numpy as np

    return (((stamps.astype(np.int64) - ref) + 2**31) % 2**32 - 2**31) / 1000.0


def _spread(name: str, words, phases: list[str], ref: int) -> None:
    import numpy as np

    print(f"  {name}: {len(words)} CTAs")
    for slot, label in enumerate(phases):
        t = words[:, 2 * slot]
        t = t[t != 0]
        if not label or not len(t):
            continue
        us = _us(t, ref)
        print(f"    {label:>9}: min {us.min():7.2f}  p10 {np.percentile(us, 10):7.2f}  median {np.median(us):7.2f}"
              f"  p90 {np.percentile(us, 90):7.2f}  max {us.max():7.2f} us  ({len(t)} CTAs)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    # a fallback only: the patched copy must come first on PYTHONPATH (its source digest keys the stamped kernels)
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    import flashinfer.moe_ep as moe
    from flashinfer.moe_ep.backends.mega.kernel.sm90.block_scaled import BUCKETS, token_bucket
    from flashinfer.moe_ep.cli.backends import choose_backend
    from flashinfer.moe_ep.cli.bench import graph_replays, make_bench_layer
    from flashinfer.moe_ep.core.contracts import get_contract
    from flashinfer.moe_ep.core.inputs import make_contract_weights, make_hidden_states, make_topk

    c = get_contract(args.contract)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    w13, w2 = make_contract_weights(c, seed=7, device=dev)
    for fmt in args.fmt:
        entry, _ = choose_backend(BACKENDS[fmt], dev)
        for t in args.tokens:
            bucket = args.bucket or token_bucket(t, c.top_k, c.num_experts, fmt, hidden=c.hidden_size)
            knobs = next(b for b in BUCKETS if b.name == bucket).knobs_for(fmt)
            if not knobs.get("pair_blocks"):
                print(f"{fmt} T={t}: bucket {bucket} is not the GEMV pair chain (nothing to stamp)", file=sys.stderr)
                return 1
            layers = [make_bench_layer(c, entry, w13.roll(i, 0), w2.roll(i, 0), knobs, 16, gen)[0]
                      for i in range(args.layers)]  # fmt: skip
            feeds = [moe.MoEEpTensors(make_hidden_states(t, c.hidden_size, generator=gen, device=dev),
                                      *make_topk(t, c.num_experts, c.top_k, generator=gen, device=dev))
                     for _ in layers]  # fmt: skip
            outs = [torch.empty(t, c.hidden_size, dtype=torch.bfloat16, device=dev) for _ in layers]
            fns = [
                lambda i, lay=lay, f=f, o=o: lay.forward(f, output=o)
                for lay, f, o in zip(layers, feeds, outs, strict=True)
            ]
            replay = graph_replays(fns, 1)
            for _ in range(5):
                replay(0)
            ws = layers[-1]._backend.workspace[next(iter(layers[-1]._backend.workspace))]
            halves = []
            for name in ("h_buf", "a_buf"):  # FC1's output, FC2's (y)
                words = ws[name].view(-1).view(torch.int32)
                halves.append(words[words.numel() // 2 :])
            for h in halves:
                h.zero_()
            torch.cuda.synchronize()
            replay(0)
            torch.cuda.synchronize()
            fc1_ctas = t * c.top_k * (2 * c.intermediate_size // 64)
            fc2_ctas = t * c.top_k * (c.hidden_size // 64)
            fc1 = halves[0][: fc1_ctas * SLOTS].cpu().numpy().astype(np.uint32).reshape(-1, SLOTS)
            fc2 = halves[1][: fc2_ctas * SLOTS].cpu().numpy().astype(np.uint32).reshape(-1, SLOTS)
            ref = int(fc1[:, 4].min())  # FC1's first wait release
            print(f"\n{args.contract} {fmt} T={t} bucket {bucket}: the last of {args.layers} layers, one graph replay")
            _spread("FC1", fc1, FC1_PHASES, ref)
            _spread("FC2", fc2, FC2_PHASES, ref)
            per_sm = Counter(fc1[:, 18].tolist())
            for k in sorted(set(per_sm.values())):
                rows = fc1[[per_sm[s] == k for s in fc1[:, 18].tolist()]]
                end = _us(rows[:, 16], ref)
                print(f"    FC1 CTAs on SMs holding {k}: {len(rows)}, epilogue done median {np.median(end):.2f} us")
            print(f"    SMs holding FC1 CTAs: {len(per_sm)}; holding FC2 CTAs: {len(set(fc2[:, 18].tolist()))}")
            for lay in layers:
                lay.destroy()
            del layers, replay
            torch.cuda.empty_cache()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    pp = sub.add_parser("patch", help="stamp a worktree copy's gemv.py")
    pp.add_argument("tree", type=Path)
    pr = sub.add_parser("run", help="GPU: one graph replay, the phases' spread")
    pr.add_argument("--contract", default="qwen3-30b-a3b")
    pr.add_argument("--fmt", nargs="+", default=["mxfp8", "nvfp4"], choices=sorted(BACKENDS))
    pr.add_argument("--tokens", type=int, nargs="+", default=[1, 2])
    pr.add_argument("--layers", type=int, default=8)
    pr.add_argument("--bucket", default=None, help="the bucket whose knobs to stamp (default: the one serving T)")
    args = p.parse_args()
    return patch(args.tree) if args.what == "patch" else run(args)


if __name__ == "__main__":
    sys.exit(main())
