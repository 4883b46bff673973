"""Token-bucket profiles of the SM90 BF16 backend on the CPU: where each bucket's knobs come from, the
shared weight layout, and the ``tune`` command's error without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import tuning
from flashinfer.moe_ep.cli import main as cli_main
from flashinfer.moe_ep.errors import MoEEpConfigError
from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

CTX = drop.knob_cache.TuneContext("NVIDIA H200")


def _config(knobs=None) -> moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig:
    return moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(2048, 768, 128, 8, "swiglu", None, knobs)


@pytest.mark.parametrize("knobs", [None, "auto"])
def test_defaults_per_bucket_follow_the_measured_profiles(tmp_path: Path, knobs) -> None:
    p = tuning.layer_profiles(_config(knobs), 128, 4096, CTX, cache_path=tmp_path / "k.json")
    assert [b.name for b in p.buckets] == ["decode", "mid", "prefill"]
    assert set(p.sources.values()) == {"defaults"}
    assert len(p.distinct()) == 3  # decode, mid (the base defaults) and prefill profiles
    decode, mid, prefill = (p.frontends[b].knobs for b in ("decode", "mid", "prefill"))
    assert (decode.tile_m, decode.fc2_tile_n) == (64, 128) and (prefill.tile_m, prefill.fc2_tile_n) == (128, 256)
    assert (mid.cluster_m, prefill.cluster_m) == (1, 2)
    assert decode.fc1_tile_n == prefill.fc1_tile_n  # one weight layout per layer
    assert p.primary is p.frontends["prefill"]
    small = tuning.layer_profiles(_config(knobs), 128, 32, CTX, cache_path=tmp_path / "k.json")
    assert list(small.frontends) == ["decode"]


def test_explicit_knobs_serve_every_bucket() -> None:
    p = tuning.layer_profiles(_config({"tile_m": 64}), 128, 4096, CTX)
    assert len(p.distinct()) == 1 and p.primary.knobs.tile_m == 64 and set(p.sources.values()) == {"config"}
    with pytest.raises(MoEEpConfigError, match="bad knobs"):
        tuning.layer_profiles(_config({"tile_q": 64}), 128, 4096, CTX)
    with pytest.raises(MoEEpConfigError, match="fc1_tile_n=96 is not in"):
        tuning.layer_profiles(_config({"fc1_tile_n": 96}), 128, 4096, CTX)


def test_cached_buckets_take_the_largest_buckets_layout(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    g = tuning.make_geometry(_config(), 128)
    for bucket, knobs in (("decode", {"tile_m": 64, "fc1_tile_n": 64}), ("prefill", {"fc1_tile_n": 256})):
        drop.knob_cache.record(drop.knob_cache.KnobKey.make(drop.tuner.BF16, g, bucket, CTX), knobs, path)
    p = tuning.layer_profiles(_config(), 128, 4096, CTX, cache_path=path)
    assert p.sources == {"decode": "knob cache", "mid": "defaults", "prefill": "knob cache"}
    assert {b: fe.knobs.fc1_tile_n for b, fe in p.frontends.items()} == {"decode": 256, "mid": 256, "prefill": 256}
    assert p.frontends["decode"].knobs.tile_m == 64 and len(p.distinct()) == 2
    chosen = tuning.layer_profiles(_config("auto"), 128, 4096, CTX, cache_path=path, chosen={"mid": {"tile_m": 64}})
    assert chosen.sources["mid"] == "autotune" and chosen.frontends["mid"].knobs.fc1_tile_n == 256


def test_tune_without_a_gpu_names_what_is_missing(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the error on a machine without a GPU")
    assert cli_main(["tune", "--contract", "tiny", "--max-tokens", "8", "512"]) == 2
    err = capsys.readouterr().err
    assert "tune times kernels on the GPU" in err and "a visible CUDA GPU" in err
