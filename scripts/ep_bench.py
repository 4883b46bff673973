#!/usr/bin/env python3
"""Expert-parallel benchmark (issue #8): the mega layer against the split baseline, one process per GPU.

    NVSHMEM_SYMMETRIC_SIZE=10G torchrun --nproc_per_node=N scripts/ep_bench.py \\
        --contract deepseek-v3 qwen3-235b-a22b --tokens 8 128 2048 8192

Per contract and tokens per rank, on the same inputs: the SM90 layer of ``--format`` (BF16, or MXFP8 /
NVFP4 with the BF16 weights quantized at preprocessing) at world size N (in-kernel dispatch and
combine over NVSHMEM; ``--combine-dtype mxfp8`` for the MXFP8 combine wire) and
``core.baselines.split_ep_moe`` (``all_to_all_single`` dispatch,
``torch._grouped_mm`` experts, ``all_to_all_single`` combine: what an engine builds without us). Each
timed launch starts after a barrier; a launch's time is the slowest rank's (CUDA events, all-reduce
MAX), the figure is the median over rotating input sets. The mega output is checked against the
baseline's on every rank (mean relative error; with a quantized format or wire that is the
quantization error, e.g. ~14 % mean elementwise for MXFP8, TUNING.md). Kernels must be prebuilt
(``scripts/gpu_session.py build`` does it for the bench contracts at world 2, 4 and 8). The symmetric
heap grows with ranks and tokens (docs/ep.md: deepseek-v3 at 8 ranks x 8192 tokens needs ~7.7 GB
per rank; a too-small heap raises an error naming the size to set). Without CUDA the ranks run on the
CPU over gloo with the reference backend: a smoke test of this harness, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BENCH_CONTRACTS = ("deepseek-v3", "qwen3-235b-a22b")
FORMATS = ("bf16", "mxfp8", "nvfp4")
MAX_TOKENS = 8192  # the largest tokens per rank the prebuilt kernels serve (every token bucket up to it)


def ep_config(contract, fmt: str, knobs, combine_dtype: str = "bf16"):
    """The SM90 mega config of ``contract`` in weight format ``fmt`` (what the bench times and
    ``gpu_session.py build`` prebuilds; NVFP4 with unit static activation global scales)."""
    import flashinfer.moe_ep as moe

    cls = {
        "bf16": moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig,
        "mxfp8": moe.Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
        "nvfp4": moe.Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
    }[fmt]
    c = contract
    return cls(c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit,
               knobs=knobs, combine_dtype=combine_dtype)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contract", nargs="+", default=list(BENCH_CONTRACTS))
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 128, 2048, 8192], help="tokens per rank")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sets", type=int, default=3, help="rotating input sets")
    p.add_argument("--knobs", nargs="+", default=["default"], metavar="SPEC",
                   help="one mega layer per spec: 'default' (the knob cache, else the EP defaults), 'auto' "
                        "(autotuned at warmup, recorded in --knob-cache) or knobs like "
                        "tile_m=128,fc1_tile_n=256,fc2_tile_n=128,cluster_m=2")  # fmt: skip
    p.add_argument("--profile", type=int, nargs="*", default=[], help="tokens per rank to list kernel times at")
    p.add_argument("--knob-cache", default=None, help="the knob cache file that 'auto' writes (default: off)")
    p.add_argument("--format", default="bf16", choices=list(FORMATS), help="the mega layer's weight format")
    p.add_argument("--combine-dtype", default="bf16", choices=["bf16", "mxfp8"], help="the EP combine wire")
    a = p.parse_args()
    if a.format != "bf16" and any(k not in ("default",) and not k.startswith("dispatch=") for k in a.knobs):
        p.error("the MXFP8 / NVFP4 layers take --knobs default or dispatch=pull|push")
    os.environ["FLASHINFER_MOE_EP_KNOB_CACHE"] = a.knob_cache or "off"

    import torch
    import torch.distributed as dist

    import flashinfer.moe_ep as moe
    from flashinfer.moe_ep.cli.bench import launch_times_ms
    from flashinfer.moe_ep.core.baselines import split_ep_moe
    from flashinfer.moe_ep.core.contracts import get_contract
    from flashinfer.moe_ep.core.inputs import make_expert_weights, make_token_inputs, relative_errors
    from flashinfer.moe_ep.core.runtime.bootstrap import bootstrap_moe_ep_runtime, finalize_moe_ep_runtime

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    rt = bootstrap_moe_ep_runtime(moe.BootstrapConfig(world_size=world, rank=rank, device=dev))
    group = rt.group

    def slowest_rank_ms(fn, iters: int, sets: int) -> float:
        """Median over launches of the slowest rank's time; every launch starts after a barrier."""

        def aligned() -> None:  # every rank starts its launch after all arrived and its GPU is idle
            dist.barrier(group=group)
            if gpu:
                torch.cuda.synchronize()

        times = launch_times_ms(fn, iters, sets, before=aligned)
        per_launch = torch.tensor(times, dtype=torch.float64, device=dev)
        dist.all_reduce(per_launch, op=dist.ReduceOp.MAX, group=group)
        return statistics.median(per_launch.tolist())

    def knobs_of(spec: str) -> dict[str, int] | str | None:
        if spec == "default":  # per token bucket: the knob cache (--knob-cache), else drop.EP_BUCKET_DEFAULTS
            return None
        if spec == "auto":
            return spec
        return {k: int(v) if v.isdigit() else v for k, v in (kv.split("=") for kv in spec.split(","))}

    def kernel_table(label: str, fn, sets: int, launches: int = 6) -> None:
        """Rank 0's GPU time per kernel of ``launches`` barrier-aligned launches (torch profiler)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(launches):
                dist.barrier(group=group)
                torch.cuda.synchronize()
                fn(i % sets)
            torch.cuda.synchronize()
        if rank == 0:
            print(f"  kernels of {label}, per launch (rank 0):", flush=True)
            events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
            for e in events[:14]:
                print(f"    {e.device_time_total / launches / 1e3:8.3f} ms  x{e.count / launches:4.1f}  {e.key[:90]}")

    rows = []
    for name, spec in ((n, s) for n in a.contract for s in a.knobs):
        c = get_contract(name)
        if c.num_experts % world:
            raise SystemExit(f"{name}: {c.num_experts} experts do not split over {world} ranks")
        e_local = c.num_experts // world
        wgen = torch.Generator(device=dev).manual_seed(100 + rank)  # this rank's experts
        w13, w2 = make_expert_weights(e_local, c.hidden_size, c.intermediate_size, c.activation, generator=wgen,
                                      device=dev)  # fmt: skip
        if gpu:
            config = ep_config(c, a.format, knobs_of(spec), a.combine_dtype)
        else:
            config = moe.ReferenceMegaMoeConfig(
                c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit,
                weight_format=a.format, combine_dtype=a.combine_dtype,
            )  # fmt: skip
        layer = moe.MoEEpLayer(
            moe.BootstrapConfig(
                world_size=world,
                rank=rank,
                device=dev,
                process_group=group,
                transport_timeout_s=30.0 if gpu else 3600.0,
            ),  # CPU ranks compute slowly
            moe.FleetParams(c.num_experts, max(a.tokens), c.hidden_size),
            moe.MoEWeightPack(w13, w2),
            backend=moe.MegaConfig(config),
            check_values=False,
        )
        if gpu and rank == 0:
            free, total = torch.cuda.mem_get_info(dev)
            print(f"{name} [{spec}]: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free before warmup", flush=True)
        layer.warmup()  # knobs "auto": the collective autotune
        if gpu and rank == 0:
            from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

            be = layer._backend
            if a.format == "bf16":
                tiles = {b: drop.ep_knob_dict(fe.knobs) for b, fe in be.by_bucket.items()}
            else:
                tiles = {b: f"tile_m={fe.knobs.tile_m} swap_ab={fe.knobs.swap_ab}" for b, fe in be.frontends.items()}
            print(f"{name} knobs {spec}: {tiles}", flush=True)
            for bucket, result in getattr(be, "tune_results", {}).items():  # knobs "auto": every candidate's time
                ranked = sorted(result.table, key=lambda r: r.ms)
                tiles_ms = (
                    "/".join(map(str, drop.ep_knob_dict(r.candidate).values())) + f" {r.ms:.3f}" for r in ranked
                )
                print(f"  autotune {name} {bucket} (m/fc1/fc2 ms): " + ", ".join(tiles_ms), flush=True)
        w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
        for t in a.tokens:
            ins = [moe.MoEEpTensors(*s) for s in make_token_inputs(
                t, c.hidden_size, c.num_experts, c.top_k, a.sets, seed=rank, device=dev)]  # fmt: skip
            outs = [torch.empty(t, c.hidden_size, dtype=torch.bfloat16, device=dev) for _ in range(a.sets)]

            def mega(i: int, ins=ins, outs=outs, layer=layer) -> None:
                layer.forward(ins[i], output=outs[i])

            def split(i: int, ins=ins, c=c, w13_t=w13_t, w2_t=w2_t) -> torch.Tensor:
                s = ins[i]
                return split_ep_moe(s.hidden_states, s.topk_ids, s.topk_weights, w13_t, w2_t, group,
                                    c.activation, c.activation_limit)  # fmt: skip

            mega_ms = slowest_rank_ms(mega, a.iters, a.sets)
            split_ms = slowest_rank_ms(split, a.iters, a.sets)
            if gpu and t in a.profile:
                kernel_table(f"{name} [{spec}] T/rank={t}", mega, a.sets)
            mega(0)
            layer.check_transport()
            err = torch.tensor([relative_errors(outs[0], split(0))[0] if t else 0.0], dtype=torch.float64, device=dev)
            dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)
            tflops = c.flops(t * world) / (mega_ms * 1e-3) / 1e12
            rows.append((name, spec, t, mega_ms, split_ms, split_ms / mega_ms, tflops, float(err)))
            if rank == 0:
                print(f"  {name} [{spec}] T/rank={t}: mega {mega_ms:.3f} ms, split {split_ms:.3f} ms, "
                      f"x{split_ms / mega_ms:.2f}, {tflops:.0f} TFLOP/s, max-rank mean rel err {float(err):.1e}",
                      flush=True)  # fmt: skip
        layer.destroy()
        del layer, w13, w2, w13_t, w2_t
        mega = split = None  # their default arguments held the layer and its weights
        if gpu:
            torch.cuda.empty_cache()
    if rank == 0:
        kind = torch.cuda.get_device_name() if gpu else "CPU (gloo, reference backend: a harness smoke test)"
        print(f"\nEP bench, world {world}, {kind}; backend {type(config).__name__}, wire {a.combine_dtype}")
        short = {"tile_m=": "m", ",fc1_tile_n=": "/", ",fc2_tile_n=": "/", ",cluster_m=": "c", ",dispatch=": " "}
        head = ("contract", "knobs", "T/rank", "mega ms", "split ms", "x split", "TFLOP/s", "err")
        print(f"{head[0]:<16} {head[1]:<18} " + " ".join(f"{h:>9}" for h in head[2:]))
        for name, spec, t, m, s, r, tf, err in rows:
            for long, abbrev in short.items():
                spec = spec.replace(long, abbrev)
            print(f"{name:<16} {spec:<18} {t:>9} {m:>9.3f} {s:>9.3f} {r:>9.2f} {tf:>9.0f} {err:>9.1e}")
    finalize_moe_ep_runtime()
    return 0


if __name__ == "__main__":
    sys.exit(main())
