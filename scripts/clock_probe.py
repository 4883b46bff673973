#!/usr/bin/env python3
"""The SM clock and power behind the prefill timings (GPU machine, prebuilt kernel cache).

``bench`` divides a layer's FLOPs by a short matrix product's rate measured a moment before. If the
layer draws more power than the card may, its SM clock drops and the comparison mixes two clocks.
This times, with ``nvidia-smi`` sampling clocks and power in the background (``cli.clocks``):

- the bench ceiling (8192^3 bf16 matmul, one launch at a time, 10 launches), then the same matmul
  back to back for ``--seconds``;
- per contract and T, the BF16 layer as ``bench`` times it (one launch at a time, rotating inputs),
  then back to back for ``--seconds``.

    source .gpu/env.sh && FLASHINFER_MOE_EP_KERNEL_CACHE=.kcache18w FLASHINFER_MOE_EP_KNOB_CACHE=off \
        python scripts/clock_probe.py --contract qwen3-30b-a3b deepseek-v3 --tokens 4096 16384

Prints one row per phase: ms per launch, TFLOP/s, the share of the bench ceiling, and the clocks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashinfer.moe_ep.cli.backends import choose_backend
from flashinfer.moe_ep.cli.bench import back_to_back_ms, launch_times_ms, make_bench_layer
from flashinfer.moe_ep.cli.clocks import ClockSampler, nvidia_smi_id, timed_window
from flashinfer.moe_ep.config import MoEEpTensors
from flashinfer.moe_ep.core.contracts import get_contract
from flashinfer.moe_ep.core.inputs import make_contract_weights, make_hidden_states, make_topk


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contract", nargs="+", default=["qwen3-30b-a3b", "deepseek-v3"])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--seconds", type=float, default=2.0, help="length of each back-to-back phase")
    p.add_argument("--iters", type=int, default=20, help="launches of each one-at-a-time phase")
    p.add_argument("--sets", type=int, default=4)
    a = p.parse_args()

    dev = torch.device("cuda")
    rows: list[tuple[str, float, float, float, object]] = []
    with ClockSampler(nvidia_smi_id(0), period_ms=20) as clocks:
        if clocks.error:
            print(f"no clock samples: {clocks.error}", flush=True)

        def phase(label: str, fn, sets: int, flops: float, ceiling: float | None) -> float:
            ms, win = timed_window(clocks, lambda: statistics.median(launch_times_ms(fn, a.iters, sets)))
            time.sleep(0.3)  # idle between phases, as a fresh bench point starts
            ms_b2b, win_b2b = timed_window(clocks, lambda: back_to_back_ms(fn, sets, a.seconds))
            for name, m, w in ((label + " one at a time", ms, win), (label + " back to back", ms_b2b, win_b2b)):
                tf = flops / m / 1e9
                rows.append((name, m, tf, 100 * tf / ceiling if ceiling else 100.0, w))
                print(f"{name}: {m:.3f} ms, {tf:.0f} TFLOP/s, {w and w.describe()}", flush=True)
            time.sleep(0.3)
            return flops / ms / 1e9

        n = 8192
        mats = [torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(4)]
        ceiling = phase("matmul 8192^3", lambda i: mats[i] @ mats[(i + 1) % 4], 4, 2 * n**3, None)

        gen = torch.Generator().manual_seed(1234)
        entry, _ = choose_backend("sm90_bf16_bf16_bf16_cutedsl", dev)
        for name in a.contract:
            c = get_contract(name)
            w13, w2 = make_contract_weights(c, seed=1234, device=dev)
            layer, _, _ = make_bench_layer(c, entry, w13, w2, None, max(a.tokens), gen)
            for t in a.tokens:
                feed = []
                for _ in range(a.sets):
                    ids, w = make_topk(t, c.num_experts, c.top_k, generator=gen)
                    x = make_hidden_states(t, c.hidden_size, generator=gen)
                    feed.append(MoEEpTensors(x.to(dev), ids.to(dev), w.to(dev)))
                outs = [torch.empty(t, c.hidden_size, dtype=torch.bfloat16, device=dev) for _ in range(a.sets)]
                fwd = layer.forward
                phase(f"{name} T={t}", lambda i, f=feed, o=outs, fwd=fwd: fwd(f[i], output=o[i]), a.sets,
                      c.flops(t), ceiling)  # fmt: skip
            layer.destroy()
            del w13, w2
            torch.cuda.empty_cache()

    print(f"\n{'phase':<44} {'ms':>8} {'TFLOP/s':>8} {'% ceil':>7}  clocks")
    for name, ms, tf, pct, win in rows:
        print(f"{name:<44} {ms:>8.3f} {tf:>8.0f} {pct:>6.1f}%  {win.describe() if win else '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
