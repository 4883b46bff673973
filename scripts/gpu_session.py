#!/usr/bin/env python3
"""One GPU session in two halves, so device time is spent only on running.

Here (any machine, no GPU needed):   python scripts/gpu_session.py build [--cache .kcache]
    compiles every kernel variant the GPU tests and the benchmark use into the kernel cache.
There (the H200, through the device tool, carrying .gpu and .kcache):
    source .gpu/env.sh && python scripts/gpu_session.py run [--bench-tokens ...] 2>&1 | tee $OUT/log
    runs the GPU tests, then the benchmark, and prints the benchmark table last.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BENCH_CONTRACTS = ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"]
BENCH_MAX_TOKENS = 16384  # the bench layer's capacity (its largest T)
TUNE_TOKENS = [256, 1024, 4096]  # one T per token bucket for `tune --max-tokens` (the buckets' tune sizes)
os.environ.setdefault("FLASHINFER_MOE_EP_KNOB_CACHE", "off")  # defaults only, the same here and there


def build_quant(cache: Path) -> None:
    """The MXFP8 / NVFP4 kernels of their GPU test and of the benchmark contracts."""
    from flashinfer.moe_ep.backends.mega.kernel.sm90.block_scaled import bucket_frontends
    from flashinfer.moe_ep.core.contracts import get_contract
    from tests.backends.mega.kernel.sm90.test_quant_gpu import CONFIG_CLS, GPU_VARIANTS

    variants = [(name, CONFIG_CLS[fmt](**geometry)) for name, fmt, geometry in GPU_VARIANTS]
    for fmt, cls in CONFIG_CLS.items():
        for name in BENCH_CONTRACTS:
            c = get_contract(name)
            variants.append((f"{fmt}-{name}", cls(c.hidden_size, c.intermediate_size, c.num_experts, c.top_k,
                                                  c.activation, c.activation_limit)))  # fmt: skip
    for i, (name, cfg) in enumerate(variants, 1):
        t0 = time.perf_counter()
        for fe in dict.fromkeys(bucket_frontends(cfg, cfg.num_experts).values()):
            lib = fe.build(cache)
            print(f"[{i}/{len(variants)}] {name} tile_m={fe.knobs.tile_m}: {lib.name} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip


def build(cache: Path, tune_contracts: bool = False, only: str | None = None) -> int:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    build_quant(cache)
    if only == "quant":
        return 0
    import flashinfer.moe_ep as moe
    from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import tuning
    from flashinfer.moe_ep.core.contracts import get_contract
    from tests.backends.mega.kernel.sm90.test_bf16_gpu import GPU_VARIANTS, MAX_T

    variants = list(GPU_VARIANTS)
    for name in BENCH_CONTRACTS:
        c = get_contract(name)
        variants.append((name, moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
            c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit)))  # fmt: skip
    context = tuning.tune_context_named("NVIDIA H200")
    for i, (name, cfg) in enumerate(variants, 1):
        cap = MAX_T if i <= len(GPU_VARIANTS) else BENCH_MAX_TOKENS
        for fe in tuning.layer_profiles(cfg, cfg.num_experts, cap, context).distinct():  # every token bucket
            t0 = time.perf_counter()
            lib = fe.build(cache)
            print(f"[{i}/{len(variants)}] {name} ({tuning.describe_knobs(fe.knobs)}): {lib.name} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
    # every autotune candidate of the tuning GPU test (the GPU machine cannot compile)
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop
    from tests.backends.mega.kernel.sm90.test_bf16_tuning_gpu import AUTO_GEOMETRY, AUTO_MAX_TOKENS

    def prebuild_candidates(cfg: moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig, tokens: list[int], label: str) -> None:
        geometry = tuning.make_geometry(cfg, cfg.num_experts)
        seen = {k for t in tokens for k in drop.tuner.candidates(geometry, t)}
        for knobs in sorted(seen, key=repr):
            drop.Bf16Frontend(geometry, knobs).build(cache)
        print(f"autotune candidates of {label}: {len(seen)} kernels", flush=True)

    prebuild_candidates(
        moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(**AUTO_GEOMETRY),
        [drop.tuner.tune_tokens(b, AUTO_MAX_TOKENS) for b in drop.tuner.buckets_for(AUTO_MAX_TOKENS)],
        "the tuning test",
    )
    if tune_contracts:
        for name in BENCH_CONTRACTS:
            c = get_contract(name)
            cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
                c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit
            )
            prebuild_candidates(cfg, TUNE_TOKENS, name)

    # the EP layer test (loopback ranks; the EP kernel takes the global expert count)
    from tests.backends.mega.kernel.sm90.test_bf16_ep_layer_gpu import EP_CASES, EP_GEOMETRY

    ep_cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(**EP_GEOMETRY)
    ep_geometry = tuning.make_geometry(ep_cfg, ep_cfg.num_experts)
    for world, knobs in EP_CASES:
        ep_knobs = drop.default_bf16_ep_knobs(ep_geometry, world, world, knobs)
        lib = drop.Bf16EpFrontend(ep_geometry, ep_knobs).build(cache)
        print(f"EP layer test, {world} loopback ranks, knobs {knobs}: {lib.name}", flush=True)
    from tests.backends.mega.kernel.sm90.test_bf16_ep_layer_gpu import EP_AUTO_WORLD

    cands = drop.ep_candidates(ep_geometry, EP_AUTO_WORLD, EP_AUTO_WORLD)
    for knobs in cands:
        drop.Bf16EpFrontend(ep_geometry, knobs).build(cache)
    print(f"EP layer test knobs='auto', {EP_AUTO_WORLD} loopback ranks: {len(cands)} candidates", flush=True)
    # the torchrun multirank test of the SM90 EP layer (one GPU per rank: ranks_per_gpu 1), for issue #8
    from tests.multirank.test_torchrun import SM90_EP_GEOMETRY, SM90_EP_WORLDS

    g = SM90_EP_GEOMETRY
    for world in SM90_EP_WORLDS:
        cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
            g["hidden_size"], g["intermediate_size"], g["experts_per_rank"] * world, g["top_k"]
        )
        geometry = tuning.make_geometry(cfg, cfg.num_experts)
        for knobs in drop.ep_candidates(geometry, world, 1):  # the defaults first; all: the knobs="auto" test
            lib = drop.Bf16EpFrontend(geometry, knobs).build(cache)
        print(f"multirank SM90 EP test, world {world}: {lib.name} and the other autotune candidates", flush=True)
    # scripts/ep_bench.py (issue #8): the bench contracts' EP kernels, one GPU per rank
    from scripts.ep_bench import BENCH_CONTRACTS as EP_BENCH_CONTRACTS

    for name in EP_BENCH_CONTRACTS:
        c = get_contract(name)
        cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
            c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit
        )
        geometry = tuning.make_geometry(cfg, cfg.num_experts)
        for world in SM90_EP_WORLDS:
            lib = drop.Bf16EpFrontend(geometry, drop.default_bf16_ep_knobs(geometry, world, 1)).build(cache)
            print(f"EP bench {name}, world {world}: {lib.name}", flush=True)
    size = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    print(f"kernel cache {cache}: {size / 2**20:.1f} MiB")
    return 0


#: GPU test files that must run in their own pytest process (they set CUDA environment before CUDA starts)
OWN_PROCESS = (
    "tests/backends/mega/kernel/sm90/test_bf16_ep_loopback_gpu.py",
    "tests/backends/mega/kernel/sm90/test_bf16_ep_layer_gpu.py",
)
BENCH_BACKENDS = ["sm90_bf16_bf16_bf16_cutedsl", "sm90_mxfp8_mxfp8_bf16_cutedsl", "sm90_nvfp4_nvfp4_bf16_cutedsl"]


def run(cache: Path, bench_tokens: list[str], out: Path, skip_tests: bool, skip_bench: bool = False) -> int:
    env = {**os.environ, "FLASHINFER_MOE_EP_KERNEL_CACHE": str(cache)}
    status = 0
    if not skip_tests:
        ignore = [f"--ignore={p}" for p in OWN_PROCESS]
        for args in (["tests", *ignore], *([p] for p in OWN_PROCESS)):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", *args], env=env, cwd=ROOT)
            print(f"gpu tests {' '.join(args[:1])}: exit {r.returncode} ({time.perf_counter() - t0:.0f} s)", flush=True)
            status = status or r.returncode
    if skip_bench:
        return status
    cmd = [sys.executable, "-m", "flashinfer.moe_ep", "bench", "--contract", *BENCH_CONTRACTS,
           "--tokens", *bench_tokens, "--backend", *BENCH_BACKENDS, "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, env=env, cwd=ROOT)
    return status or r.returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["build", "run"])
    p.add_argument("--cache", type=Path, default=ROOT / ".kcache")
    p.add_argument("--bench-tokens", nargs="+", default=["1", "128", "4096", "16384"])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "bench-out")))
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument(
        "--tune-contracts", action="store_true", help="build: also every autotune candidate of the bench contracts"
    )
    p.add_argument("--only", choices=["quant"], help="build: only the MXFP8 / NVFP4 kernels")
    a = p.parse_args()
    if a.what == "build":
        return build(a.cache, a.tune_contracts, a.only)
    return run(a.cache, a.bench_tokens, a.out, a.skip_tests, a.skip_bench)


if __name__ == "__main__":
    sys.exit(main())
