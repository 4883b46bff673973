"""Build (CPU) and check/time (GPU) the CuTe DSL BF16 MoE kernel drop.

Two modes:

* ``python scripts/gpu_kernel_check.py --build`` (here, no GPU; needs cutlass + tvm_ffi):
  compiles every variant with CUTE_DSL_ARCH=sm_90a, exports TVM-FFI libraries into
  ``.kcache/moe_bf16/`` and writes ``manifest.json``.
* ``python scripts/gpu_kernel_check.py [--phase correct|perf|all]`` (GPU machine; needs only torch
  and tvm_ffi): loads the libraries, checks every case against the drop's fp32 torch reference
  (NaN-poisoned output, fresh random inputs, bitwise repeatability, per-stage diagnostics on
  failure), then times the kernel against a torch._grouped_mm pipeline and prints a table last.
  Other phases: ``explore`` (timings of the alternative and stage-mask libraries), ``profile`` (a few
  calls of the ``--profile NAME:T`` libraries, to run under ncu), ``host`` (host time per call of the
  decode stage-mask libraries ``x_dl_m*``: what each kernel launch costs the host), ``footprint`` (one
  qwen3-30b-a3b library at T = 4096 and 16384 while the calls rotate over more distinct weight and
  workspace buffers: what warm L2 contributes to a timing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
KCACHE = REPO / ".kcache" / "moe_bf16"
DROP = "flashinfer.moe_ep.kernel_src.cutedsl_megamoe.src"

SMALL = dict(H=512, I=256, E=16, K=4)
MODELS = {
    "qwen3-30b-a3b": dict(H=2048, I=768, E=128, K=8),
    "qwen3-235b-a22b": dict(H=4096, I=1536, E=128, K=8),
    "deepseek-v3": dict(H=7168, I=2048, E=256, K=8),
}
CHECK_TOKENS = [0, 1, 7, 128, 1000, 8192]
PERF_TOKENS = [1, 128, 1024, 4096, 16384]
#: (library, T) that ``--phase profile`` runs a few times (under ncu); ``--profile NAME:T ...`` replaces them
PROFILE_CASES = [("qwen3-30b-a3b_dec", 1), ("deepseek-v3_dec", 128), ("deepseek-v3_c2", 4096)]
MAX_TOKENS = 16384


#: the layer's prefill profile (128 / 256 / 256, cluster_m 2, FC1 tiled) with later stages left out, and
#: without PDL: in-situ cost of each stage (`--build --only sm_c2t`, `--phase explore --only MODEL
#: --tokens 4096`; the masked variants give wrong outputs)
PREFILL_STAGE_MASKS = {
    **{
        f"sm_c2t_m{m}": dict(tile_m=128, fc1_tile_n=256, fc2_tile_n=256, cluster_m=2, fc1_tiled=True, stage_mask=m)
        for m in (3, 7, 15, 31)
    },
    "sm_c2t_nopdl": dict(tile_m=128, fc1_tile_n=256, fc2_tile_n=256, cluster_m=2, fc1_tiled=True, use_pdl=False),
}


def variants() -> list[dict]:
    """Every library to build. ``kw`` are Sm90MegaMoEBf16Kernel knobs; ``role`` says where it is used:
    check (correctness), perf (the table), explore (extra timings of alternatives)."""
    out = []
    acts = [
        ("swiglu", None),
        ("swiglu", 2.0),
        ("swiglu_oai", None),
        ("geglu", None),
        ("reglu", None),
        ("relu2", None),
    ]
    for act, limit in acts:
        tag = f"small_{act}" + ("_lim" if limit is not None else "")
        out.append(dict(name=tag, role="check", kw=dict(activation=act, limit=limit), **SMALL))
    out.append(dict(name="small_swiglu_tm64", role="check", kw=dict(activation="swiglu", tile_m=64), **SMALL))
    # FC1 weights tiled (each weight tile one contiguous block), both tile heights
    for tm in (64, 128):
        kw = dict(activation="swiglu", tile_m=tm, fc1_tiled=True)
        out.append(dict(name=f"small_swiglu_fc1tiled_tm{tm}", role="check", kw=kw, **SMALL))
    out.append(dict(name="small_relu2_fc1tiled", role="check", kw=dict(activation="relu2", fc1_tiled=True), **SMALL))
    # the separate gather kernel (FC1 reading a gathered copy), still a kernel option
    for tm in (64, 128):
        kw = dict(activation="swiglu", tile_m=tm, gather_in_fc1=False)
        out.append(dict(name=f"small_swiglu_gather_kernel_tm{tm}", role="check", kw=kw, **SMALL))
    out.append(
        dict(
            name="small_swiglu_tn256",
            role="check",
            kw=dict(activation="swiglu", fc1_tile_n=256, fc2_tile_n=256),
            **SMALL,
        )
    )
    out.append(
        dict(
            name="small_swiglu_tm256",
            role="check",
            kw=dict(activation="swiglu", tile_m=256, fc1_tile_n=128, fc2_tile_n=128),
            **SMALL,
        )
    )
    out.append(
        dict(
            name="small_swiglu_c2",
            role="check",
            kw=dict(activation="swiglu", tile_m=128, fc1_tile_n=256, fc2_tile_n=256, cluster_m=2, pair_by_expert=False),
            **SMALL,
        )
    )
    out.append(
        dict(
            name="small_geglu_tm64_c2",
            role="check",
            kw=dict(activation="geglu", tile_m=64, fc1_tile_n=128, fc2_tile_n=128, cluster_m=2, pair_by_expert=False),
            **SMALL,
        )
    )
    for tag, act, tm, tn in (("small_swiglu_c2pe", "swiglu", 128, 256), ("small_geglu_tm64_c2pe", "geglu", 64, 128)):
        kw = dict(activation=act, tile_m=tm, fc1_tile_n=tn, fc2_tile_n=tn, cluster_m=2, pair_by_expert=True)
        out.append(dict(name=tag, role="check", kw=kw, **SMALL))
    for tag, act, tm in (("small_swiglu_split", "swiglu", 64), ("small_geglu_split_tm128", "geglu", 128)):
        kw = dict(activation=act, tile_m=tm, fc1_tile_n=256, fc2_tile_n=128, fc1_tiled=True, fc1_split_n=True)
        out.append(dict(name=tag, role="check", kw=kw, **SMALL))
    out.append(
        dict(
            name="small_relu2_tm256",
            role="check",
            kw=dict(activation="relu2", tile_m=256, fc1_tile_n=128, fc2_tile_n=128),
            **SMALL,
        )
    )
    for model, dims in MODELS.items():
        out.append(
            dict(
                name=f"{model}_main",
                role="perf",
                model=model,
                kw=dict(activation="swiglu", tile_m=128, fc1_tile_n=256, fc2_tile_n=256),
                **dims,
            )
        )
        out.append(
            dict(
                name=f"{model}_c2",
                role="perf",
                model=model,
                kw=dict(
                    activation="swiglu", tile_m=128, fc1_tile_n=256, fc2_tile_n=256, cluster_m=2, pair_by_expert=False
                ),
                **dims,
            )
        )
        out.append(
            dict(
                name=f"{model}_c2pe",
                role="perf",
                model=model,
                kw=dict(
                    activation="swiglu", tile_m=128, fc1_tile_n=256, fc2_tile_n=256, cluster_m=2, pair_by_expert=True
                ),
                **dims,
            )
        )
        out.append(
            dict(
                name=f"{model}_dlay",  # the layer's decode profile before: 64 / 256 / 128
                role="compare",
                model=model,
                kw=dict(activation="swiglu", tile_m=64, fc1_tile_n=256, fc2_tile_n=128),
                **dims,
            )
        )
        for tag, kw in (
            ("dltiled", dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128)),  # decode profile, FC1 tiled
            ("c2tiled", dict(tile_m=128, fc1_tile_n=256, fc2_tile_n=256, cluster_m=2)),  # prefill profile
            # the same with the separate gather kernel (drop v17 and before) instead of FC1's own row loads
            ("dltiled_g0", dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128, gather_in_fc1=False)),
            ("c2tiled_g0", dict(tile_m=128, fc1_tile_n=256, fc2_tile_n=256, cluster_m=2, gather_in_fc1=False)),
        ):
            kw = dict(activation="swiglu", fc1_tiled=True, **kw)
            out.append(dict(name=f"{model}_{tag}", role="compare", model=model, kw=kw, **dims))
        out.append(
            dict(
                name=f"{model}_dec",
                role="perf",
                model=model,
                kw=dict(activation="swiglu", tile_m=64, fc1_tile_n=128, fc2_tile_n=128),
                **dims,
            )
        )
    q = MODELS["qwen3-30b-a3b"]
    explore = {
        "t64_n128_c2": dict(tile_m=64, fc1_tile_n=128, fc2_tile_n=128, cluster_m=2),
        "t128_n128_c2": dict(tile_m=128, fc1_tile_n=128, fc2_tile_n=128, cluster_m=2),
        "t128_n256_128": dict(tile_m=128, fc1_tile_n=256, fc2_tile_n=128),
        "mask_rg1": dict(tile_m=128, fc1_tile_n=256, fc2_tile_n=256, stage_mask=0b00111),
        "mask_rg12": dict(tile_m=128, fc1_tile_n=256, fc2_tile_n=256, stage_mask=0b01111),
        # the layer's decode profile (64 / 256 / 128) with later stages left out: per-stage cost of
        # the launch chain at small T (`--phase explore --only x_dl --tokens 0 1 2`; wrong outputs)
        **{f"dl_m{m}": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128, stage_mask=m) for m in (0, 1, 3, 7, 15, 31)},
        "dl_nopdl": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128, use_pdl=False),
        **PREFILL_STAGE_MASKS,
        "dl_epidirect": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128, epi_direct=True),
        # the decode and prefill profiles with the drop v18 aux grids (full) and sized ones (drop v19's default)
        "sg_dl": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128, fc1_tiled=True, sized_grids=False),
        "sg_dl_on": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128, fc1_tiled=True),
        "sg_dl_f2n256": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=256, fc1_tiled=True),
        "sg_c2t": dict(tile_m=128, fc1_tile_n=256, fc2_tile_n=256, cluster_m=2, fc1_tiled=True, sized_grids=False),
        "sg_c2t_on": dict(tile_m=128, fc1_tile_n=256, fc2_tile_n=256, cluster_m=2, fc1_tiled=True),
        # the decode profile with FC1 tiles (and layout) of 128: twice the FC1 CTAs at T = 1
        "sg_dl128t": dict(tile_m=64, fc1_tile_n=128, fc2_tile_n=128, fc1_tiled=True),
        # the single bucket's profile (drop v20): FC1 tiles of 128 over the 256 layout
        "split": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128, fc1_tiled=True, fc1_split_n=True),
        # the same and the decode profile with drop v20's separate row-map launch after a single routing CTA
        "split_rmap0": dict(
            tile_m=64, fc1_tile_n=256, fc2_tile_n=128, fc1_tiled=True, fc1_split_n=True, route_maps_rows=False
        ),
        "dl_rmap0": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128, fc1_tiled=True, route_maps_rows=False),
    }
    for tag, kw in explore.items():
        out.append(
            dict(name=f"x_{tag}", role="explore", model="qwen3-30b-a3b", kw=dict(activation="swiglu", **kw), **q)
        )
    # deepseek-v3, where the peer is still ahead (T = 128 and 4096): N tiles and clusters around the defaults
    ds = MODELS["deepseek-v3"]
    explore_ds = {
        "c2_f2n128": dict(tile_m=128, fc1_tile_n=256, fc2_tile_n=128, cluster_m=2),
        "c2_f1n128": dict(tile_m=128, fc1_tile_n=128, fc2_tile_n=256, cluster_m=2),
        "dec_f1n256": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128),
        "dec_f2n64": dict(tile_m=64, fc1_tile_n=128, fc2_tile_n=64),
        "dec_f2n256": dict(tile_m=64, fc1_tile_n=128, fc2_tile_n=256),
        "dec_c2": dict(tile_m=64, fc1_tile_n=128, fc2_tile_n=128, cluster_m=2),
        # stage masks of the prefill default (differences give per-stage times; wrong outputs)
        "c2_mask_rg": dict(tile_m=128, fc1_tile_n=256, fc2_tile_n=256, cluster_m=2, stage_mask=0b00011),
        "c2_mask_rg1": dict(tile_m=128, fc1_tile_n=256, fc2_tile_n=256, cluster_m=2, stage_mask=0b00111),
        "c2_mask_rg12": dict(tile_m=128, fc1_tile_n=256, fc2_tile_n=256, cluster_m=2, stage_mask=0b01111),
        "dec256_mask_rg1": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128, stage_mask=0b00111),
        "dec256_mask_rg12": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128, stage_mask=0b01111),
        **PREFILL_STAGE_MASKS,
        "sg_dl_on": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128, fc1_tiled=True),
        "sg_dl128t": dict(tile_m=64, fc1_tile_n=128, fc2_tile_n=128, fc1_tiled=True),
        "split": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128, fc1_tiled=True, fc1_split_n=True),
        "dl_rmap0": dict(tile_m=64, fc1_tile_n=256, fc2_tile_n=128, fc1_tiled=True, route_maps_rows=False),
    }
    for tag, kw in explore_ds.items():
        out.append(
            dict(name=f"ds_{tag}", role="explore", model="deepseek-v3", kw=dict(activation="swiglu", **kw), **ds)
        )
    for v in out:
        v.setdefault("model", None)
        v["act"] = v["kw"]["activation"]
        v["limit"] = v["kw"].get("limit")
        v["tile_m"] = v["kw"].get("tile_m", 128)
        v["tn1"] = v["kw"].get("fc1_tile_n", 128)
    return out


# ------------------------------------------------------------------------------------ build (CPU)
def build(only: str | None) -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import importlib

    kmod = importlib.import_module(f"{DROP}.moe_bf16_glu.kernel")
    emod = importlib.import_module(f"{DROP}.moe_bf16_glu.export")
    KCACHE.mkdir(parents=True, exist_ok=True)
    manifest = []
    for v in variants():
        if only and only not in v["name"]:
            continue
        if v["role"] == "explore" and not (only and only in v["name"]):  # explore variants only on request
            continue
        t0 = time.time()
        k = kmod.Sm90MegaMoEBf16Kernel(**v["kw"])
        lib = emod.export_moe_bf16(k, v["H"], v["I"], v["E"], v["K"], KCACHE, v["name"].replace("-", "_"))
        v = dict(v, lib=str(lib.relative_to(REPO)), fn=v["name"].replace("-", "_"))
        manifest.append(v)
        print(f"built {v['name']:28s} {time.time() - t0:5.1f}s {lib.stat().st_size // 1024} KiB")
    path = KCACHE / "manifest.json"
    if only and path.is_file():  # a filtered build adds to (or replaces entries of) the manifest
        built = {v["name"] for v in manifest}
        manifest = [v for v in json.loads(path.read_text()) if v["name"] not in built] + manifest
    path.write_text(json.dumps(manifest, indent=1))


# ------------------------------------------------------------------------------------ GPU side
def gpu_main(phase: str, only: str | None) -> int:
    import importlib

    import torch
    import tvm_ffi

    from flashinfer.moe_ep.cli.bench import launch_times_ms
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import autotune
    from scripts.host_overhead import per_call_us

    ref_mod = importlib.import_module(f"{DROP}.moe_bf16_glu.reference")
    wmod = importlib.import_module(f"{DROP}.moe_bf16_glu.weights")
    hmod = importlib.import_module(f"{DROP}.common.host_utils")
    cmod = importlib.import_module(f"{DROP}.common.constants")
    manifest = json.loads((KCACHE / "manifest.json").read_text())
    dev = torch.device("cuda")
    print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__, flush=True)

    class Lib:
        def __init__(self, v: dict, max_tokens: int):
            self.v = v
            t0 = time.time()
            mod = tvm_ffi.load_module(str(REPO / v["lib"]))
            self.fn = getattr(mod, v["fn"])
            self.mod = mod
            self.load_ms = (time.time() - t0) * 1e3
            self.gated = v["act"] != "relu2"
            self.ws = {}
            if v.get("legacy_pad"):  # an older drop's cluster_m=2 library padded experts to 2 * tile_m rows
                max_tokens += v["E"] * v["tile_m"] // v["K"] + 1
            specs = hmod.moe_bf16_workspace_spec(
                max_tokens, v["H"], v["I"], v["E"], v["K"], v["tile_m"], cluster_m=v["kw"].get("cluster_m", 1)
            )
            for spec in specs:
                dt = getattr(torch, spec.dtype)
                self.ws[spec.name] = torch.empty(spec.shape, dtype=dt, device=dev)
            self.ws["expert_count"].zero_()  # the one buffer that must start at zero

        def prep_w13(self, w13: torch.Tensor) -> torch.Tensor:
            w = wmod.interleave_gate_up(w13, self.v["tn1"]) if self.gated else w13.contiguous()
            return wmod.tile_weights(w, self.v["tn1"], cmod.TILE_K) if self.v["kw"].get("fc1_tiled") else w

        @property
        def w13_layout(self) -> tuple:
            """What ``prep_w13`` depends on: libraries with equal layouts share prepared weights."""
            return self.v["tn1"], self.gated, bool(self.v["kw"].get("fc1_tiled"))

        def __call__(self, x, ids, wts, w13p, w2, out):
            w = self.ws
            self.fn(
                x,
                ids,
                wts,
                w13p,
                w2,
                out,
                w["pair_row"],
                w["pair_rank"],
                w["expert_count"],
                w["cta_base"],
                w["expert_off"],
                w["m_block_expert"],
                w["meta"],
                w["a_buf"],
                w["h_buf"],
            )

    def canon(a: torch.Tensor) -> torch.Tensor:
        # Row-major strides even for zero-size tensors (torch keeps any strides there, the
        # compiled library checks them).
        return torch.empty(a.shape, dtype=a.dtype, device=a.device).copy_(a)

    def make_routing(t: int, e: int, k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
        if kind == "uniform":
            ids = torch.rand(t, e, generator=gen, device=dev).argsort(dim=1)[:, :k]
        elif kind == "one-hot":  # every token picks the same k experts (one expert gets all)
            perm = torch.randperm(e, generator=gen, device=dev)[:k]
            ids = perm.unsqueeze(0).expand(t, k)
        elif kind == "empty":  # only a quarter of the experts receive tokens
            pool = torch.randperm(e, generator=gen, device=dev)[: max(k, e // 4)]
            pick = torch.rand(t, pool.numel(), generator=gen, device=dev).argsort(dim=1)[:, :k]
            ids = pool[pick]
        else:
            raise ValueError(kind)
        return canon(ids.to(torch.int32))

    def make_inputs(v: dict, t: int, kind: str, seed: int):
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        h, k = v["H"], v["K"]
        x = torch.randn(t, h, generator=gen, device=dev).to(torch.bfloat16)
        ids = make_routing(t, v["E"], k, kind, gen)
        wts = torch.rand(t, k, generator=gen, device=dev) + 0.1
        wts = canon(wts / wts.sum(dim=1, keepdim=True))
        return x, ids, wts

    def make_weights(v: dict, seed: int):
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        e, h, i = v["E"], v["H"], v["I"]
        n1 = 2 * i if v["act"] != "relu2" else i
        w13 = (torch.randn(e, n1, h, generator=gen, device=dev) * (3.0 / math.sqrt(h))).to(torch.bfloat16)
        w2 = (torch.randn(e, h, i, generator=gen, device=dev) / math.sqrt(i)).to(torch.bfloat16)
        return w13, w2

    def rel_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, int]:
        o, r = out.float(), ref.float()
        if r.numel() == 0:
            return 0.0, 0.0, 0
        nonfinite = int((~torch.isfinite(o)).sum())
        mask = r.abs() > 1e-2 * r.abs().max()
        rel = ((o - r).abs() / r.abs().clamp_min(1e-30))[mask]
        if rel.numel() == 0:
            return 0.0, 0.0, nonfinite
        return float(rel.mean()), float(rel.max()), nonfinite

    def diagnose(lib: Lib, x, ids, wts, w13, w2) -> None:
        """Per-stage check of the workspace after a run (routing, gather, FC1, FC2)."""
        v, w = lib.v, lib.ws
        t, k = ids.shape
        tm = v["tile_m"]
        meta = w["meta"].tolist()
        flat = ids.view(-1).long()
        counts = torch.bincount(flat, minlength=v["E"])
        padded = (counts + tm - 1) // tm * tm
        print(f"    diag: meta={meta[:2]} expected blocks={int(padded.sum()) // tm} rows={int(padded.sum())}")
        pr = w["pair_row"][: t * k].long()
        offs = torch.cumsum(padded, 0) - padded
        lo, hi = offs[flat], offs[flat] + counts[flat]
        ok_rows = bool(((pr >= lo) & (pr < hi)).all()) and pr.unique().numel() == pr.numel()
        tok = torch.arange(t * k, device=dev) // k
        mbe = w["m_block_expert"][: int(padded.sum()) // tm].long() & 0xFFFF
        exp_mbe = torch.repeat_interleave(torch.arange(v["E"], device=dev), padded // tm)
        print(
            f"    diag: pair_row in segment+unique={ok_rows} "
            f"m_block_expert={bool((mbe == exp_mbe).all())} "
            f"expert_count zero={bool((w['expert_count'] == 0).all())} "
            f"expert_off={bool((w['expert_off'].long() == offs).all())}"
        )
        # FC2 output sits in a_buf after the run; FC1 output in h_buf.
        inter = v["I"]
        h_err = y_err = 0.0
        for e in torch.unique(flat).tolist()[:8]:
            sel = (flat == e).nonzero().squeeze(1)
            rows = pr[sel]
            xs = x[tok[sel]].float()
            hh = xs @ w13[e].float().T
            if lib.gated:
                a = ref_mod.activation_fp32(v["act"], hh[:, :inter], hh[:, inter:], v["limit"])
            else:
                a = ref_mod.activation_fp32(v["act"], hh, None, v["limit"])
            a = a.to(torch.bfloat16).float()
            y = (a @ w2[e].float().T).to(torch.bfloat16).float()
            hk = w["h_buf"][rows].float()
            yk = w["a_buf"][rows].float()
            h_err = max(h_err, float((hk - a).norm() / a.norm().clamp_min(1e-30)))
            y_err = max(y_err, float((yk - y).norm() / y.norm().clamp_min(1e-30)))
        print(f"    diag: FC1 out rel-norm err={h_err:.3e}  FC2 out rel-norm err={y_err:.3e}")

    def check_case(lib: Lib, t: int, kind: str, w13, w13p, w2, seed: int) -> tuple[bool, str]:
        v = lib.v
        x, ids, wts = make_inputs(v, t, kind, seed=seed)
        out = torch.full((t, v["H"]), float("nan"), dtype=torch.bfloat16, device=dev)
        lib(x, ids, wts, w13p, w2, out)
        torch.cuda.synchronize()
        ref = ref_mod.moe_bf16_reference(x, ids, wts, w13, w2, v["act"], v["limit"])
        mean_e, max_e, nonfin = rel_errors(out, ref)
        out2 = torch.full_like(out, float("nan"))
        lib(x, ids, wts, w13p, w2, out2)
        torch.cuda.synchronize()
        bitwise = bool(torch.equal(out.view(torch.int16), out2.view(torch.int16)))
        max_abs = float((out.float() - ref.float()).abs().max() / ref.float().abs().max()) if t else 0.0
        # Verdict: mean relative error < 1%, normwise max error < 1% of max|ref|, all finite,
        # bitwise repeatable. The brief's elementwise max_rel < 5% is printed as well: near the
        # 1%-of-max mask threshold one-ulp bf16 flips of the rounded intermediates exceed it,
        # for the torch pipeline too (ctrl_torch_max_rel).
        ok = mean_e < 0.01 and max_abs < 0.01 and nonfin == 0 and bitwise
        strict = "" if max_e < 0.05 else " [max_rel>5%]"
        # Control: the torch._grouped_mm pipeline (same bf16 rounding points, another fp32
        # summation order) measured with the same metric against the same reference.
        ctrl = ""
        if v["act"] == "swiglu" and v["limit"] is None and t >= 128:
            _, cmax, _ = rel_errors(torch_grouped_pipeline(x, ids, wts, w13, w2), ref)
            ctrl = f" ctrl_torch_max_rel={cmax:.2e}"
        line = (
            f"{'ok  ' if ok else 'FAIL'} {v['name']:26s} T={t:5d} {kind:8s} "
            f"mean_rel={mean_e:.2e} max_rel={max_e:.2e} max_abs/max|ref|={max_abs:.2e} "
            f"nonfinite={nonfin} bitwise={bitwise}{ctrl}{strict}"
        )
        if not ok or not check_case.diag_done:
            if t > 0:
                diagnose(lib, x, ids, wts, w13, w2)
                check_case.diag_done = True
        return ok, line

    check_case.diag_done = False
    failures = 0
    if phase in ("correct", "all"):
        print("== correctness ==", flush=True)
        for v in manifest:
            if v["role"] == "explore" or (only and not any(o in v["name"] for o in only.split(","))):
                continue
            tokens = CHECK_TOKENS if v["model"] in (None, "qwen3-30b-a3b") else [0, 1, 7, 128]
            lib = Lib(v, max(tokens))
            check_case.diag_done = False
            w13, w2 = make_weights(v, seed=1)
            w13p = lib.prep_w13(w13)
            for t in tokens:
                for kind in ("uniform", "one-hot", "empty"):
                    ok, line = check_case(lib, t, kind, w13, w13p, w2, seed=1000 + t)
                    failures += 0 if ok else 1
                    print(line, flush=True)
            del lib, w13, w2, w13p
            torch.cuda.empty_cache()
        print(f"correctness failures: {failures}", flush=True)

    def timed_round_robin(calls: dict, iters: int) -> dict:
        """Median ms of each call (``call(i)``, i counting that call's launches), the calls interleaved by
        the autotune's ``cuda_event_pair_timer``: round r times every call once, starting at call r (mod
        their number), so clock and temperature drift over the run reach every call alike (timed one
        library after the other, two copies of the same library differed by up to 13 % in one run)."""
        counters = [itertools.count() for _ in calls]
        launches = [lambda c=c, k=k: c(next(k)) for c, k in zip(calls.values(), counters, strict=True)]
        times = autotune.cuda_event_pair_timer(warmup=3)(launches, iters)
        return {n: statistics.median(ts) for n, ts in zip(calls, times, strict=True)}

    def time_libs(model: str, names: list[str], with_base: bool) -> dict:
        """Median ms of each library (and the torch baseline) at every PERF_TOKENS size, interleaved."""
        dims = MODELS[model]
        base_v = dict(dims, act="swiglu", limit=None)
        n_wsets = 1 if model == "deepseek-v3" else 2
        wsets = [make_weights(base_v, seed=10 + s) for s in range(n_wsets)]
        libs = {n: Lib(next(v for v in manifest if v["name"] == n), MAX_TOKENS) for n in names}
        preps = {}
        for lib in libs.values():
            preps.setdefault(lib.w13_layout, [lib.prep_w13(w[0]) for w in wsets])
        res = {}
        for t in PERF_TOKENS:
            n_in = 4
            ins = [make_inputs(base_v, t, "uniform", seed=77 + s) for s in range(n_in)]
            outs = [torch.empty(t, dims["H"], dtype=torch.bfloat16, device=dev) for _ in range(n_in)]
            iters = 10 if t >= 4096 else 30
            calls = {}
            for n, lib in libs.items():
                pw = preps[lib.w13_layout]

                def kcall(i, lib=lib, pw=pw, ins=ins, outs=outs, n_in=n_in):
                    x, ids, wts = ins[i % n_in]
                    lib(x, ids, wts, pw[i % n_wsets], wsets[i % n_wsets][1], outs[i % n_in])

                calls[n] = kcall
                if t <= 128:  # decode sizes: also replay a CUDA graph (no host launch overhead)
                    try:
                        graphs = []
                        for i in range(n_in):
                            g = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(g):
                                kcall(i)
                            graphs.append(g)
                        calls[n + "@graph"] = lambda i, gs=graphs, n_in=n_in: gs[i % n_in].replay()
                    except Exception as exc:  # report and keep going
                        print("graph capture failed:", repr(exc)[:300])
            if with_base:

                def bcall(i, ins=ins, n_in=n_in):
                    x, ids, wts = ins[i % n_in]
                    w13, w2 = wsets[i % n_wsets]
                    torch_grouped_pipeline(x, ids, wts, w13, w2)

                try:
                    bcall(0)
                    calls["torch"] = bcall
                except Exception as exc:  # baseline unavailable: report, keep going
                    print("baseline failed:", repr(exc)[:200])
                    res[("torch", t)] = float("nan")
            for n, ms in timed_round_robin(calls, iters).items():
                res[(n, t)] = ms
            print(
                f"  {model} T={t}: " + " ".join(f"{n}={ms:.3f}" for (n, tt), ms in res.items() if tt == t), flush=True
            )
        return res

    if phase in ("explore", "all"):
        for model in MODELS:
            xs = [v["name"] for v in manifest if v["role"] in ("explore", "compare") and v["model"] == model]
            if only and only not in model:  # variant filters (comma-separated): those variants and the references
                xs = [n for n in xs if any(o in n for o in only.split(","))]
            if not xs:
                continue
            print(f"== explore ({model}) ==", flush=True)
            built = {v["name"] for v in manifest}  # the reference profiles, where this cache has them
            names = [n for n in (f"{model}_main", f"{model}_c2", f"{model}_dec") if n in built] + xs
            res = time_libs(model, names, with_base=False)
            print("\n variant                      " + "".join(f"T={t:<9d}" for t in PERF_TOKENS))
            for n in names + [n + "@graph" for n in names]:
                print(f" {n:28s} " + "".join(f"{res.get((n, t), float('nan')):<11.4f}" for t in PERF_TOKENS))

    if phase == "footprint":  # one library while the run touches more distinct weight or workspace buffers
        v = next(v for v in manifest if v["name"] == "qwen3-30b-a3b_c2tiled")
        wsets = [make_weights(v, seed=10 + s) for s in range(8)]
        insts = [Lib(v, MAX_TOKENS) for _ in range(4)]  # one library, one workspace each
        preps = [insts[0].prep_w13(w[0]) for w in wsets]
        print(f"{v['name']}: median ms of 20 calls per case; cases interleaved in blocks of 4 timed calls after 4 "
              "untimed ones, so each case runs on its own warm state while drift reaches them alike")  # fmt: skip
        for t in (4096, 16384):
            ins = [make_inputs(v, t, "uniform", seed=77 + s) for s in range(4)]
            outs = [torch.empty(t, v["H"], dtype=torch.bfloat16, device=dev) for _ in range(4)]
            calls = {}
            for nw, nl in ((1, 1), (2, 1), (8, 1), (2, 4)):

                def call(i, nw=nw, nl=nl, ins=ins, outs=outs):
                    x, ids, wts = ins[i % 4]
                    insts[i % nl](x, ids, wts, preps[i % nw], wsets[i % nw][1], outs[i % 4])

                calls[f"{nw} weight sets, {nl} workspace(s)"] = call
            times = {label: [] for label in calls}
            for r in range(5):
                for label, call in calls.items():
                    times[label] += launch_times_ms(lambda i, call=call, r=r: call(4 * r + i), 4, 4)
            for label, ts in times.items():
                print(f"  T={t:6d} {label:28s} {statistics.median(ts):.4f}", flush=True)
        return 0

    if phase == "host":  # host time of one call of each decode stage-mask library (`--build --only x_dl_m`)
        names = sorted((v["name"] for v in manifest if v["name"].startswith("x_dl_m")), key=lambda n: int(n[6:]))
        v0 = next(v for v in manifest if v["name"] == names[0])
        w13, w2 = make_weights(v0, seed=3)
        x, ids, wts = make_inputs(v0, 1, "uniform", seed=5)
        out = torch.empty(1, v0["H"], dtype=torch.bfloat16, device=dev)
        print("host us per call (100 calls queued behind a GPU sleep, median of 5 rounds); stage bits: "
              "1 routing, 2 row map, 4 FC1, 8 FC2, 16 combine")  # fmt: skip
        for name in names:
            lib = Lib(next(v for v in manifest if v["name"] == name), 1)
            w13p = lib.prep_w13(w13)
            us = per_call_us(lambda lib=lib, w13p=w13p: lib(x, ids, wts, w13p, w2, out))
            print(f"  {name:12s} mask {lib.v['kw']['stage_mask']:05b}: {us:6.1f} us", flush=True)
        return 0

    if phase == "profile":  # run under ncu: a few calls of two libraries, kernels timed by ncu
        for name, t in PROFILE_CASES:
            v = next(v for v in manifest if v["name"] == name)
            lib = Lib(v, t)
            w13, w2 = make_weights(v, seed=3)
            w13p = lib.prep_w13(w13)
            x, ids, wts = make_inputs(v, t, "uniform", seed=5)
            out = torch.empty(t, v["H"], dtype=torch.bfloat16, device=dev)
            for _ in range(3):
                lib(x, ids, wts, w13p, w2, out)
            torch.cuda.synchronize()
            print(f"profiled {name} T={t}", flush=True)
        return 0

    rows = []
    if phase in ("perf", "all"):
        print("== performance ==", flush=True)
        for model, dims in MODELS.items():
            if only and only not in model:
                continue
            names = [f"{model}_{n}" for n in ("main", "c2", "c2pe", "dec")]
            extra = [v["name"] for v in manifest if v["role"] == "compare" and v["model"] == model]
            res = time_libs(model, names + extra, with_base=True)
            torch.cuda.empty_cache()
            for t in PERF_TOKENS:
                a, c2, m, b = (res[(f"{model}_{n}", t)] for n in ("main", "c2", "c2pe", "dec"))
                c = res[("torch", t)]
                gb = res.get((f"{model}_dec@graph", t), float("nan"))
                best = min(a, c2, m, b)
                flops = 2.0 * t * dims["K"] * 3 * dims["H"] * dims["I"]
                wbytes = active_weight_bytes(t, dims)
                rows.append(
                    (model, t, a, c2, m, b, gb, c, flops / (best * 1e-3) / 1e12, c / best, wbytes / 4.26e12 * 1e3)
                )
        print(
            "\n model            T   main_ms   c2_ms   c2pe_ms  dec_ms  dec@graph torch_ms "
            "best_TFLOP/s x_vs_torch floor_ms(4.26TB/s)"
        )
        for mo, t, a, c2, m, b, gb, c, tf, r, fl in rows:
            print(
                f" {mo:15s} {t:6d} {a:8.3f} {c2:8.3f} {m:8.3f} {b:8.3f} {gb:9.3f} {c:8.3f} "
                f"{tf:11.1f} {r:9.2f} {fl:9.4f}"
            )
    return 1 if failures else 0


def active_weight_bytes(t: int, dims: dict) -> float:
    """Expected weight bytes touched at T tokens with uniform routing (the HBM floor's bytes)."""
    e, k = dims["E"], dims["K"]
    p_active = 1.0 - (1.0 - k / e) ** t
    return e * p_active * 3 * dims["H"] * dims["I"] * 2


def torch_grouped_pipeline(x, ids, wts, w13, w2):
    """Baseline: argsort permute -> _grouped_mm FC1 -> silu(g)*u -> _grouped_mm FC2 -> index_add."""
    import torch

    t, k = ids.shape
    e_cnt, n1, _ = w13.shape
    inter = n1 // 2
    flat = ids.view(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // k
    xs = x[tok]
    offs = torch.cumsum(torch.bincount(flat, minlength=e_cnt), 0).to(torch.int32)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    a = (torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()).to(torch.bfloat16)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float() * wts.view(-1)[order].unsqueeze(1))
    return out.to(torch.bfloat16)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", action="store_true", help="compile + export here (CPU)")
    ap.add_argument(
        "--phase", default="all", choices=["correct", "explore", "perf", "all", "profile", "host", "footprint"]
    )
    ap.add_argument("--only", default=None, help="substring filter on variant/model names (several: comma-separated)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="T values of the explore/perf timings")
    ap.add_argument("--profile", nargs="+", default=None, help="--phase profile: NAME:T cases")
    args = ap.parse_args()
    if args.profile:
        PROFILE_CASES[:] = [(c.split(":")[0], int(c.split(":")[1])) for c in args.profile]
    if args.tokens:
        PERF_TOKENS[:] = args.tokens
    if args.build:
        build(args.only)
        return 0
    return gpu_main(args.phase, args.only)


if __name__ == "__main__":
    sys.exit(main())
