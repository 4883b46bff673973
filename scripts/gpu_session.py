#!/usr/bin/env python3
"""One GPU session in two halves, so device time is spent only on running.

Here (any machine, no GPU needed):   python scripts/gpu_session.py build [--cache .kcache] [--jobs 2]
    compiles every kernel variant the GPU tests and the benchmark use into the kernel cache (--jobs:
    the block-scaled kernels in that many processes, beside the BF16 and EP builds).
There (the H200, through the device tool, carrying .gpu and .kcache):
    source .gpu/env.sh && python scripts/gpu_session.py run [--bench-tokens ...] 2>&1 | tee $OUT/log
    runs the GPU tests, then the benchmark, and prints the benchmark table last.
On a machine of N GPUs:   source .gpu/env.sh && python scripts/gpu_session.py multigpu --world N
    runs the torchrun multirank tests and scripts/ep_bench.py (the EP kernels: build --only ep).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BENCH_CONTRACTS = ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"]
BENCH_MAX_TOKENS = 16384  # the bench layer's capacity (its largest T)
EP_TUNE_WORLDS = (2,)  # world sizes whose every EP candidate of the bench contracts is prebuilt
TUNE_TOKENS = [256, 1024, 4096]  # one T per token bucket for `tune --max-tokens` (the buckets' tune sizes)
os.environ.setdefault("FLASHINFER_MOE_EP_KNOB_CACHE", "off")  # defaults only, the same here and there


#: explicit knobs of the block-scaled token-bucket sweep (`bench --knobs`), built for the bench contracts
QUANT_SWEEP_KNOBS = [{"tile_m": t, "swap_ab": True} for t in (64, 128)]


def build_quant(cache: Path, shard: tuple[int, int] = (0, 1), bench_only: bool = False) -> None:
    """The MXFP8 / NVFP4 kernels of their GPU test and of the benchmark contracts (every token bucket,
    with bf16 and with pre-quantized activations, and ``QUANT_SWEEP_KNOBS``). ``shard`` (i, n): only
    every n-th distinct kernel from the i-th (``build --jobs`` runs the shards side by side).
    ``bench_only``: only the benchmark contracts' default kernels."""
    from flashinfer.moe_ep.backends.mega.kernel.sm90.block_scaled import bucket_frontends
    from flashinfer.moe_ep.core.contracts import get_contract
    from tests.backends.mega.kernel.sm90.test_quant_gpu import (
        CONFIG_CLS,
        GPU_VARIANTS,
        register_store_twin,
        routed_gemv_twin,
        without_l2_prefetch,
    )

    tests = [] if bench_only else GPU_VARIANTS
    variants = [(name, CONFIG_CLS[fmt](**geometry)) for name, fmt, geometry in tests]
    # test_pair_chain_gives_the_gemvs_bits: each pair-chain variant's twin, the routed GEMV chain on its geometry
    variants += [(f"{name}-twin", CONFIG_CLS[fmt](**{**geometry, "knobs": routed_gemv_twin(geometry["knobs"])}))
                 for name, fmt, geometry in tests if "-pairs" in name]  # fmt: skip
    # test_tma_store_gives_the_register_stores_bits: each -tma variant's twin with FC2's register stores
    variants += [(f"{name}-twin", CONFIG_CLS[fmt](**{**geometry, "knobs": register_store_twin(geometry["knobs"])}))
                 for name, fmt, geometry in tests if name.endswith("-tma")]  # fmt: skip
    # test_l2_prefetch_gives_the_same_bits: each -l2pf variant's twin without the GEMVs' L2 prefetches
    variants += [(f"{name}-twin", CONFIG_CLS[fmt](**{**geometry, "knobs": without_l2_prefetch(geometry["knobs"])}))
                 for name, fmt, geometry in tests if name.endswith("-l2pf")]  # fmt: skip
    for fmt, cls in CONFIG_CLS.items():
        for name in BENCH_CONTRACTS:
            c = get_contract(name)
            shape = (c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit)
            for knobs in (None,) if bench_only else (None, *QUANT_SWEEP_KNOBS):
                variants.append((f"{fmt}-{name}", cls(*shape, knobs)))
            if not bench_only:  # bench --prequantized
                variants.append((f"{fmt}-{name}-prequantized", cls(*shape, prequantized_input=True)))
    kernels: dict[str, tuple[str, object]] = {}
    for name, cfg in variants:
        for fe in bucket_frontends(cfg, cfg.num_experts).values():
            kernels.setdefault(fe.key.digest(), (name, fe))
    mine = sorted(kernels.items())[shard[0] :: shard[1]]
    for i, (_, (name, fe)) in enumerate(mine, 1):
        t0 = time.perf_counter()
        lib = fe.build(cache)
        print(f"[{i}/{len(mine)}] {name} tile_m={fe.knobs.tile_m}: {lib.name} ({time.perf_counter() - t0:.1f} s)",
              flush=True)  # fmt: skip


def build(
    cache: Path,
    tune_contracts: bool = False,
    only: str | None = None,
    ep_worlds=(2, 4, 8),
    jobs: int = 1,
    shard: tuple[int, int] | None = None,
    bench_only: bool = False,
) -> int:
    """``jobs`` > 1: the block-scaled kernels (most of the build) compile in that many processes, which
    run beside the BF16 and EP builds of this one. ``shard``: one such process (quant kernels only).
    ``bench_only``: only the default kernels of the benchmark contracts (world size 1, no EP)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    if shard is not None:
        build_quant(cache, shard, bench_only)
        return 0
    children = []
    if only in (None, "quant") and jobs > 1:
        me = [sys.executable, str(Path(__file__).resolve()), "build", "--cache", str(cache)]
        me += ["--bench-only"] if bench_only else []
        children = [subprocess.Popen([*me, "--shard", f"{i}/{jobs}"], cwd=ROOT) for i in range(jobs)]
    elif only in (None, "quant"):
        build_quant(cache, bench_only=bench_only)
    if only in (None, "bf16"):
        build_bf16(cache, tune_contracts, bench_only)
    if only in (None, "ep") and not bench_only:
        build_ep(cache, tuple(ep_worlds))
    if any(child.wait() for child in children):
        print("build: a block-scaled shard failed (its output is above)", flush=True)
        return 1
    size = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    print(f"kernel cache {cache}: {size / 2**20:.1f} MiB")
    return 0


def build_bf16(cache: Path, tune_contracts: bool, bench_only: bool = False) -> None:
    """The world-1 BF16 kernels: GPU tests, bench contracts (every token bucket), autotune candidates
    (``bench_only``: the bench contracts only)."""
    import flashinfer.moe_ep as moe
    from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import tuning
    from flashinfer.moe_ep.core.contracts import get_contract
    from tests.backends.mega.kernel.sm90.test_bf16_gpu import GPU_VARIANTS, capacity

    tests = [] if bench_only else list(GPU_VARIANTS)
    variants = list(tests)
    for name in BENCH_CONTRACTS:
        c = get_contract(name)
        variants.append((name, moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
            c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit)))  # fmt: skip
    context = tuning.tune_context_named("NVIDIA H200")
    for i, (name, cfg) in enumerate(variants, 1):
        cap = capacity(name) if i <= len(tests) else BENCH_MAX_TOKENS
        for fe in tuning.layer_profiles(cfg, cfg.num_experts, cap, context).distinct():  # every token bucket
            t0 = time.perf_counter()
            lib = fe.build(cache)
            print(f"[{i}/{len(variants)}] {name} ({tuning.describe_knobs(fe.knobs)}): {lib.name} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
    if bench_only:
        return
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


def build_ep(cache: Path, worlds: tuple[int, ...]) -> None:
    """The expert-parallel kernels: the loopback layer test, and at each of ``worlds`` (one GPU per
    rank) the torchrun tests and scripts/ep_bench.py."""
    import flashinfer.moe_ep as moe
    from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import ep_tuning, tuning
    from flashinfer.moe_ep.core.contracts import get_contract
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

    def build_layer(geometry, world: int, ranks_per_gpu: int, knobs: dict | None, max_tokens: int) -> list[str]:
        """The kernel of every token bucket of an EP layer of this capacity (knob cache off)."""
        buckets = ep_tuning.ep_buckets(world, max_tokens)
        fronts = ep_tuning.bucket_frontends(
            geometry, world, ranks_per_gpu, buckets, {b.name: knobs or {} for b in buckets}
        )
        return [fe.build(cache).name for fe in tuning.distinct(fronts.values())]

    def build_candidates(geometry, world: int, ranks_per_gpu: int, max_tokens: int) -> int:
        """Every knob set ``knobs="auto"`` tries for a layer of this capacity (each bucket's own)."""
        per_bucket = ep_tuning.autotune_candidates(geometry, world, ranks_per_gpu, max_tokens)
        cands = dict.fromkeys(k for ks in per_bucket.values() for k in ks)
        for knobs in cands:
            drop.Bf16EpFrontend(geometry, knobs).build(cache)
        return len(cands)

    # the EP layer test (loopback ranks; the EP kernel takes the global expert count)
    from tests.backends.mega.kernel.sm90.test_bf16_ep_layer_gpu import EP_CASES, EP_GEOMETRY, EP_MAX_TOKENS

    ep_cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(**EP_GEOMETRY)
    ep_geometry = tuning.make_geometry(ep_cfg, ep_cfg.num_experts)
    for world, knobs in EP_CASES:
        libs = build_layer(ep_geometry, world, world, knobs, EP_MAX_TOKENS)
        print(f"EP layer test, {world} loopback ranks, knobs {knobs}: {', '.join(libs)}", flush=True)
    from tests.backends.mega.kernel.sm90.test_bf16_ep_layer_gpu import EP_AUTO_MAX_TOKENS, EP_AUTO_WORLD

    n = build_candidates(ep_geometry, EP_AUTO_WORLD, EP_AUTO_WORLD, EP_AUTO_MAX_TOKENS)
    print(f"EP layer test knobs='auto', {EP_AUTO_WORLD} loopback ranks: {n} candidates", flush=True)
    from tests.backends.mega.kernel.sm90.test_bf16_ep_layer_gpu import EP_MIXED_MAX_TOKENS, EP_MIXED_WORLD

    libs = build_layer(ep_geometry, EP_MIXED_WORLD, EP_MIXED_WORLD, None, EP_MIXED_MAX_TOKENS)
    print(f"EP layer test, ranks in different buckets: {', '.join(libs)}", flush=True)
    from tests.backends.mega.kernel.sm90.test_bf16_ep_layer_gpu import EP_WIRE_CASES

    wire_geometry = tuning.make_geometry(ep_cfg.replace(combine_dtype="mxfp8"), ep_cfg.num_experts)
    for world, knobs in EP_WIRE_CASES:
        libs = build_layer(wire_geometry, world, world, knobs, EP_MAX_TOKENS)
        print(f"EP layer test, mxfp8 wire, {world} loopback ranks, knobs {knobs}: {', '.join(libs)}", flush=True)
    build_quant_ep(cache)
    # the torchrun multirank test of the SM90 EP layer (one GPU per rank: ranks_per_gpu 1), for issue #8
    from tests.multirank.test_torchrun import SM90_EP_GEOMETRY, SM90_EP_MAX_TOKENS

    g = SM90_EP_GEOMETRY
    for world in worlds:
        cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
            g["hidden_size"], g["intermediate_size"], g["experts_per_rank"] * world, g["top_k"]
        )
        geometry = tuning.make_geometry(cfg, cfg.num_experts)
        n = build_candidates(geometry, world, 1, SM90_EP_MAX_TOKENS)  # the knobs="auto" test
        libs = build_layer(geometry, world, 1, None, SM90_EP_MAX_TOKENS)  # the default layer (pull buckets)
        libs += build_layer(geometry, world, 1, {"dispatch": "push"}, SM90_EP_MAX_TOKENS)
        print(f"multirank SM90 EP test, world {world}: {', '.join(libs)} and {n} autotune candidates", flush=True)
    # scripts/ep_bench.py (issue #8): the bench contracts' EP kernels, one GPU per rank
    from scripts.ep_bench import BENCH_CONTRACTS as EP_BENCH_CONTRACTS
    from scripts.ep_bench import MAX_TOKENS as EP_BENCH_MAX_TOKENS

    for name in EP_BENCH_CONTRACTS:
        c = get_contract(name)
        cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
            c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit
        )
        geometry = tuning.make_geometry(cfg, cfg.num_experts)
        for world in worlds:
            libs = build_layer(geometry, world, 1, None, EP_BENCH_MAX_TOKENS)
            libs += build_layer(geometry, world, 1, {"dispatch": "push"}, EP_BENCH_MAX_TOKENS)
            print(f"EP bench {name}, world {world} (pull, push): {', '.join(libs)}", flush=True)
        for world in sorted(set(EP_TUNE_WORLDS) & set(worlds)):  # ep_bench.py --knobs auto / explicit tiles
            n = build_candidates(geometry, world, 1, EP_BENCH_MAX_TOKENS)
            print(f"EP bench {name}, world {world}: {n} autotune candidates", flush=True)
    # scripts/ep_bench.py --format mxfp8 / nvfp4: every token bucket's quantized EP kernel (pull)
    from flashinfer.moe_ep.backends.mega.kernel.sm90.block_scaled import EpPlacement
    from flashinfer.moe_ep.backends.mega.kernel.sm90.block_scaled import bucket_frontends as quant_buckets
    from scripts.ep_bench import ep_config

    for name in EP_BENCH_CONTRACTS:
        c = get_contract(name)
        for fmt in ("mxfp8", "nvfp4"):
            for world in worlds:
                fronts = quant_buckets(ep_config(c, fmt, None), c.num_experts // world, EpPlacement(world))
                libs = [fe.build(cache).name for fe in dict.fromkeys(fronts.values())]
                print(f"EP bench {name} {fmt}, world {world}: {', '.join(libs)}", flush=True)


def build_quant_ep(cache: Path) -> None:
    """The MXFP8 / NVFP4 EP kernels of the loopback layer test (every token bucket of each case)."""
    from flashinfer.moe_ep.backends.mega.kernel.sm90.block_scaled import EpPlacement, bucket_frontends
    from tests.backends.mega.kernel.sm90.test_quant_ep_layer_gpu import QUANT_EP_CASES, quant_ep_config

    for name, _fmt, world, knobs, _preq, _wire in QUANT_EP_CASES:
        cfg = quant_ep_config(name)
        placement = EpPlacement(world, world, (knobs or {}).get("dispatch", "pull"))
        fronts = bucket_frontends(cfg, cfg.num_experts // world, placement)
        libs = [fe.build(cache).name for fe in dict.fromkeys(fronts.values())]
        print(f"quantized EP layer test {name}: {', '.join(libs)}", flush=True)


#: GPU test files that must run in their own pytest process (they set CUDA environment before CUDA starts)
OWN_PROCESS = (
    "tests/backends/mega/kernel/sm90/test_bf16_ep_loopback_gpu.py",
    "tests/backends/mega/kernel/sm90/test_bf16_ep_layer_gpu.py",
    "tests/backends/mega/kernel/sm90/test_quant_ep_layer_gpu.py",
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


def multigpu(
    cache: Path,
    world: int,
    bench_tokens: list[str],
    knobs: list[str],
    skip_tests: bool,
    layer_test: bool,
    profile: list[str] = (),
    out: Path | None = None,
) -> int:
    """On a machine of ``world`` GPUs: the torchrun multirank tests, then scripts/ep_bench.py; each step
    under a deadline, so one hang cannot eat the call. ``layer_test``: also the loopback EP layer test.
    An ``auto`` knob spec records its tuned knobs in ``out/ep_knobs.json`` (the bench's knob cache)."""
    env = {**os.environ, "FLASHINFER_MOE_EP_KERNEL_CACHE": str(cache)}
    env.setdefault("NVSHMEM_SYMMETRIC_SIZE", "10G")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    steps = []
    if not skip_tests:
        steps.append(
            ("multirank tests", [*torchrun, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/multirank"], 240)
        )
    if layer_test:  # the loopback EP tests (kernel and layer) on the first GPU
        for path in OWN_PROCESS:
            pytest = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", path]
            steps.append((f"loopback {Path(path).stem}", pytest, 150))
    if bench_tokens:
        bench = [*torchrun, "scripts/ep_bench.py", "--tokens", *bench_tokens, "--knobs", *knobs, "--profile", *profile]
        if "auto" in knobs and out is not None:
            out.mkdir(parents=True, exist_ok=True)
            bench += ["--knob-cache", str(out / "ep_knobs.json")]
        steps.append(("EP bench", bench, 300))
        for fmt in ("mxfp8", "nvfp4"):  # the quantized EP layers, default knobs
            steps.append((f"EP bench {fmt}", [*torchrun, "scripts/ep_bench.py", "--tokens", *bench_tokens,
                                              "--format", fmt], 300))  # fmt: skip
    status = 0
    for label, cmd, deadline in steps:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True)  # its own process group
        try:
            rc = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            # SIGTERM first: torchrun passes it on to its workers (they run in sessions of their own, so
            # killing torchrun's group alone leaves them holding the GPUs); then SIGKILL what is left
            proc.terminate()
            try:
                proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            subprocess.run(["pkill", "-9", "-f", "scripts/ep_bench.py|tests/multirank"], check=False)
            rc = 124
        print(f"{label} (world {world}): exit {rc} ({time.perf_counter() - t0:.0f} s)", flush=True)
        status = status or rc
    return status


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["build", "run", "multigpu"])
    p.add_argument("--cache", type=Path, default=ROOT / ".kcache")
    p.add_argument("--bench-tokens", nargs="+", default=["1", "128", "4096", "16384"])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "bench-out")))
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument(
        "--tune-contracts", action="store_true", help="build: also every autotune candidate of the bench contracts"
    )
    p.add_argument(
        "--only",
        choices=["quant", "bf16", "ep"],
        help="build: only the MXFP8 / NVFP4, the world-1 BF16 or the expert-parallel kernels",
    )
    p.add_argument("--ep-worlds", type=int, nargs="+", default=[2, 4, 8], help="build: the EP world sizes")
    p.add_argument("--jobs", type=int, default=1, help="build: processes for the block-scaled kernels")
    p.add_argument("--bench-only", action="store_true", help="build: only the bench contracts' default kernels")
    p.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # I/N: one process of --jobs
    p.add_argument("--world", type=int, default=2, help="multigpu: the number of GPUs (ranks)")
    p.add_argument("--ep-tokens", nargs="*", default=["8", "128", "2048", "8192"], help="multigpu: tokens per rank")
    p.add_argument("--ep-knobs", nargs="+", default=["default"], help="multigpu: ep_bench.py --knobs specs")
    p.add_argument("--ep-profile", nargs="*", default=[], help="multigpu: tokens per rank to list kernel times at")
    p.add_argument("--layer-test", action="store_true", help="multigpu: also the loopback EP tests")
    a = p.parse_args()
    if a.what == "build":
        shard = tuple(int(v) for v in a.shard.split("/")) if a.shard else None
        return build(a.cache, a.tune_contracts, a.only, a.ep_worlds, a.jobs, shard, a.bench_only)
    if a.what == "multigpu":
        return multigpu(a.cache, a.world, a.ep_tokens, a.ep_knobs, a.skip_tests, a.layer_test, a.ep_profile, a.out)
    return run(a.cache, a.bench_tokens, a.out, a.skip_tests, a.skip_bench)


if __name__ == "__main__":
    sys.exit(main())
