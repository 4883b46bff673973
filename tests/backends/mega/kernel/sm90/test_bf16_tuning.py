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
    assert [b.name for b in p.buckets] == ["single", "decode", "mid", "prefill"]
    assert set(p.sources.values()) == {"defaults"}
    assert len(p.distinct()) == 4  # single (decode + FC1 split), decode, mid (the base defaults), prefill
    single, decode, mid, prefill = (p.frontends[b].knobs for b in ("single", "decode", "mid", "prefill"))
    assert (decode.tile_m, decode.fc2_tile_n) == (64, 128) and (prefill.tile_m, prefill.fc2_tile_n) == (128, 256)
    assert (mid.cluster_m, prefill.cluster_m) == (1, 2)
    assert single.fc1_split_n and not any(k.fc1_split_n for k in (decode, mid, prefill))
    assert single.fc1_tile_n == decode.fc1_tile_n == prefill.fc1_tile_n  # one weight layout per layer
    assert p.primary is p.frontends["prefill"]
    small = tuning.layer_profiles(_config(knobs), 128, 32, CTX, cache_path=tmp_path / "k.json")
    assert list(small.frontends) == ["single", "decode"]


def test_explicit_knobs_serve_every_bucket() -> None:
    p = tuning.layer_profiles(_config({"tile_m": 64}), 128, 4096, CTX)
    assert len(p.distinct()) == 1 and p.primary.knobs.tile_m == 64 and set(p.sources.values()) == {"config"}
    with pytest.raises(MoEEpConfigError, match="unknown tile_q"):  # at the config's construction
        _config({"tile_q": 64})
    with pytest.raises(MoEEpConfigError, match="fc1_tile_n=96 is not in"):
        tuning.layer_profiles(_config({"fc1_tile_n": 96}), 128, 4096, CTX)


def test_cached_buckets_take_the_largest_buckets_layout(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    g = tuning.make_geometry(_config(), 128)
    for bucket, knobs in (("decode", {"tile_m": 64, "fc1_tile_n": 64}), ("prefill", {"fc1_tile_n": 256})):
        drop.knob_cache.record(drop.knob_cache.KnobKey.make(drop.tuner.BF16, g, bucket, CTX), knobs, path)
    p = tuning.layer_profiles(_config(), 128, 4096, CTX, cache_path=path)
    assert p.sources == {"single": "defaults", "decode": "knob cache", "mid": "defaults", "prefill": "knob cache"}
    assert {fe.knobs.fc1_tile_n for fe in p.frontends.values()} == {256}
    assert p.frontends["decode"].knobs.tile_m == 64 and len(p.distinct()) == 3  # mid and prefill share one
    chosen = tuning.layer_profiles(_config("auto"), 128, 4096, CTX, cache_path=path, chosen={"mid": {"tile_m": 64}})
    assert chosen.sources["mid"] == "autotune" and chosen.frontends["mid"].knobs.fc1_tile_n == 256
    # a cached 128-wide layout reaches the single bucket too: no split there then, still valid
    drop.knob_cache.record(drop.knob_cache.KnobKey.make(drop.tuner.BF16, g, "prefill", CTX), {"fc1_tile_n": 128}, path)
    narrow = tuning.layer_profiles(_config(), 128, 4096, CTX, cache_path=path)
    assert narrow.frontends["single"].knobs.fc1_tile_n == 128 and not narrow.frontends["single"].knobs.fc1_split_n


def test_tune_without_a_gpu_names_what_is_missing(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the error on a machine without a GPU")
    assert cli_main(["tune", "--contract", "tiny", "--max-tokens", "8", "512"]) == 2
    err = capsys.readouterr().err
    assert "tune times kernels on the GPU" in err and "a visible CUDA GPU" in err


def test_ep_knob_cache_round_trip_is_keyed_by_world_size_and_loopback(tmp_path) -> None:
    """What ``knobs="auto"`` at world size > 1 records is found again only for the same world size and the
    same kind of ranks (a loopback tuning never serves ranks on separate GPUs)."""
    from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import ep_tuning
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

    g = drop.Geometry(256, 128, 16, 4, "swiglu", None)
    path = tmp_path / "knobs.json"
    winner = drop.default_bf16_ep_knobs(g, 2, 1, {"tile_m": 128, "fc1_tile_n": 256})
    real = ep_tuning.tune_context_named("NVIDIA H200", 2)
    loop = ep_tuning.tune_context_named("NVIDIA H200" + ep_tuning.LOOPBACK_SUFFIX, 2)
    ep_tuning.record_ep_knobs(g, real, "mid", winner, 1.5, 256, path)
    assert ep_tuning.cached_ep_knobs(g, real, "mid", path) == {"tile_m": 128, "fc1_tile_n": 256, "fc2_tile_n": 256,
                                                                "cluster_m": 2, "dispatch": "push"}  # fmt: skip
    assert ep_tuning.cached_ep_knobs(g, real, "decode", path) is None
    assert ep_tuning.cached_ep_knobs(g, loop, "mid", path) is None
    assert ep_tuning.cached_ep_knobs(g, ep_tuning.tune_context_named("NVIDIA H200", 4), "mid", path) is None
    assert ep_tuning.cached_ep_knobs(g, real, "mid", tmp_path / "missing.json") is None


def test_ep_buckets_follow_the_global_token_count() -> None:
    """EP buckets are the world-size-1 buckets over world_size * T; every bucket is tuned at a per-rank T
    whose global count falls inside it, largest bucket first."""
    from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import ep_tuning
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

    assert [b.name for b in ep_tuning.ep_buckets(2, 256)] == ["decode"]
    assert [b.name for b in ep_tuning.ep_buckets(8, 256)] == ["decode", "mid", "prefill"]
    assert ep_tuning.bucket_of(8, 64) == drop.tuner.bucket_of(512)
    for world, cap in ((2, 512), (4, 4096), (8, 2048), (8, 1)):
        plan = ep_tuning.bucket_plan(world, cap)
        assert [b.name for b, _ in plan] == [b.name for b in reversed(ep_tuning.ep_buckets(world, cap))]
        for bucket, t in plan:
            assert 1 <= t <= cap and ep_tuning.bucket_of(world, t) == bucket.name, (world, cap, bucket, t)


def test_ep_buckets_of_a_layer_share_the_largest_buckets_dispatch() -> None:
    """Ranks pick their bucket from their own rows, so one forward may mix buckets: every bucket of an EP
    layer takes the largest bucket's dispatch (its tiles stay its own), in the defaults and in the
    autotune candidates."""
    from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import ep_tuning
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

    g = drop.Geometry(256, 128, 16, 4, "swiglu", None)
    buckets = ep_tuning.ep_buckets(2, 1200)  # global T up to 2400: decode, mid, prefill
    assert [b.name for b in buckets] == ["decode", "mid", "prefill"]
    fronts = ep_tuning.bucket_frontends(g, 2, 2, buckets, {b.name: {} for b in buckets})
    assert drop.EP_BUCKET_DEFAULTS["decode"][4] == "pull" and drop.EP_BUCKET_DEFAULTS["prefill"][4] == "push"
    assert {fe.knobs.dispatch for fe in fronts.values()} == {"push"}
    assert fronts["decode"].knobs.tile_m == drop.EP_BUCKET_DEFAULTS["decode"][0]
    small = ep_tuning.ep_buckets(2, 256)  # decode only: its own default
    assert ep_tuning.bucket_frontends(g, 2, 2, small, {"decode": {}})["decode"].knobs.dispatch == "pull"
    pinned = ep_tuning.bucket_frontends(g, 2, 2, buckets, {b.name: {"dispatch": "pull"} for b in buckets})
    assert {fe.knobs.dispatch for fe in pinned.values()} == {"pull"}
    cands = ep_tuning.autotune_candidates(g, 2, 2, 1200)
    assert {k.dispatch for ks in cands.values() for k in ks} == {"push"}
    assert all(len(set(ks)) == len(ks) for ks in cands.values())


def test_fused_decode_knobs_only_for_a_layer_whose_buckets_stay_within_its_pair_limit() -> None:
    """``decode_fused`` takes T * top_k <= 256 (32 tokens at top_k 8): a layer of 32 tokens builds, one of
    33 is refused at construction with the bucket named."""
    fused = _config({"decode_fused": True})
    p = tuning.layer_profiles(fused, 128, 32, CTX)
    assert all(fe.knobs.decode_fused for fe in p.frontends.values())
    with pytest.raises(MoEEpConfigError, match="token bucket 'decode' reaches T=33"):
        tuning.layer_profiles(fused, 128, 33, CTX)


def test_pair_blocks_only_for_a_layer_whose_buckets_stay_within_its_rows() -> None:
    """``pair_blocks`` (one M block per pair, no routing kernel) takes T * top_k <= num_experts (16 tokens at
    qwen3-30b-a3b): a layer of 16 tokens builds, one of 17 is refused at construction with the bucket named;
    it needs FC1's own gather and no clusters."""
    pairs = _config({"pair_blocks": True})
    p = tuning.layer_profiles(pairs, 128, 16, CTX)
    assert all(fe.knobs.pair_blocks for fe in p.frontends.values())
    assert {fe.pair_blocks_max_tokens for fe in p.frontends.values()} == {16}
    with pytest.raises(MoEEpConfigError, match="pair_blocks serves at most 16 tokens.*'decode' reaches T=17"):
        tuning.layer_profiles(pairs, 128, 17, CTX)
    for bad in ({"pair_blocks": True, "cluster_m": 2}, {"pair_blocks": True, "gather_in_fc1": False}):
        with pytest.raises(MoEEpConfigError, match="pair_blocks needs gather_in_fc1=True and cluster_m=1"):
            tuning.layer_profiles(_config(bad), 128, 1, CTX)
    with pytest.raises(MoEEpConfigError, match="pair_combine needs pair_blocks=True"):
        tuning.layer_profiles(_config({"pair_combine": True}), 128, 1, CTX)


def test_pair_combine_sizes_its_counters_in_the_shared_workspace() -> None:
    """``pair_combine``'s arrival counters (one per token of a pair_blocks launch and FC2 N tile) extend
    ``expert_count`` in its own bucket's workspace spec only; the shared workspace holds the largest."""
    combined = tuning.layer_profiles(
        _config({"pair_blocks": True, "pair_combine": True, "fc2_tile_n": 128}), 128, 4, CTX
    )
    fe = next(iter(combined.frontends.values()))
    spec = {s.name: s.shape for s in fe.workspace_spec(4)}
    assert spec["expert_count"] == (128 + 1 + 16 * (2048 // 128),)
    plain = next(iter(tuning.layer_profiles(_config({"pair_blocks": True}), 128, 4, CTX).frontends.values()))
    assert {s.name: s.shape for s in plain.workspace_spec(4)}["expert_count"] == (129,)
