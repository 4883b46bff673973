#!/usr/bin/env python3
"""Where the host time of one eager ``forward`` goes (GPU machine, prebuilt kernel cache).

At small T the GPU work of a forward (~40 us in a CUDA graph on qwen3-30b-a3b) is shorter than the
host path that enqueues it, so eager latency is host-bound. This times the host side of 100 calls
enqueued behind a long ``torch.cuda._sleep`` (so the GPU never pushes back on the host) for: the
layer's ``forward``, the backend's ``compute``, the frontend's ``launch``, the bare TVM-FFI function,
and the input validation alone; then prints a cProfile of ``forward``.

    source .gpu/env.sh && FLASHINFER_MOE_EP_KERNEL_CACHE=.kcache python scripts/host_overhead.py \
        [--backend sm90_mxfp8_mxfp8_bf16_cutedsl] [--contract qwen3-30b-a3b]
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


def per_call_us(fn, n: int = 100, rounds: int = 5) -> float:
    """Median over ``rounds`` of the host time per call of ``n`` calls queued behind a GPU sleep."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the calls
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(samples)[len(samples) // 2]


def bare_launch(be: object, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> tuple:
    """(frontend.launch of T rows, the TVM-FFI function with its arguments) of the backend's bucket."""
    t = x.shape[0]
    if hasattr(be, "_by_bucket"):  # BF16
        from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import tuner

        fe, ws = be._by_bucket[tuner.bucket_of(t)]
        args = (x, ids, w, be.w13, be.w2, out, *ws.values())
        return (lambda: fe.launch(x, ids, w, be.w13, be.w2, out, ws)), fe.load(), args
    from flashinfer.moe_ep.backends.mega.kernel.sm90.block_scaled import token_bucket

    bucket = token_bucket(t, be.config.top_k, be.num_local_experts)
    fe, ws, pw = be.frontends[bucket], be.workspace[bucket], be.weights
    args = (x, be.no_scales, ids, w, pw.w13, pw.w13_scale, pw.w2, pw.w2_scale, pw.w13_gscale, pw.w2_gscale,
            be.act_gscale, out, *ws.values())  # fmt: skip
    return (lambda: fe.launch(x, be.no_scales, ids, w, pw, be.act_gscale, out, ws)), fe.load(), args


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="sm90_bf16_bf16_bf16_cutedsl")
    p.add_argument("--contract", default="qwen3-30b-a3b")
    a = p.parse_args()
    c = get_contract(a.contract)
    entry, _ = choose_backend(a.backend, torch.device("cuda"))
    w13, w2 = make_contract_weights(c, seed=7, device="cuda")
    layer, _, _ = make_bench_layer(c, entry, w13, w2, None, 4096, torch.Generator().manual_seed(7))
    be = layer.backend
    t = 1
    x = make_hidden_states(t, c.hidden_size, device="cuda")
    ids, w = make_topk(t, c.num_experts, c.top_k, device="cuda")
    out = torch.empty(t, c.hidden_size, dtype=torch.bfloat16, device="cuda")
    inputs = moe.MoEEpTensors(x, ids, w)
    launch, fn, args = bare_launch(be, x, ids, w, out)
    print(f"{a.backend} {a.contract} T = {t}", flush=True)
    rows = [
        ("layer.forward", lambda: layer.forward(inputs, output=out)),
        ("backend.compute", lambda: be.compute(inputs, out)),
        ("frontend.launch", launch),
        ("TVM-FFI fn (5 kernels)", lambda: fn(*args)),
        ("check_forward_inputs", lambda: check_forward_inputs(x, ids, w, hidden_size=c.hidden_size, top_k=c.top_k,
                                                              num_experts=c.num_experts, max_tokens=4096,
                                                              device=be.device, output=out, check_values=False)),
    ]  # fmt: skip
    for name, f in rows:
        print(f"{name:26s} {per_call_us(f):7.1f} us host per call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        torch.cuda._sleep(200_000_000)
        for _ in range(100):
            layer.forward(inputs, output=out)
        torch.cuda.synchronize()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
    print(s.getvalue())
    layer.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
