#!/usr/bin/env python3
"""Dense cuBLAS BF16 GEMMs of the shapes the MoE layer's two grouped GEMMs add up to (GPU machine).

For a contract and T: FC1 as one dense GEMM [T*k, H] x [H, 2I] (I for relu2) and FC2 as [T*k, I] x
[I, H], the same FLOPs the layer's FC1 and FC2 do without expert padding. Their TFLOP/s is what the
vendor library reaches on those aspect ratios (short K for FC2), a ceiling to hold our grouped GEMMs
against besides the square 8192^3 matmul of ``bench`` (its ``measure_ceilings``). Random inputs, two
rotating sets, CUDA events, median of 10 launches (``bench.launch_times_ms``).

    source .gpu/env.sh && python scripts/shape_ceilings.py --tokens 4096 16384
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashinfer.moe_ep.cli.bench import launch_times_ms, measure_ceilings
from flashinfer.moe_ep.core.contracts import get_contract


def median_ms(fn, sets: int, iters: int = 10) -> float:
    return statistics.median(launch_times_ms(fn, iters, sets))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contract", nargs="+", default=["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    args = ap.parse_args()
    dev = torch.device("cuda")
    square = measure_ceilings()["matmul_tflops"]  # bench's ceiling: 8192^3 on random data
    print(f"{torch.cuda.get_device_name()}: square 8192^3 {square:.0f} TFLOP/s")
    print(f"{'contract':16s} {'T':>6s} {'GEMM':5s} {'M x K x N':>22s} {'ms':>8s} {'TFLOP/s':>8s} {'x square':>8s}")
    for name in args.contract:
        c = get_contract(name)
        gated = c.activation != "relu2"
        for t in args.tokens:
            m = t * c.top_k
            for tag, k, nn in (("FC1", c.hidden_size, (2 if gated else 1) * c.intermediate_size),
                               ("FC2", c.intermediate_size, c.hidden_size)):  # fmt: skip
                xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(2)]
                w = torch.randn(k, nn, device=dev, dtype=torch.bfloat16)
                ms = median_ms(lambda i, xs=xs, w=w: xs[i] @ w, 2)
                tf = 2 * m * k * nn / ms / 1e9
                print(f"{name:16s} {t:6d} {tag:5s} {f'{m} x {k} x {nn}':>22s} {ms:8.3f} {tf:8.0f} {tf / square:8.2f}")
                del xs, w
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
