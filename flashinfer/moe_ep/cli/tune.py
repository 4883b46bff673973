"""``tune``: autotune a kernel backend offline, record the winners in the knob cache, build them into
the kernel cache (a server then starts with ``knobs=None`` without compiling or tuning).

One rank: ``python -m flashinfer.moe_ep tune --contract qwen3-30b-a3b --max-tokens 256 1024 4096``
(one T per token bucket).

Expert parallelism (the SM90 BF16 EP kernel: every token bucket of a layer whose per-rank capacity is
the largest ``--max-tokens``, see ``ep_tuning.bucket_plan``):
``torchrun --nproc_per_node=N -m flashinfer.moe_ep tune --contract ...`` (NVSHMEM, every rank in
lockstep), or ``--loopback R`` (R ranks in this process on one GPU: exercises the protocol; its
timings are recorded under "<device> (loopback)" and never serve a real EP layer).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from ..backends.mega.catalog import catalog_entry
from ..backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import tuning as bf16_tuning
from ..backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl.config import Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig
from ..backends.mega.kernel.sm90.runtime import sm90_requirements
from ..core.contracts import CONTRACTS, GEOMETRY_FORM, get_contract
from ..errors import MoEEpBackendUnavailableError, MoEEpConfigError

#: backends with a tuning surface, by kernel name.
TUNABLE = {Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig.kernel_name: bf16_tuning}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tune", help="autotune knobs per token bucket into the knob cache (GPU; torchrun for EP)")
    p.add_argument("--backend", default=Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig.kernel_name, choices=sorted(TUNABLE))
    p.add_argument(
        "--contract",
        nargs="+",
        required=True,
        help=f"contracts or geometries ({GEOMETRY_FORM}), or 'all' ({', '.join(CONTRACTS)})",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        nargs="+",
        default=[256, 1024, 4096],
        help="T to tune at, at most one per token bucket",
    )
    p.add_argument("--allow-nondeterministic", action="store_true", help="also try nondeterministic knob values")
    p.add_argument("--iters", type=int, default=20, help="timed launches per candidate")
    p.add_argument(
        "--margin",
        type=float,
        default=bf16_tuning.DEFAULT_MARGIN,
        help="a candidate replaces a bucket's defaults only when faster by more than this fraction (default 0.04)",
    )
    p.add_argument(
        "--loopback", type=int, default=0, metavar="R", help="tune the EP kernel with R loopback ranks on one GPU"
    )
    p.add_argument("--cache", default=None, help="kernel cache directory (default: $FLASHINFER_MOE_EP_KERNEL_CACHE)")
    p.add_argument("--knob-cache", default=None, help="knob cache file (default: $FLASHINFER_MOE_EP_KNOB_CACHE)")
    p.set_defaults(func=run)


def _ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank): torchrun's environment, else one rank."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    return rank, world, int(env.get("LOCAL_RANK", str(rank)))


def _weights(e_local: int, hidden: int, fc1_rows: int, inter: int, device: torch.device, seed: int) -> Any:
    """Random bf16 weights made on the device (timing does not depend on the values)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(e_local, fc1_rows, hidden, generator=gen, device=device, dtype=torch.bfloat16)
    w2 = torch.randn(e_local, hidden, inter, generator=gen, device=device, dtype=torch.bfloat16)
    return w13.mul_(hidden**-0.5), w2.mul_(inter**-0.5)


def _ep_layer(c: Any, bootstrap: Any, capacity: int, device: torch.device) -> Any:
    """An EP layer of contract ``c`` with knobs="auto" and random weights for ``bootstrap.rank``."""
    import flashinfer.moe_ep as moe

    cfg = Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit, knobs="auto"
    )
    e_local = c.num_experts // bootstrap.world_size
    w13, w2 = _weights(e_local, c.hidden_size, cfg.fc1_rows, c.intermediate_size, device, 1234 + bootstrap.rank)
    return moe.MoEEpLayer(bootstrap, moe.FleetParams(c.num_experts, capacity, c.hidden_size),
                          moe.MoEWeightPack(w13, w2), moe.MegaConfig(cfg), check_values=False)  # fmt: skip


def _report_ep(name: str, layer: Any, rank: int) -> None:
    from ..backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl.ep_tuning import describe_ep_knobs

    if rank != 0:
        return
    for bucket, r in layer.backend.tune_results.items():
        dropped = sum(not row.ok for row in r.table)
        print(f"{name} EP world {layer.bootstrap.world_size} {bucket}: {describe_ep_knobs(r.winner)}: "
              f"{r.winner_ms:.4f} ms ({len(r.table)} candidates, {dropped} dropped)", flush=True)  # fmt: skip


def run_ep(args: argparse.Namespace, contracts: list[Any], rank: int, world: int, device: torch.device) -> int:
    """EP autotune: over NVSHMEM under torchrun, or with ``--loopback R`` ranks in this process."""
    import flashinfer.moe_ep as moe

    bf16 = Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig.kernel_name
    if args.backend != bf16:
        raise MoEEpConfigError(f"expert-parallel tuning exists for {bf16} only, not {args.backend}")
    capacity = max(args.max_tokens)
    if args.knob_cache:
        os.environ["FLASHINFER_MOE_EP_KNOB_CACHE"] = str(Path(args.knob_cache).expanduser())
    if args.cache:
        os.environ["FLASHINFER_MOE_EP_KERNEL_CACHE"] = str(Path(args.cache).expanduser())
    if args.loopback:
        for c in contracts:
            group = moe.make_loopback_group(args.loopback, device)
            layers = [_ep_layer(c, moe.BootstrapConfig(world_size=args.loopback, rank=r, device=device,
                                                       symmetric_memory="loopback", loopback_group=group),
                                capacity, device) for r in range(args.loopback)]  # fmt: skip
            for layer in layers:
                layer.warmup()  # the first one tunes every rank
            _report_ep(c.name, layers[0], 0)
            for layer in layers:
                layer.destroy()
            torch.cuda.empty_cache()
        return 0
    from ..core.runtime.bootstrap import bootstrap_moe_ep_runtime, finalize_moe_ep_runtime

    runtime = bootstrap_moe_ep_runtime(moe.BootstrapConfig(world_size=world, rank=rank, device=device))
    try:
        for c in contracts:
            layer = _ep_layer(c, moe.BootstrapConfig(world_size=world, rank=rank, device=device,
                                                     process_group=runtime.group), capacity, device)  # fmt: skip
            layer.warmup()  # collective: every rank tunes in lockstep
            _report_ep(c.name, layer, rank)
            layer.destroy()
            torch.cuda.empty_cache()
    finally:
        finalize_moe_ep_runtime()
    return 0


def run(args: argparse.Namespace) -> int:
    rank, world, local_rank = _ranks()
    device = torch.device("cuda", local_rank)
    missing = sm90_requirements(device)
    if missing:
        raise MoEEpBackendUnavailableError(
            f"tune times kernels on the GPU and cannot run here; it needs {'; '.join(missing)} "
            "(to only compile kernels, use `build`)"
        )
    tuning = TUNABLE[args.backend]
    entry = catalog_entry(args.backend)
    assert entry is not None
    names = list(CONTRACTS) if args.contract == ["all"] else args.contract
    contracts = [get_contract(n) for n in names]
    root = Path(args.cache).expanduser() if args.cache else None
    knob_path = Path(args.knob_cache).expanduser() if args.knob_cache else None

    torch.cuda.set_device(device)
    if world > 1 or args.loopback:
        return run_ep(args, contracts, rank, world, device)
    for c in contracts:
        cfg = entry.load_config_class()(
            c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit
        )
        e_local = c.num_experts // world
        w13, w2 = _weights(e_local, c.hidden_size, cfg.fc1_rows, c.intermediate_size, device, 1234 + rank)
        results = tuning.autotune_profiles(
            cfg,
            e_local,
            args.max_tokens,
            w13,
            w2,
            device,
            context=tuning.tune_context(device, world),
            rank=rank,
            world_size=world,
            allow_nondeterministic=args.allow_nondeterministic,
            cache_path=knob_path,
            kernel_cache_root=root,
            progress=True,
            iters=args.iters,
            margin=args.margin,
        )
        libs = tuning.build_winners(cfg, e_local, results, root)
        del w13, w2
        torch.cuda.empty_cache()
        if rank == 0:
            for bucket, r in results.items():
                dropped = sum(not row.ok for row in r.table)
                print(
                    f"{c.name} {bucket}: {tuning.describe_knobs(r.winner)}: {r.winner_ms:.4f} ms "
                    f"({len(r.table)} candidates, {dropped} dropped) -> {libs[bucket]}",
                    flush=True,
                )
            print(f"knobs recorded in {tuning.knob_cache_file(knob_path) or '(knob cache off)'}", flush=True)
    return 0


__all__ = ["TUNABLE", "add_parser", "run"]
