#!/usr/bin/env python3
"""The tuned layer against the defaults, on the H200, in one process with interleaved launches.

    source .gpu/env.sh && python scripts/tuned_vs_defaults.py --knob-cache knobs.json

Per contract: two BF16 layers on the same weights, one resolving its knobs from ``--knob-cache`` (what
``tune`` recorded), one with the knob cache off (the defaults). Per T: rotating input sets, launches
alternating between the two layers (so drift hits both), per-layer median of ``--iters`` launches.
Prints each bucket's knobs (``same`` when the tuned ones are the defaults: one kernel, noise only) and
``defaults / tuned`` (>= 1: the tuned layer is at least as fast).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--knob-cache", type=Path, required=True)
    p.add_argument("--contract", nargs="+", default=["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"])
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--sets", type=int, default=4)
    a = p.parse_args()

    import torch

    import flashinfer.moe_ep as moe
    from flashinfer.moe_ep.core.contracts import get_contract
    from flashinfer.moe_ep.core.inputs import make_contract_weights, make_token_inputs
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import tuner

    dev = torch.device("cuda")
    rows = []
    for name in a.contract:
        c = get_contract(name)
        w13, w2 = make_contract_weights(c, seed=7, device=dev)
        layers = {}
        for label, knob_cache in (("defaults", "off"), ("tuned", str(a.knob_cache))):
            os.environ["FLASHINFER_MOE_EP_KNOB_CACHE"] = knob_cache  # read when the layer resolves knobs
            cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
                c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit
            )
            layer = moe.MoEEpLayer(
                moe.BootstrapConfig(device=dev),
                moe.FleetParams(c.num_experts, max(a.tokens), c.hidden_size),
                moe.MoEWeightPack(w13, w2),
                backend=moe.MegaConfig(cfg),
                check_values=False,
            )
            layer.warmup()
            layers[label] = layer
        for t in a.tokens:
            bucket = tuner.bucket_of(t)
            knobs = {k: layers[k]._backend._by_bucket[bucket][0].knobs for k in layers}
            same = knobs["defaults"] == knobs["tuned"]
            sets = [(moe.MoEEpTensors(x, ids, w), torch.empty_like(x)) for x, ids, w in make_token_inputs(
                t, c.hidden_size, c.num_experts, c.top_k, a.sets, seed=0, device=dev)]  # fmt: skip
            times: dict[str, list[float]] = {k: [] for k in layers}
            for i in range(a.sets + a.iters):
                for label, layer in layers.items():
                    inp, out = sets[i % a.sets]
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    layer.forward(inp, output=out)
                    end.record()
                    end.synchronize()
                    if i >= a.sets:  # the first round of each set warms up
                        times[label].append(start.elapsed_time(end))
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append((name, t, bucket, "same" if same else tuner.knobs_dict(knobs["tuned"]), med))
            print(rows[-1], flush=True)
        for layer in layers.values():
            layer.destroy()
        del layers, w13, w2
        torch.cuda.empty_cache()
    head = f"{'contract':<16} {'T':>5} {'bucket':<8} {'defaults ms':>11} {'tuned ms':>9} {'def/tuned':>9}"
    print(f"\n{head}  tuned knobs")
    for name, t, bucket, knobs, med in rows:
        ratio = med["defaults"] / med["tuned"]
        print(f"{name:<16} {t:>5} {bucket:<8} {med['defaults']:>11.3f} {med['tuned']:>9.3f} {ratio:>9.3f}  {knobs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
