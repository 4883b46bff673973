#!/usr/bin/env python3
"""Per-kernel GPU time of one layer forward (world size 1), from the torch profiler.

Shows where a forward's device time goes (routing, gather, FC1, FC2, combine) for a backend, a
contract, token counts and optional knobs. Random weights and inputs (never zeros); NVFP4 with static
activation scales calibrated as the bench does. GPU machine, prebuilt kernel cache:

    source .gpu/env.sh && FLASHINFER_MOE_EP_KERNEL_CACHE=.kcache python scripts/layer_profile.py \\
        --contract qwen3-30b-a3b --backend sm90_mxfp8_mxfp8_bf16_cutedsl --tokens 16 128

With ``--timeline L``: L layers (the experts rolled, as ``bench --graph-layers``) captured in one CUDA graph per T
and replayed under the profiler; prints one replay's kernels in order with their start and end relative to the
graph's first kernel, so the gaps (launch and dependency latency) show next to the kernels' own time.

With ``--ncu``, under ``ncu --clock-control none --profile-from-start off [--section ...] python
scripts/layer_profile.py ... --ncu``: Nsight Compute's counters for the kernels of one forward per T.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.cli.backends import choose_backend
from flashinfer.moe_ep.cli.bench import graph_replays, make_bench_layer
from flashinfer.moe_ep.core.contracts import get_contract
from flashinfer.moe_ep.core.inputs import make_contract_weights, make_hidden_states, make_topk


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contract", required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--tokens", type=int, nargs="+", required=True)
    p.add_argument("--knobs", default=None, help="JSON knobs for the backend config")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--ncu", action="store_true",
                   help="no torch profiler: one forward per T between cudaProfilerStart / Stop, for "
                        "ncu --profile-from-start off (Nsight Compute then sees exactly those kernels)")  # fmt: skip
    p.add_argument("--timeline", type=int, default=0, metavar="L",
                   help="a CUDA graph of L layers per T: one replay's kernel timeline")  # fmt: skip
    args = p.parse_args()

    c = get_contract(args.contract)
    dev = torch.device("cuda")
    entry, _ = choose_backend(args.backend, dev)
    gen = torch.Generator().manual_seed(7)  # inputs: the CPU generator the input helpers take
    w13, w2 = make_contract_weights(c, seed=7, device=dev)  # drawn on the GPU (deepseek-v3: 22.5 GB)
    knobs = json.loads(args.knobs) if args.knobs else None
    layer, _, _ = make_bench_layer(c, entry, w13, w2, knobs, max(args.tokens), gen)
    if args.timeline:
        layers = [layer] + [
            make_bench_layer(c, entry, w13.roll(i, 0), w2.roll(i, 0), knobs, max(args.tokens), gen)[0]
            for i in range(1, args.timeline)
        ]
        for t in args.tokens:
            print_timeline(c, entry, layers, t, gen, args.knobs)
        for lay in layers:
            lay.destroy()
        return 0
    for t in args.tokens:
        x = make_hidden_states(t, c.hidden_size, generator=gen, device=dev)
        ids, w = make_topk(t, c.num_experts, c.top_k, generator=gen, device=dev)
        inp = moe.MoEEpTensors(x, ids, w)
        for _ in range(3):
            layer.forward(inp)
        torch.cuda.synchronize()
        if args.ncu:
            torch.cuda.profiler.start()
            layer.forward(inp)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"{args.contract} {entry.kernel_name} T={t} knobs={args.knobs}: one forward for ncu")
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                layer.forward(inp)
            torch.cuda.synchronize()
        per_kernel: dict[str, float] = defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[ev.name] += ev.device_time_total / args.iters
        total = sum(per_kernel.values())
        print(f"{args.contract} {entry.kernel_name} T={t} knobs={args.knobs}: {total / 1000:.3f} ms of kernels")
        for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
            short = name if len(name) <= 90 else f"{name[:50]}...{name[-37:]}"  # FC1 and FC2 share a long prefix
            print(f"  {us:9.1f} us  {short}")
    layer.destroy()
    return 0


def print_timeline(c, entry, layers: list, t: int, gen: torch.Generator, knobs: str | None) -> None:
    """One replay of a CUDA graph of ``layers`` at T = ``t`` (each layer its own input and output): every
    kernel's start / end (us from the first kernel's start), its span and the gap after the previous kernel's
    end (negative: it overlapped, as PDL lets a kernel start before the one it waits for has ended)."""
    dev = torch.device("cuda")
    feeds, outs = [], []
    for _ in layers:
        x = make_hidden_states(t, c.hidden_size, generator=gen, device=dev)
        ids, w = make_topk(t, c.num_experts, c.top_k, generator=gen, device=dev)
        feeds.append(moe.MoEEpTensors(x, ids, w))
        outs.append(torch.empty(t, c.hidden_size, dtype=torch.bfloat16, device=dev))
    fns = [lambda i, lay=lay, f=f, o=o: lay.forward(f, output=o) for lay, f, o in zip(layers, feeds, outs, strict=True)]
    replay = graph_replays(fns, 1)
    for _ in range(5):
        replay(0)
    torch.cuda.synchronize()
    reps = 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay(0)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    kernels = sorted(
        (float(e["ts"]), float(e["dur"]), e["name"])
        for e in trace.get("traceEvents", [])
        if e.get("cat") == "kernel" and "ts" in e
    )
    per_replay = len(kernels) // reps
    if not per_replay:
        print(f"{c.name} T={t}: the profiler recorded no kernels of the graph")
        return
    last = kernels[-per_replay:]  # the last replay: warm
    t0 = last[0][0]
    span = last[-1][0] + last[-1][1] - t0
    print(f"{c.name} {entry.kernel_name} T={t} knobs={knobs}: a graph of {len(layers)} layers, one replay "
          f"{span:.1f} us ({span / len(layers):.1f} us per layer), {per_replay} kernels")  # fmt: skip
    prev_end = None
    for ts, dur, name in last:
        gap = "" if prev_end is None else f"{ts - prev_end:+7.1f}"
        short = name if len(name) <= 70 else f"{name[:35]}...{name[-32:]}"
        print(f"  start {ts - t0:8.1f}  end {ts + dur - t0:8.1f}  span {dur:7.1f}  gap {gap:>7}  {short}")
        prev_end = ts + dur if prev_end is None else max(prev_end, ts + dur)


if __name__ == "__main__":
    sys.exit(main())
