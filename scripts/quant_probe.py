#!/usr/bin/env python3
"""Profiling probe of the block-scaled kernel: variants that switch parts off (wrong results, timing only).

Here:   python scripts/quant_probe.py build     (exports the variants into .kcache/probe)
There:  source .gpu/env.sh && python scripts/quant_probe.py run
Prints per variant and shape the median ms over rotating inputs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROBE_DIR = ROOT / ".kcache" / "probe"
# (contract, T, knobs) cases; probe bits: 1 = no conversion, 2 = no per-K-tile barriers
CASES = [("deepseek-v3", 128), ("qwen3-30b-a3b", 16384)]
VARIANTS = {
    "mxfp8": {"fmt": "mxfp8", "probe": 0},
    "mxfp8-bf3": {"fmt": "mxfp8", "probe": 0, "bf_buffers": 3},
    "mxfp8-m64": {"fmt": "mxfp8", "probe": 0, "tile_m": 64},
    "mxfp8-m64-bf3": {"fmt": "mxfp8", "probe": 0, "tile_m": 64, "bf_buffers": 3},
    "nvfp4": {"fmt": "nvfp4", "probe": 0},
    "nvfp4-bf3": {"fmt": "nvfp4", "probe": 0, "bf_buffers": 3},
    "nvfp4-m64-bf3": {"fmt": "nvfp4", "probe": 0, "tile_m": 64, "bf_buffers": 3},
}
KNOBS = ("tile_m", "fc1_tile_n", "fc2_tile_n")


def _frontend(contract: str, fmt: str):
    from flashinfer.moe_ep.core.contracts import get_contract
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

    c = get_contract(contract)
    g = drop.Geometry(c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit)
    return (drop.Mxfp8Frontend if fmt == "mxfp8" else drop.Nvfp4Frontend)(g)


def build() -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh

    for contract, _ in CASES:
        for name, v in VARIANTS.items():
            fe = _frontend(contract, v["fmt"])
            g, k = fe.geometry, fe.knobs
            kn = {n: v.get(n, getattr(k, n)) for n in KNOBS}
            kernel = kh.Sm90MegaMoEQuantKernel(
                fmt=v["fmt"], activation=g.activation, limit=g.activation_limit, probe=v["probe"],
                bf_buffers=v.get("bf_buffers", 2), **kn
            )  # fmt: skip
            kh.export_moe_quant(kernel, g.hidden, g.intermediate, g.num_experts, g.top_k,
                                PROBE_DIR / f"{contract}-{name}", "probe")  # fmt: skip
            print("built", contract, name, flush=True)


def run() -> None:
    import torch

    from flashinfer.moe_ep.core.contracts import get_contract
    from flashinfer.moe_ep.core.inputs import make_contract_weights, make_hidden_states, make_topk
    from flashinfer.moe_ep.core.reference_quant import quantize_expert_weights
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import QuantKnobs, allocate_shared_workspace, kernel_cache

    dev = torch.device("cuda")
    rows = []
    for contract, t in CASES:
        c = get_contract(contract)
        w13, w2 = make_contract_weights(c, seed=0, device=dev)
        qs = {fmt: quantize_expert_weights(w13, w2, fmt) for fmt in ("mxfp8", "nvfp4")}
        del w13, w2
        sets = []
        baseline: dict = {}
        for _ in range(3):
            x = make_hidden_states(t, c.hidden_size, device=dev)
            ids, w = make_topk(t, c.num_experts, c.top_k, device=dev)
            sets.append((x, ids, w, torch.empty_like(x)))
        for name, v in VARIANTS.items():
            fe = _frontend(contract, v["fmt"])
            fe = type(fe)(fe.geometry, QuantKnobs(**{**fe.knobs.__dict__, **{n: v[n] for n in KNOBS if n in v}}))
            q = qs[v["fmt"]]
            pw = fe.prepare_weights(q.w13, q.w13_scale, q.w2, q.w2_scale, q.w13_global_scale, q.w2_global_scale)
            ws = allocate_shared_workspace([fe], t, dev)[0]
            gs = torch.ones(2, device=dev)
            fn = kernel_cache.load_function(PROBE_DIR / f"{contract}-{name}" / "libprobe.so", "probe")

            def launch(i: int, fn=fn, pw=pw, ws=ws, gs=gs, sets=sets) -> None:
                x, ids, w, out = sets[i % 3]
                operands = (pw.w13, pw.w13_scale, pw.w2, pw.w2_scale, pw.w13_gscale, pw.w2_gscale)
                fn(x, ids, w, *operands, gs, out, *ws.values())

            for i in range(3):
                launch(i)
            torch.cuda.synchronize()
            same = ""
            if v["probe"] == 0:  # output-neutral variants: bit-equal to the format's first one
                out0 = sets[0][3].clone()
                ref = baseline.setdefault(v["fmt"], out0)
                same = "bit-equal" if torch.equal(out0, ref) else "DIFFERS"
            times = []
            for i in range(15):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                launch(i)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            rows.append((contract, t, name, statistics.median(times), same))
            print(rows[-1], flush=True)

        del qs
        torch.cuda.empty_cache()
    print(f"\n{'contract':<16} {'T':>6} {'variant':<16} {'ms':>8}  output")
    for r in rows:
        print(f"{r[0]:<16} {r[1]:>6} {r[2]:<16} {r[3]:>8.3f}  {r[4]}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("what", choices=["build", "run"])
    a = p.parse_args()
    build() if a.what == "build" else run()
