#!/usr/bin/env python3
"""The bars' cells of issues #3 and #7 in one device call, with a short table printed last.

Here (no GPU):   CUTE_DSL_ARCH=sm_90a python scripts/gpu_session.py build --bench-only --cache .kcacheB
There (carry .gpu and the cache):
    source .gpu/env.sh && FLASHINFER_MOE_EP_KERNEL_CACHE=.kcacheB python scripts/bar_cells.py --out $OUT

Runs ``bench`` (the BF16, MXFP8 and NVFP4 backends on the same inputs, knob cache off, no correctness check: the
GPU suites check) for the decode cells (per layer in a CUDA graph of several layers, as an engine runs decode),
then the prefill cells contract by contract while the call is under ``--stop-at`` seconds, so a short device
budget still brings the decode cells back. Each step's CSV lands in ``--out``; the table reads them:

- decode: BF16's time per layer in the graph (us) and its share of the touched-weight floor at the run's copy
  rate, then each block-scaled backend's time and BF16's time over it (the #7 ratio);
- prefill: BF16's ms, TFLOP/s, its share of the run's bf16 matmul ceiling and the ``torch._grouped_mm``
  pipeline's time over it (the #3 cells), then each block-scaled backend's BF16 time over its own.

The numbers mean the bars only on the card the bars name (an H200): the table's first line says which card ran.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts.gpu_session import BENCH_BACKENDS as BACKENDS  # noqa: E402  (the bench's three backends, BF16 first)
from scripts.gpu_session import BENCH_CONTRACTS as PREFILL  # noqa: E402

#: contract -> (tokens, layers per CUDA graph): qwen3-235b-a22b's graph holds 5 layers (the bench's weight memory)
DECODE = {"qwen3-30b-a3b": ([1, 2, 3, 4, 7, 8, 16, 128], 8), "qwen3-235b-a22b": ([1, 2, 3, 4, 8], 5)}
PREFILL_TOKENS = [4096, 16384]
CEILING = re.compile(r"ceilings ([0-9.]+) TFLOP/s")


def short(backend: str) -> str:
    """``sm90_nvfp4_nvfp4_bf16_cutedsl`` -> ``NVFP4``."""
    return backend.split("_")[1].upper()


def decode_table(rows: list[dict[str, str]]) -> list[str]:
    """Lines of the decode table from one bench CSV (one contract, graph times)."""
    contract = rows[0]["contract"]
    out = [f"{contract} decode, us a layer in a graph of {rows[0]['graph_layers']}; BF16 % of the weight floor; "
           "BF16 time over each format's"]  # fmt: skip
    base = {r["tokens"]: r for r in rows if r["backend"] == BACKENDS[0]}
    for t, b in base.items():
        us = float(b["graph_ms"]) * 1e3
        line = f"  T={t:>4}  BF16 {us:8.2f} ({float(b['floor_ms']) / float(b['graph_ms']):.0%})"
        for r in rows:
            if r["tokens"] == t and r["backend"] != BACKENDS[0]:
                theirs = float(r["graph_ms"]) * 1e3
                line += f"  {short(r['backend'])} {theirs:8.2f} ({us / theirs:.2f}x)"
        out.append(line)
    return out


def prefill_table(rows: list[dict[str, str]], ceiling: float | None) -> list[str]:
    """Lines of the prefill table from one bench CSV (one contract, one call at a time); ``ceiling`` the run's bf16
    matmul TFLOP/s (from the bench's first line), for the share of the matmul rate."""
    contract = rows[0]["contract"]
    out = [f"{contract} prefill, ms; TFLOP/s; % of the run's matmul ceiling; x the grouped_mm pipeline; "
           "BF16 time over each format's"]  # fmt: skip
    base = {r["tokens"]: r for r in rows if r["backend"] == BACKENDS[0]}
    for t, b in base.items():
        share = f"{float(b['tflops']) / ceiling:5.1%}" if ceiling else "    -"
        line = (f"  T={t:>5}  BF16 {float(b['ms']):7.3f} ms {float(b['tflops']):5.0f} {share} "
                f"{float(b['speedup']):.2f}x")  # fmt: skip
        for r in rows:
            if r["tokens"] == t and r["backend"] != BACKENDS[0]:
                line += f"  {short(r['backend'])} {float(b['ms']) / float(r['ms']):.3f}x"
        out.append(line)
    return out


def bench(args: list[str], out: Path) -> tuple[list[dict[str, str]], float | None]:
    """One ``bench`` run into ``out``; (its CSV rows, the run's matmul ceiling); ([], None) if it failed."""
    cmd = [sys.executable, "-m", "flashinfer.moe_ep", "bench", "--backend", *BACKENDS, "--no-check", *args,
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "FLASHINFER_MOE_EP_KNOB_CACHE": "off"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"bench {' '.join(args)}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}", flush=True)
        return [], None
    m = CEILING.search(r.stdout)
    with open(out / "bench.csv") as f:
        return list(csv.DictReader(f)), float(m.group(1)) if m else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bar-cells"))
    p.add_argument("--stop-at", type=float, default=400.0, help="no prefill step starts after this many seconds")
    p.add_argument("--no-prefill", action="store_true")
    a = p.parse_args()
    import torch

    t0 = time.monotonic()
    lines = [f"bar cells on {torch.cuda.get_device_name()} ({os.environ.get('FLASHINFER_MOE_EP_KERNEL_CACHE', '')})"]
    for contract, (tokens, layers) in DECODE.items():
        print(f"[{time.monotonic() - t0:5.0f} s] decode {contract}", flush=True)
        rows, _ = bench(["--contract", contract, "--tokens", *map(str, tokens), "--graph-layers", str(layers)],
                        a.out / f"decode-{contract}")  # fmt: skip
        lines += decode_table(rows) if rows else [f"{contract} decode: failed (above)"]
    for contract in [] if a.no_prefill else PREFILL:
        if time.monotonic() - t0 > a.stop_at:
            lines.append(f"{contract} prefill: not run (past --stop-at {a.stop_at:g} s)")
            continue
        print(f"[{time.monotonic() - t0:5.0f} s] prefill {contract}", flush=True)
        args = ["--contract", contract, "--tokens", *map(str, PREFILL_TOKENS), "--graph-max-tokens", "0"]
        rows, ceiling = bench(args, a.out / f"prefill-{contract}")
        lines += prefill_table(rows, ceiling) if rows else [f"{contract} prefill: failed (above)"]
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
