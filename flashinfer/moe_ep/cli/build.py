"""``build``: compile kernels ahead of time into the kernel cache (any machine; no GPU needed)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import tuning
from ..backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl.config import Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig
from ..core.activations import ACTIVATIONS
from ..core.contracts import CONTRACTS, get_contract
from ..errors import MoEEpConfigError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("build", help="compile kernels into the kernel cache (CPU-only machines work)")
    p.add_argument("--arch", default="sm_90a", choices=["sm_90a"])
    p.add_argument("--contract", nargs="+", default=None, help=f"contracts, or 'all' ({', '.join(CONTRACTS)})")
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--experts", type=int, help="experts per rank (with --hidden ...); else from the contract")
    p.add_argument("--top-k", type=int)
    p.add_argument("--activation", default="swiglu", choices=ACTIVATIONS)
    p.add_argument("--activation-limit", type=float, default=None)
    p.add_argument("--world-size", type=int, default=1, help="EP ranks (experts per rank = E / world size)")
    p.add_argument("--knobs", default=None, help="JSON knobs, e.g. '{\"tile_m\": 64}' (default: the defaults)")
    p.add_argument("--cache", default=None, help="cache directory (default: $FLASHINFER_MOE_EP_KERNEL_CACHE)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=16384,
        help="layer capacity: every token bucket up to it gets its kernel (default 16384)",
    )
    p.add_argument("--device-name", default="NVIDIA H200", help="GPU whose knob-cache entries to build for")
    p.add_argument("--force", action="store_true", help="rebuild even when cached")
    p.set_defaults(func=run)


def _configs(args: argparse.Namespace) -> list[tuple[str, Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig, int]]:
    knobs = json.loads(args.knobs) if args.knobs else None
    out = []
    if args.contract:
        names = list(CONTRACTS) if args.contract == ["all"] else args.contract
        for name in names:
            c = get_contract(name)
            if c.num_experts % args.world_size:
                raise MoEEpConfigError(f"{name}: {c.num_experts} experts do not split over {args.world_size} ranks")
            cfg = Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
                c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit, knobs
            )
            out.append((name, cfg, c.num_experts // args.world_size))
    elif args.hidden and args.intermediate and args.experts and args.top_k:
        e = args.experts * args.world_size
        cfg = Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
            args.hidden, args.intermediate, e, args.top_k, args.activation, args.activation_limit, knobs
        )
        out.append(("custom", cfg, args.experts))
    else:
        raise MoEEpConfigError("give --contract NAME [...] (or all), or --hidden --intermediate --experts --top-k")
    return out


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    root = Path(args.cache).expanduser() if args.cache else None
    context = tuning.tune_context_named(args.device_name, args.world_size)
    jobs = []
    for name, cfg, e_local in _configs(args):
        profiles = tuning.layer_profiles(cfg, e_local, args.max_tokens, context)
        for fe in profiles.distinct():
            buckets = [b for b, f in profiles.frontends.items() if f is fe]
            jobs.append((f"{name} [{'/'.join(buckets)}]", fe))
    print(f"build: {len(jobs)} kernel(s) for {args.arch} (layer capacity {args.max_tokens} tokens)")
    for i, (label, fe) in enumerate(jobs, 1):
        t0 = time.perf_counter()
        print(f"[{i}/{len(jobs)}] {label}: {tuning.describe_knobs(fe.knobs)} ...", flush=True)
        lib = fe.build(root, force=args.force)
        print(f"[{i}/{len(jobs)}] {label}: {lib} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


__all__ = ["add_parser", "run"]
