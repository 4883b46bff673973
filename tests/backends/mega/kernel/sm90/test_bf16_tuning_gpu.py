"""Tuning on the GPU (marked ``gpu``): ``knobs="auto"`` picks valid winners and stays correct, and a
cold start from a prebuilt kernel cache serves its first forward within 1 s without importing cutlass.

``scripts/gpu_session.py build`` prebuilds every candidate of ``AUTO_GEOMETRY`` (the GPU machine has
no compiler) and the bench contracts' default kernels.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.core.inputs import (
    make_expert_weights,
    make_hidden_states,
    make_topk,
    relative_errors,
    rounding_ulps,
)
from flashinfer.moe_ep.core.reference import moe_reference

pytestmark = pytest.mark.gpu

#: small enough to tune in seconds, wide enough that every tile candidate divides it
AUTO_GEOMETRY = {"hidden_size": 512, "intermediate_size": 256, "num_experts": 16, "top_k": 4}
AUTO_MAX_TOKENS = 1024  # buckets decode (tuned at T=256) and mid (T=1024)
ROOT = Path(__file__).resolve().parents[5]


def test_auto_knobs_pick_valid_winners_and_stay_correct(tmp_path: Path, monkeypatch) -> None:
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import tuner

    monkeypatch.setenv("FLASHINFER_MOE_EP_KNOB_CACHE", str(tmp_path / "knobs.json"))
    cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(**AUTO_GEOMETRY, knobs="auto")
    g = torch.Generator().manual_seed(3)
    w13, w2 = make_expert_weights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, generator=g, device="cuda")
    layer = moe.MoEEpLayer(
        moe.BootstrapConfig(device="cuda"),
        moe.FleetParams(cfg.num_experts, AUTO_MAX_TOKENS, cfg.hidden_size),
        moe.MoEWeightPack(w13, w2),
        backend=moe.MegaConfig(cfg),
    )
    layer.warmup()
    profiles = layer.backend.profiles
    print("autotuned:", profiles.describe())
    assert set(profiles.sources.values()) == {"autotune"}
    geometry = layer.backend.frontend.geometry
    for fe in profiles.distinct():
        assert tuner.is_valid(geometry, fe.knobs)[0], fe.knobs
    assert (tmp_path / "knobs.json").is_file()  # the winners were recorded
    for t in (7, 100, 300, AUTO_MAX_TOKENS):
        x = make_hidden_states(t, cfg.hidden_size, generator=g, device="cuda")
        ids, w = make_topk(t, cfg.num_experts, cfg.top_k, generator=g, device="cuda")
        out = torch.full((t, cfg.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
        layer.forward(moe.MoEEpTensors(x, ids, w), output=out)
        ref, scale = moe_reference(x, ids, w, w13, w2, return_term_scale=True)
        mean_err, _ = relative_errors(out, ref)
        assert mean_err < 1e-2 and rounding_ulps(out, ref, scale) <= 4.0
    layer.destroy()


def test_pair_timer_times_launches_interleaved() -> None:
    """The autotune's head-to-head timer (``confirm``): one list of per-launch times per launch, in the
    launches' order, however the rounds rotate; a launch with 8x the work measures slower."""
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import autotune as at

    # large enough that the GPU work, not the host's launch path, fills each event pair (1024^3 and
    # 2048^3 measured 0.038 vs 0.049 ms on the H200: the host's launch time)
    a = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for n in (4096, 8192)]
    order = []
    launches = [lambda: order.append(0) or a[0] @ a[0], lambda: order.append(1) or a[1] @ a[1]]
    small, large = at.cuda_event_pair_timer(warmup=1)(launches, 6)
    assert len(small) == len(large) == 6 and min(small) > 0
    assert sorted(large)[3] > 1.5 * sorted(small)[3]
    assert order[2:] == [0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0]  # after one warm-up each: rotating starts


COLD_START = r"""
import sys, time, torch
import flashinfer.moe_ep as moe
from flashinfer.moe_ep.core.inputs import make_expert_weights, make_hidden_states, make_topk
c = moe.get_contract("qwen3-30b-a3b")
g = torch.Generator().manual_seed(0)
w13, w2 = make_expert_weights(c.num_experts, c.hidden_size, c.intermediate_size, generator=g, device="cuda")
x = make_hidden_states(64, c.hidden_size, generator=g, device="cuda")
ids, w = make_topk(64, c.num_experts, c.top_k, generator=g, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
layer = moe.MoEEpLayer(
    moe.BootstrapConfig(device="cuda"), moe.FleetParams(c.num_experts, 16384, c.hidden_size),
    moe.MoEWeightPack(w13, w2),
    backend=moe.MegaConfig(moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        c.hidden_size, c.intermediate_size, c.num_experts, c.top_k)),
    check_values=False,
)
out = layer.forward(moe.MoEEpTensors(x, ids, w))
torch.cuda.synchronize()
print("FIRST_FORWARD_S", time.perf_counter() - t0)
print("CUTLASS_IMPORTED", any(m.split(".")[0] == "cutlass" for m in sys.modules))
print("FINITE", bool(torch.isfinite(out.float()).all()))
"""


def test_cold_start_first_forward_within_one_second_without_cutlass() -> None:
    env = {**__import__("os").environ, "FLASHINFER_MOE_EP_KNOB_CACHE": "off"}
    r = subprocess.run([sys.executable, "-c", COLD_START], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    print(r.stdout)
    assert lines["CUTLASS_IMPORTED"] == "False" and lines["FINITE"] == "True"
    assert float(lines["FIRST_FORWARD_S"]) < 1.0
