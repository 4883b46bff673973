"""``bench``: the mega layer against the ``torch._grouped_mm`` pipeline, on one GPU, in one run.

Per contract and T: median latency over rotating input sets (CUDA events), TFLOP/s, touched-weight
GB/s, the roofline floor from ceilings measured in the same run (bf16 matmul, device copy), the ratio
to the baseline, and the error against the fp32 reference. Writes CSV (and a PNG plot when matplotlib
is installed); prints a table last.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from ..config import BootstrapConfig, FleetParams, MegaConfig, MoEEpTensors, MoEWeightPack
from ..core.baselines import grouped_mm_moe
from ..core.contracts import get_contract
from ..core.inputs import make_expert_weights, make_hidden_states, make_topk, relative_errors, rounding_ulps
from ..core.reference import moe_reference
from ..errors import MoEEpConfigError
from ..layer import MoEEpLayer
from .backends import choose_backend

DEFAULT_TOKENS = (1, 16, 128, 1024, 4096, 16384)
DEFAULT_CONTRACTS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmark the mega layer against torch._grouped_mm (GPU)")
    p.add_argument("--contract", nargs="+", default=list(DEFAULT_CONTRACTS))
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    p.add_argument("--backend", default="auto")
    p.add_argument("--knobs", default=None, help="JSON knobs for the backend")
    p.add_argument("--sets", type=int, default=4, help="rotating input sets")
    p.add_argument("--iters", type=int, default=20, help="timed launches per size")
    p.add_argument("--out", default="bench-out", help="directory for CSV and plot")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check per size")
    p.set_defaults(func=run)


def _time_ms(fn: Any, iters: int, sets: int) -> float:
    """Median per-launch ms over ``iters`` launches cycling through ``sets`` input sets."""
    for i in range(sets):  # warm-up (loads, allocator, caches of the first touch)
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_ceilings() -> dict[str, float]:
    """bf16 matmul TFLOP/s and device copy TB/s, on random data, on this GPU now."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda i: a @ b, 10, 1)
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda i: dst.copy_(src), 10, 1)
    return {"matmul_tflops": 2 * n**3 / ms / 1e9, "copy_tbs": 2 * src.numel() * 2 / copy_ms / 1e9}


def bench_contract(
    name: str, tokens: list[int], entry: Any, knobs: Any, sets: int, iters: int, check: bool, ceilings: dict[str, float]
) -> list[dict[str, Any]]:
    c = get_contract(name)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(1234)
    wgen = torch.Generator(device=dev).manual_seed(1234)  # weights drawn on the GPU (deepseek-v3: 22.5 GB)
    w13, w2 = make_expert_weights(
        c.num_experts, c.hidden_size, c.intermediate_size, c.activation, generator=wgen, device=dev
    )
    config = entry.load_config_class()(
        c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit, knobs
    )
    layer = MoEEpLayer(
        BootstrapConfig(device=dev),
        FleetParams(c.num_experts, max(tokens), c.hidden_size),
        MoEWeightPack(w13, w2),
        backend=MegaConfig(config),
        check_values=False,
    )
    layer.warmup()
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    rows = []
    for t in tokens:
        inputs = []
        for _ in range(sets):
            x = make_hidden_states(t, c.hidden_size, generator=gen).to(dev)
            ids, w = make_topk(t, c.num_experts, c.top_k, generator=gen)
            inputs.append(MoEEpTensors(x, ids.to(dev), w.to(dev)))
        outs = [torch.empty(t, c.hidden_size, dtype=torch.bfloat16, device=dev) for _ in range(sets)]

        def ours_fn(i: int, inputs: list[MoEEpTensors] = inputs, outs: list[torch.Tensor] = outs) -> Any:
            return layer.forward(inputs[i], output=outs[i])

        def base_fn(i: int, inputs: list[MoEEpTensors] = inputs) -> Any:
            s = inputs[i]
            return grouped_mm_moe(
                s.hidden_states, s.topk_ids, s.topk_weights, w13_t, w2_t, c.activation, c.activation_limit
            )

        ours = _time_ms(ours_fn, iters, sets)
        base = _time_ms(base_fn, iters, sets)
        touched = sum(int(torch.unique(s.topk_ids).numel()) for s in inputs) / sets
        weight_bytes = touched * c.weight_bytes_per_expert()
        flops = c.flops(t)
        floor_ms = max(flops / (ceilings["matmul_tflops"] * 1e9), weight_bytes / (ceilings["copy_tbs"] * 1e9))
        row = {
            "contract": name,
            "backend": entry.kernel_name,
            "tokens": t,
            "ms": ours,
            "baseline_ms": base,
            "tflops": flops / ours / 1e9,
            "weight_gbs": weight_bytes / ours / 1e6,
            "floor_ms": floor_ms,
            "pct_floor": 100 * floor_ms / ours,
            "speedup": base / ours,
            "mean_err": float("nan"),
            "max_err": float("nan"),
            "ulps": float("nan"),
        }
        if check and t:
            s = inputs[0]
            outs[0].fill_(float("nan"))
            layer.forward(s, output=outs[0])
            ref, scale = moe_reference(
                s.hidden_states,
                s.topk_ids,
                s.topk_weights,
                w13,
                w2,
                c.activation,
                c.activation_limit,
                return_term_scale=True,
            )
            row["mean_err"], row["max_err"] = relative_errors(outs[0], ref)
            row["ulps"] = rounding_ulps(outs[0], ref, scale)
        rows.append(row)
        print(
            f"  {name} T={t}: {ours:.3f} ms ({row['tflops']:.0f} TFLOP/s, {row['pct_floor']:.0f}% of floor), "
            f"baseline {base:.3f} ms, x{row['speedup']:.2f}, err mean {row['mean_err']:.1e} max {row['max_err']:.1e}",
            flush=True,
        )
    layer.destroy()
    del w13, w2
    torch.cuda.empty_cache()
    return rows


def _plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["contract"] for r in rows):
        rs = [r for r in rows if r["contract"] == name]
        ax.plot([r["tokens"] for r in rs], [r["pct_floor"] for r in rs], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("% of roofline floor")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def run(args: argparse.Namespace) -> int:
    import json

    if not torch.cuda.is_available():
        raise MoEEpConfigError("bench needs a CUDA GPU (run it on the H200 machine; see SKILL.md)")
    dev = torch.device("cuda")
    entry, note = choose_backend(args.backend, dev)
    if note:
        print(f"note: {note}")
    knobs = json.loads(args.knobs) if args.knobs else None
    ceilings = measure_ceilings()
    print(
        f"bench on {torch.cuda.get_device_name()}: ceilings {ceilings['matmul_tflops']:.0f} TFLOP/s bf16 matmul, "
        f"{ceilings['copy_tbs']:.2f} TB/s copy; backend {entry.kernel_name}",
        flush=True,
    )
    rows = []
    for name in args.contract:
        rows += bench_contract(name, args.tokens, entry, knobs, args.sets, args.iters, not args.no_check, ceilings)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plotted = _plot(rows, out / "bench.png")
    print(f"\nwrote {out / 'bench.csv'}" + (f" and {out / 'bench.png'}" if plotted else " (no matplotlib: no plot)"))
    print(
        f"\n{'contract':<16} {'T':>6} {'ms':>8} {'TFLOP/s':>8} {'GB/s w':>8} {'%floor':>7} {'base ms':>8} "
        f"{'x base':>6} {'max err':>8}"
    )
    for r in rows:
        print(
            f"{r['contract']:<16} {r['tokens']:>6} {r['ms']:>8.3f} {r['tflops']:>8.0f} {r['weight_gbs']:>8.0f} "
            f"{r['pct_floor']:>6.0f}% {r['baseline_ms']:>8.3f} {r['speedup']:>6.2f} {r['max_err']:>8.1e}"
        )
    sys.stdout.flush()
    return 0


__all__ = ["add_parser", "measure_ceilings", "run"]
