#!/usr/bin/env python3
"""Where the host time of one eager ``forward`` goes (GPU machine, prebuilt kernel cache).

At small T the GPU work of a forward (~40 us in a CUDA graph on qwen3-30b-a3b) is shorter than the
host path that enqueues it, so eager latency is host-bound. This times the host side of 100 calls
enqueued behind a long ``torch.cuda._sleep`` (so the GPU never pushes back on the host) for: the
layer's ``forward``, the backend's ``compute``, the frontend's ``launch``, the bare TVM-FFI function,
and the input validation alone; then prints a cProfile of the first backend's ``forward``. Several
backends are timed in one process, their cases interleaved round by round: host speed differs from
process to process (up to 1.8x for the same call, TUNING.md "Session 13"), so only same-process numbers
compare.

    source .gpu/env.sh && FLASHINFER_MOE_EP_KERNEL_CACHE=.kcache python scripts/host_overhead.py \
        [--backend sm90_bf16_bf16_bf16_cutedsl sm90_mxfp8_mxfp8_bf16_cutedsl ...] [--contract qwen3-30b-a3b]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.cli.backends import choose_backend
from flashinfer.moe_ep.cli.bench import make_bench_layer
from flashinfer.moe_ep.core.contracts import get_contract
from flashinfer.moe_ep.core.inputs import make_contract_weights, make_hidden_states, make_topk
from flashinfer.moe_ep.core.validation import check_forward_inputs


def round_us(fn, n: int = 100) -> float:
    """Host time per call of ``n`` calls queued behind a GPU sleep (the GPU never pushes back)."""
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the calls
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def bare_launch(be: object, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> tuple:
    """(frontend.launch of T rows, the TVM-FFI function with its arguments) of the backend's bucket."""
    t = x.shape[0]
    if hasattr(be, "_by_bucket"):  # BF16
        from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import tuner

        fe, ws = be._by_bucket[tuner.bucket_of(t)]
        args = (x, ids, w, be.w13, be.w2, out, *ws.values())
        return (lambda: fe.launch(x, ids, w, be.w13, be.w2, out, ws)), fe.load(), args
    from flashinfer.moe_ep.backends.mega.kernel.sm90.block_scaled import token_bucket

    bucket = token_bucket(t, be.config.top_k, be.num_local_experts, be.config.weight_format, be.frontends)
    fe, ws, pw = be.frontends[bucket], be.workspace[bucket], be.weights
    args = (x, be.no_scales, ids, w, pw.w13, pw.w13_scale, pw.w2, pw.w2_scale, pw.w13_gscale, pw.w2_gscale,
            be.act_gscale, out, *ws.values())  # fmt: skip
    return (lambda: fe.launch(x, be.no_scales, ids, w, pw, be.act_gscale, out, ws)), fe.load(), args


def per_call_us(fn, n: int = 100, rounds: int = 5) -> float:
    """Median over ``rounds`` of ``round_us`` after 20 warm-up calls (one case alone; ``main`` interleaves
    its cases instead). ``gpu_kernel_check.py --phase host`` times its libraries with it."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = sorted(round_us(fn, n) for _ in range(rounds))
    return samples[len(samples) // 2]


def cases(layer: moe.MoEEpLayer, c: object, t: int) -> dict[str, object]:
    """The timed calls of one layer at T = ``t``: name -> zero-argument function."""
    be = layer.backend
    x = make_hidden_states(t, c.hidden_size, device="cuda")
    ids, w = make_topk(t, c.num_experts, c.top_k, device="cuda")
    out = torch.empty(t, c.hidden_size, dtype=torch.bfloat16, device="cuda")
    inputs = moe.MoEEpTensors(x, ids, w)
    launch, fn, args = bare_launch(be, x, ids, w, out)
    return {
        "layer.forward": lambda: layer.forward(inputs, output=out),
        "backend.compute": lambda: be.compute(inputs, out),
        "frontend.launch": launch,
        "TVM-FFI fn (its kernels)": lambda: fn(*args),
        "check_forward_inputs": lambda: check_forward_inputs(x, ids, w, hidden_size=c.hidden_size, top_k=c.top_k,
                                                             num_experts=c.num_experts, max_tokens=4096,
                                                             device=be.device, output=out, check_values=False),
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", nargs="+", default=["sm90_bf16_bf16_bf16_cutedsl"])
    p.add_argument("--contract", default="qwen3-30b-a3b")
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    c = get_contract(a.contract)
    w13, w2 = make_contract_weights(c, seed=7, device="cuda")
    t = 1
    layers, timed = {}, {}
    for name in a.backend:
        entry, _ = choose_backend(name, torch.device("cuda"))
        layers[name], _, _ = make_bench_layer(c, entry, w13, w2, None, 4096, torch.Generator().manual_seed(7))
        timed[name] = cases(layers[name], c, t)
    for fns in timed.values():  # warm every path first
        for f in fns.values():
            for _ in range(20):
                f()
    torch.cuda.synchronize()
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(a.rounds):  # interleaved: each round times every case of every backend once
        for name, fns in timed.items():
            for case, f in fns.items():
                samples.setdefault((name, case), []).append(round_us(f))
    print(f"{a.contract} T = {t}: host us per call, median of {a.rounds} interleaved rounds of 100 calls")
    print(f"{'case':26s}" + "".join(f"{n.split('_')[1]:>10s}" for n in a.backend))
    for case in next(iter(timed.values())):
        med = [sorted(samples[(n, case)])[len(samples[(n, case)]) // 2] for n in a.backend]
        print(f"{case:26s}" + "".join(f"{m:10.1f}" for m in med), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        torch.cuda._sleep(200_000_000)
        for _ in range(100):
            timed[a.backend[0]]["layer.forward"]()
        torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
    print(f"cProfile of {a.backend[0]} layer.forward:\n" + s.getvalue())
    for layer in layers.values():
        layer.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
