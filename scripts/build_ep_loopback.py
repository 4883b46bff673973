"""Compile the EP loopback kernels (DRAFT) that ``tests/backends/mega/kernel/sm90/test_bf16_ep_loopback_gpu.py``
needs, on any machine (no GPU): ``CUTE_DSL_ARCH=sm_90a python scripts/build_ep_loopback.py``.

Writes ``lib<name>.so`` per variant and ``manifest.json`` (geometry, knobs, buffer shapes for
``max_tokens`` and the argument order) into ``$MOE_EP_LOOPBACK_KCACHE`` (default ``.kcache/ep``
under the repository root). The GPU test needs only torch + tvm_ffi to use them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

NUM_SMS = 132  # H200
MAX_TOKENS = 512  # per-rank capacity the GPU test sizes its buffers for
SMALL = dict(hidden=256, inter=128, num_experts=16, activation="swiglu", tile_m=64, fc1_tile_n=128, fc2_tile_n=128)

#: name -> world size, top_k, cluster_m, dispatch (every variant: loopback, ranks_per_gpu = world size)
VARIANTS = {
    "ep_r2_k4": (2, 4, 1, "pull"),
    "ep_r4_k4": (4, 4, 1, "pull"),
    "ep_r8_k4": (8, 4, 1, "pull"),
    "ep_r2_k1": (2, 1, 1, "pull"),
    "ep_r2_k4_c2": (2, 4, 2, "pull"),  # GEMM clusters of two CTAs (66 CTAs per rank)
    "ep_r2_k4_push": (2, 4, 1, "push"),  # the sources write their rows into the owners' a_buf
    "ep_r4_k4_push": (4, 4, 1, "push"),
}


def kcache_dir() -> Path:
    d = Path(os.environ.get("MOE_EP_LOOPBACK_KCACHE", ".kcache/ep"))
    return d if d.is_absolute() else REPO / d


def variant_record(name: str, world: int, top_k: int, cluster_m: int, dispatch: str) -> dict:
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh

    ws = kh.ep_workspace
    c = SMALL
    sym = ws.ep_symmetric_specs(MAX_TOKENS, c["hidden"], c["num_experts"], top_k, c["tile_m"], world, cluster_m)
    local = ws.ep_local_specs(MAX_TOKENS, c["hidden"], c["inter"], c["num_experts"], top_k, c["tile_m"], world,
                              NUM_SMS, world, cluster_m)  # fmt: skip
    return dict(
        name=name,
        lib=f"lib{name}.so",
        function=name,
        world_size=world,
        ranks_per_gpu=world,
        top_k=top_k,
        cluster_m=cluster_m,
        dispatch=dispatch,
        num_sms=NUM_SMS,
        max_tokens=MAX_TOKENS,
        **c,
        sym_specs=[[s.name, list(s.shape), s.dtype] for s in sym],
        local_specs=[[n, list(shape), dt] for n, shape, dt in local],
        tables=[list(t) for t in ws.EP_TABLES],
        args=list(ws.EP_ARGS),
    )


def build(names: list[str], out: Path) -> dict:
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh

    out.mkdir(parents=True, exist_ok=True)
    path = out / "manifest.json"
    # --only rebuilds some variants: keep the others' records
    manifest = json.loads(path.read_text()) if path.exists() else {}
    for name in names:
        world, top_k, cluster_m, dispatch = VARIANTS[name]
        rec = variant_record(name, world, top_k, cluster_m, dispatch)
        kernel = kh.Sm90MegaMoEBf16EpKernel(
            activation=rec["activation"],
            tile_m=rec["tile_m"],
            fc1_tile_n=rec["fc1_tile_n"],
            fc2_tile_n=rec["fc2_tile_n"],
            num_sms=NUM_SMS,
            world_size=world,
            ranks_per_gpu=world,
            cluster_m=cluster_m,
            dispatch=dispatch,
        )
        t0 = time.time()
        lib = kh.export_moe_bf16_ep(
            kernel, rec["hidden"], rec["inter"], rec["num_experts"], top_k, out, function_name=name
        )
        print(f"[{name}] {lib} ({lib.stat().st_size} B) in {time.time() - t0:.1f} s", flush=True)
        manifest[name] = rec
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="default: $MOE_EP_LOOPBACK_KCACHE or .kcache/ep")
    ap.add_argument("--only", nargs="*", choices=sorted(VARIANTS), default=None)
    args = ap.parse_args(argv)
    build(args.only or list(VARIANTS), args.out or kcache_dir())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
