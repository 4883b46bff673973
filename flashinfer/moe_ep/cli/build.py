"""``build``: compile kernels ahead of time into the kernel cache (any machine; no GPU needed)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..backends.mega.catalog import CATALOG, catalog_entry
from ..backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import tuning
from ..backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl.config import Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig
from ..core.activations import ACTIVATIONS
from ..core.contracts import CONTRACTS, GEOMETRY_FORM, get_contract
from ..errors import MoEEpConfigError

BF16 = "sm90_bf16_bf16_bf16_cutedsl"
#: the block-scaled kernel backends of the catalog
BLOCK_SCALED = tuple(e.kernel_name for e in CATALOG if e.kernel_name.startswith("sm90_") and e.weight_format != "bf16")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("build", help="compile kernels into the kernel cache (CPU-only machines work)")
    p.add_argument("--arch", default="sm_90a", choices=["sm_90a"])
    p.add_argument(
        "--backend",
        default=BF16,
        choices=[BF16, *BLOCK_SCALED],
        help="which kernel family (default: the BF16 one)",
    )
    p.add_argument(
        "--contract",
        nargs="+",
        default=None,
        help=f"contracts or geometries ({GEOMETRY_FORM}), or 'all' ({', '.join(CONTRACTS)})",
    )
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--experts", type=int, help="experts per rank (with --hidden ...); else from the contract")
    p.add_argument("--top-k", type=int)
    p.add_argument("--activation", default="swiglu", choices=ACTIVATIONS)
    p.add_argument("--activation-limit", type=float, default=None)
    p.add_argument("--world-size", type=int, default=1, help="EP ranks (experts per rank = E / world size)")
    p.add_argument("--combine-dtype", default="bf16", choices=["bf16", "mxfp8"], help="the EP combine wire")
    p.add_argument(
        "--prequantized-input", action="store_true", help="block-scaled backends: activations given as codes and scales"
    )
    p.add_argument("--knobs", default=None, help="JSON knobs, e.g. '{\"tile_m\": 64}' (default: the defaults)")
    p.add_argument(
        "--bucket-overrides",
        nargs="+",
        default=None,
        metavar="JSON",
        help="world size 1: also build each token bucket's kernel with these knobs changed, one variant per JSON "
        '(e.g. \'{"swap_wg": 4, "swap_atoms": 1}\'); what scripts/drop_ab.py --bucket-overrides runs',
    )
    p.add_argument("--cache", default=None, help="cache directory (default: $FLASHINFER_MOE_EP_KERNEL_CACHE)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=16384,
        help="layer capacity: every token bucket up to it gets its kernel (default 16384)",
    )
    p.add_argument("--device-name", default="NVIDIA H200", help="GPU whose knob-cache entries to build for")
    p.add_argument("--force", action="store_true", help="rebuild even when cached")
    p.add_argument(
        "--resources",
        action="store_true",
        help="list every kernel's registers, stack frame + local memory (spills) and static shared memory "
        "(needs cuobjdump: a CUDA toolkit or `pip install nvidia-cuda-cuobjdump`); exit 1 if a kernel spills",
    )
    p.set_defaults(func=run)


def _configs(args: argparse.Namespace, cls: type = Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig, **extra: Any) -> list:
    """(name, config of ``cls``, local expert count) per requested shape; ``extra``: more config fields."""
    try:
        knobs = json.loads(args.knobs) if args.knobs else None
    except json.JSONDecodeError as exc:
        raise MoEEpConfigError(f"--knobs is not JSON ({exc}): {args.knobs!r}") from None
    shapes = []
    if args.contract:
        names = list(CONTRACTS) if args.contract == ["all"] else args.contract
        for name in names:
            c = get_contract(name)
            if c.num_experts % args.world_size:
                raise MoEEpConfigError(f"{name}: {c.num_experts} experts do not split over {args.world_size} ranks")
            shapes.append((name, c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation,
                           c.activation_limit))  # fmt: skip
    elif args.hidden and args.intermediate and args.experts and args.top_k:
        shapes.append(("custom", args.hidden, args.intermediate, args.experts * args.world_size, args.top_k,
                       args.activation, args.activation_limit))  # fmt: skip
    else:
        raise MoEEpConfigError("give --contract NAME [...] (or all), or --hidden --intermediate --experts --top-k")
    out = []
    for name, *fields in shapes:
        cfg = cls(*fields, knobs, combine_dtype=args.combine_dtype, **extra)
        out.append((name, cfg, cfg.num_experts // args.world_size))
    return out


def _block_scaled_jobs(args: argparse.Namespace) -> list[tuple[str, object]]:
    """Every token bucket's kernel of the MXFP8 / NVFP4 backend for the requested shapes (at world size
    > 1 the expert-parallel kernels, one GPU per rank)."""
    from ..backends.mega.kernel.sm90.block_scaled import EpPlacement, bucket_frontends

    cls = catalog_entry(args.backend).load_config_class()  # type: ignore[union-attr]
    jobs = []
    for name, cfg, e_local in _configs(args, cls, prequantized_input=args.prequantized_input):
        ep = None
        if args.world_size > 1:
            ep = EpPlacement(args.world_size, 1, (cfg.knobs or {}).get("dispatch", "pull"))
        frontends = bucket_frontends(cfg, e_local, ep)
        for fe in dict.fromkeys(frontends.values()):
            buckets = [b for b, f in frontends.items() if f is fe]
            jobs.append((f"{name} {cfg.weight_format} [{'/'.join(buckets)}]", fe))
    return jobs


def _bf16_ep_frontends(cfg: Any, world_size: int, max_tokens: int, context: Any) -> dict[str, Any]:
    """Bucket -> kernel of the BF16 EP layer, as ``Sm90Bf16EpBackend`` picks them (knobs, knob cache)."""
    from ..backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import ep_tuning

    geometry = tuning.make_geometry(cfg, cfg.num_experts)  # the EP kernel takes the global expert count
    buckets = ep_tuning.ep_buckets(world_size, max_tokens)
    knobs = None if cfg.knobs == tuning.AUTO else cfg.knobs
    tiles, _ = ep_tuning.layer_tiles(geometry, context, world_size, 1, buckets, knobs)
    try:
        return ep_tuning.bucket_frontends(geometry, world_size, 1, buckets, tiles)
    except (TypeError, ValueError) as exc:
        raise MoEEpConfigError(f"{cfg.kernel_name}: {exc}") from None


class _ResourceReport:
    """``build --resources``: each library's kernels after it is built, and whether any spills."""

    def __init__(self, enabled: bool) -> None:
        from ..backends.mega.kernel.drops import load_drop

        self.mod = load_drop("cutedsl_megamoe").kernel_resources
        self.tool = self.mod.find_cuobjdump() if enabled else None
        if enabled and self.tool is None:
            raise MoEEpConfigError(
                "--resources needs cuobjdump: install a CUDA toolkit or `pip install nvidia-cuda-cuobjdump`"
            )
        self.spilling: list[str] = []

    def add(self, label: str, lib: object) -> None:
        if self.tool is None:
            return
        resources = self.mod.kernel_resources(lib, self.tool)  # type: ignore[arg-type]
        print(self.mod.describe(resources), flush=True)
        self.spilling += [f"{label}: {r.short_name} ({r.spill_bytes} B stack + local)" for r in resources if r.spills]

    def status(self) -> int:
        if self.tool is None:
            return 0
        if self.spilling:
            print("kernels spilling registers (stack frame or local memory):\n  " + "\n  ".join(self.spilling))
            return 1
        print("resources: no kernel spills")
        return 0


def _override_jobs(jobs: list[tuple[str, Any]], overrides: list[str] | None) -> list[tuple[str, Any]]:
    """``jobs`` and, per JSON of ``overrides``, each job's frontend with those knobs changed; a bucket whose
    knobs cannot take a change is reported and left out (the A/B has no such point)."""
    if not overrides:
        return jobs
    changes = []
    for text in overrides:
        try:
            change = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MoEEpConfigError(f"--bucket-overrides: not JSON: {text!r} ({exc})") from None
        if not isinstance(change, dict) or not change:
            raise MoEEpConfigError(f"--bucket-overrides: want a non-empty JSON object of knobs, got {text!r}")
        changes.append(change)
    out = list(jobs)
    for label, fe in jobs:
        for change in changes:
            try:
                out.append((f"{label} + {json.dumps(change)}", fe.with_knobs(**change)))
            except TypeError as exc:  # a knob this family does not have: every bucket would fail alike
                raise MoEEpConfigError(f"--bucket-overrides {json.dumps(change)}: {exc}") from None
            except (ValueError, MoEEpConfigError) as exc:
                print(f"build: {label} + {json.dumps(change)}: skipped ({exc})")
    return out


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    report = _ResourceReport(args.resources)
    if args.bucket_overrides and (args.world_size > 1 or args.knobs):
        raise MoEEpConfigError("--bucket-overrides changes the token buckets' knobs at world size 1 (no --knobs)")
    root = Path(args.cache).expanduser() if args.cache else None
    if args.prequantized_input and args.backend not in BLOCK_SCALED:
        raise MoEEpConfigError("--prequantized-input applies to the block-scaled backends (--backend ...mxfp8/nvfp4)")
    if args.backend in BLOCK_SCALED:
        qjobs = _override_jobs(_block_scaled_jobs(args), args.bucket_overrides)
        print(f"build: {len(qjobs)} kernel(s) for {args.arch} ({args.backend})")
        for i, (label, fe) in enumerate(qjobs, 1):
            t0 = time.perf_counter()
            lib = fe.build(root, force=args.force)  # type: ignore[attr-defined]
            print(f"[{i}/{len(qjobs)}] {label}: {lib} ({time.perf_counter() - t0:.1f} s)", flush=True)
            report.add(label, lib)
        return report.status()
    context = tuning.tune_context_named(args.device_name, args.world_size)
    jobs = []
    for name, cfg, e_local in _configs(args):
        if args.world_size > 1:  # the expert-parallel kernels of an NVSHMEM layer (one GPU per rank)
            frontends = _bf16_ep_frontends(cfg, args.world_size, args.max_tokens, context)
        else:
            frontends = tuning.layer_profiles(cfg, e_local, args.max_tokens, context).frontends
        for fe in tuning.distinct(frontends.values()):
            buckets = [b for b, f in frontends.items() if f is fe]
            jobs.append((f"{name} [{'/'.join(buckets)}]", fe))
    jobs = _override_jobs(jobs, args.bucket_overrides)
    print(f"build: {len(jobs)} kernel(s) for {args.arch} (layer capacity {args.max_tokens} tokens)")
    for i, (label, fe) in enumerate(jobs, 1):
        t0 = time.perf_counter()
        print(f"[{i}/{len(jobs)}] {label}: {tuning.describe_knobs(fe.knobs)} ...", flush=True)
        lib = fe.build(root, force=args.force)
        print(f"[{i}/{len(jobs)}] {label}: {lib} ({time.perf_counter() - t0:.1f} s)", flush=True)
        report.add(label, lib)
    return report.status()


__all__ = ["add_parser", "run"]
