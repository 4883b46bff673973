"""The tuning surface: taxonomy, value sets, validity against the frontend's check, candidates, token
buckets, placeholder defaults, knob resolution and the workspace shared by a layer's buckets."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from flashinfer.moe_ep.core.contracts import CONTRACTS
from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

tuner, knob_cache = drop.tuner, drop.knob_cache


def _geometries() -> list[drop.Geometry]:
    out = [
        drop.Geometry(c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit)
        for c in CONTRACTS.values()
    ]
    out.append(drop.Geometry(320, 192, 8, 2, "swiglu", None))  # widths only some tiles divide
    return out


def _check_ok(geometry: drop.Geometry, knobs: drop.Bf16Knobs) -> bool:
    try:
        drop.Bf16Frontend(geometry, knobs).check()
    except ValueError:
        return False
    return True


def test_taxonomy_today_every_bf16_knob_is_output_neutral() -> None:
    fam = tuner.family(tuner.BF16)
    assert {s.name for s in fam.specs} == {f.name for f in dataclasses.fields(drop.Bf16Knobs)}
    assert all(s.kind == tuner.PERFORMANCE and not s.nondeterministic for s in fam.specs)
    assert fam.deterministic and fam.layout_knobs == ("fc1_tile_n", "fc1_tiled")


@pytest.mark.parametrize("tokens", [1, 64, 65, 512, 2048, 16384])
def test_is_valid_agrees_with_frontend_check_on_every_candidate(tokens: int) -> None:
    for g in _geometries():
        cands = tuner.candidates(g, tokens)
        assert cands, g
        assert len(cands) == len(set(cands))
        assert tuner.default_knobs(g, tokens) in cands
        for k in cands:
            assert tuner.is_valid(g, k) == (True, "")
            assert _check_ok(g, k)


def test_is_valid_is_value_sets_plus_frontend_check_on_a_grid() -> None:
    fam = tuner.family()
    for g in _geometries()[:2] + _geometries()[-1:]:
        for tm, n1, n2 in itertools.product((32, 64, 128, 192), (32, 64, 96, 128, 192, 256), (64, 128, 256, 512)):
            k = drop.Bf16Knobs(tile_m=tm, fc1_tile_n=n1, fc2_tile_n=n2)
            in_sets = all(getattr(k, s.name) in s.value_set() for s in fam.specs)
            ok, why = tuner.is_valid(g, k)
            assert ok == (in_sets and _check_ok(g, k)), (g, k, why)
            assert ok or why
    assert tuner.is_valid(_geometries()[0], {"bogus": 1})[0] is False
    assert (
        tuner.is_valid(_geometries()[0], drop.Bf16Knobs(fc1_stages=9))[1]
        == "fc1_stages=9 is not in {None, 2, 3, 4, 5, 6, 7, 8}"
    )
    assert "num_sms=0" in tuner.is_valid(_geometries()[0], drop.Bf16Knobs(num_sms=0))[1]


def test_candidates_are_deterministic_pinned_and_pruned() -> None:
    g = drop.Geometry(2048, 768, 128, 8, "swiglu", None)
    assert tuner.candidates(g, 512) == tuner.candidates(g, 512)
    pinned = tuner.candidates(g, 4096, pinned={"fc1_tile_n": 64})
    assert pinned and all(k.fc1_tile_n == 64 for k in pinned)
    decode = tuner.candidates(g, 16)
    # a 128-row tile at T=16 is padding: pruned (the decode default, the baseline to beat, has 64 rows)
    assert tuner.default_knobs(g, 16) in decode and not [k for k in decode if k.tile_m == 128]
    # layout knobs outermost: the sweep changes the weight layout once per value
    layouts = [k.fc1_tile_n for k in tuner.candidates(g, 4096)]
    assert layouts == sorted(layouts)
    # stages and the SM count stay at the default's values
    assert {(k.fc1_stages, k.fc2_stages, k.num_sms) for k in tuner.candidates(g, 4096)} == {(None, None, 132)}


def test_nondeterministic_values_only_when_allowed(monkeypatch) -> None:
    @dataclasses.dataclass(frozen=True)
    class Knobs:
        combine: str = "ordered"

    class Frontend:
        def __init__(self, geometry, knobs):
            self.knobs = knobs

        def check(self) -> None:
            pass

    spec = tuner.KnobSpec(
        "combine", tuner.CORRECTNESS, ("ordered", "atomic"), ("ordered", "atomic"), nondeterministic=("atomic",)
    )
    fam = tuner.KernelFamily("fake", Knobs, Frontend, (spec,), lambda g: Knobs())
    monkeypatch.setitem(tuner.FAMILIES, "fake", fam)
    g = _geometries()[0]
    assert not fam.deterministic
    assert tuner.candidates(g, 8, name="fake") == [Knobs("ordered")]
    assert tuner.candidates(g, 8, name="fake", allow_nondeterministic=True) == [Knobs("ordered"), Knobs("atomic")]


@pytest.mark.parametrize(
    "tokens, bucket",
    [
        (0, "single"),
        (1, "single"),
        (2, "decode"),
        (768, "decode"),
        (769, "mid"),
        (2047, "mid"),
        (2048, "prefill"),
        (2048, "prefill"),
        (10**6, "prefill"),
    ],
)
def test_bucket_boundaries(tokens: int, bucket: str) -> None:
    assert tuner.bucket_of(tokens) == bucket


def test_buckets_of_a_layer_and_their_tune_sizes() -> None:
    names = lambda cap: [b.name for b in tuner.buckets_for(cap)]  # noqa: E731
    assert names(0) == names(1) == ["single"]
    assert names(2) == names(768) == ["single", "decode"]
    assert names(769) == names(2047) == ["single", "decode", "mid"]
    assert names(2048) == names(8192) == ["single", "decode", "mid", "prefill"]
    ep = lambda cap: [b.name for b in tuner.buckets_for(cap, tuner.EP_TOKEN_BUCKETS)]  # noqa: E731
    assert ep(1) == ["decode"] and ep(8192) == ["decode", "mid", "prefill"]
    for cap in (1, 8, 64, 100, 300, 1000, 2047, 3000, 8192):
        for b in tuner.buckets_for(cap):
            t = tuner.tune_tokens(b, cap)
            assert 1 <= t <= cap and tuner.bucket_of(t) == b.name
    custom = (tuner.TokenBucket("small", 8, 8), tuner.TokenBucket("big", None, 64))
    assert tuner.bucket_of(9, custom) == "big"
    with pytest.raises(ValueError, match="unbounded"):
        tuner.bucket_of(9, custom[:1])


def test_defaults_are_the_declared_profiles() -> None:
    assert "TUNING.md" in tuner.BF16_PROFILES_SOURCE
    assert set(tuner.BF16_PROFILES) == {b.name for b in tuner.TOKEN_BUCKETS}
    for g in _geometries():
        base = drop.default_bf16_knobs(g)
        assert tuner.default_knobs(g, 1024) == base  # mid: the base defaults
        for t, bucket in ((1, "single"), (2, "decode"), (4096, "prefill")):
            knobs = tuner.default_knobs(g, t)
            assert tuner.is_valid(g, knobs)[0]
            # the bucket's overrides where they divide the problem (else the base defaults), then the rule
            profile = dataclasses.replace(base, **tuner.BF16_PROFILES[bucket])
            start = profile if tuner.is_valid(g, tuner.bf16_refine(g, bucket, profile))[0] else base
            assert knobs == tuner.bf16_refine(g, bucket, start)
        assert tuner.default_knobs(g, 4096).cluster_m == 2
        assert not tuner.default_knobs(g, 2).fc1_split_n  # the split is for one token only


def test_the_single_bucket_runs_the_chain_without_its_routing_and_combine_kernels() -> None:
    """``pair_blocks`` and ``pair_combine`` in ``single`` (one token: its pairs' experts are distinct) wherever it
    is valid, on every contract; never in a larger bucket (its launch limit T * top_k <= num_experts); not without
    the gather."""
    for c in CONTRACTS.values():
        g = drop.Geometry(c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit)
        single = tuner.default_knobs(g, 1)
        assert single.pair_blocks and single.pair_combine and tuner.is_valid(g, single)[0], c
        assert not any(tuner.default_knobs(g, t).pair_blocks for t in (2, 128, 4096)), c
        assert not any(tuner.default_knobs(g, t).pair_combine for t in (2, 128, 4096)), c
    qwen30 = drop.Geometry(2048, 768, 128, 8, "swiglu", None)
    no_gather = tuner.default_knobs(qwen30, 1, pinned={"gather_in_fc1": False})
    assert not no_gather.pair_blocks and not no_gather.pair_combine


def test_the_single_bucket_splits_fc1_where_twice_its_ctas_fit_the_grid() -> None:
    def single(g: drop.Geometry, **pinned: object) -> drop.Bf16Knobs:
        return tuner.default_knobs(g, 1, pinned=pinned or None)

    qwen30 = drop.Geometry(2048, 768, 128, 8, "swiglu", None)  # 8 experts x 6 FC1 tiles: 48 -> 96 CTAs
    assert single(qwen30).fc1_split_n and tuner.is_valid(qwen30, single(qwen30))[0]
    assert not single(drop.Geometry(4096, 1536, 128, 8, "swiglu", None)).fc1_split_n  # 96 CTAs: 192 > 132
    assert not single(drop.Geometry(7168, 2048, 256, 8, "swiglu", None)).fc1_split_n  # 128 CTAs
    assert not single(drop.Geometry(2048, 768, 128, 8, "relu2", None)).fc1_split_n  # not gated
    assert not single(qwen30, num_sms=64).fc1_split_n  # 96 > 64
    # a layer whose layout (its largest bucket) is 128-wide: no split, and still a valid knob set
    narrow = single(qwen30, fc1_tile_n=128)
    assert not narrow.fc1_split_n and narrow.fc1_tile_n == 128 and tuner.is_valid(qwen30, narrow)[0]
    bad = dataclasses.replace(single(qwen30), cluster_m=2)
    assert "fc1_split_n needs" in tuner.is_valid(qwen30, bad)[1]


def test_fc2_early_weights_is_on_by_default_and_leaves_clusters_valid() -> None:
    """FC2's early weight loads are on in every bucket's defaults; with clusters they have no effect, so a
    clustered candidate of the same knobs stays valid (the autotune keeps searching cluster_m)."""
    g = drop.Geometry(2048, 768, 128, 8, "swiglu", None)
    for t in (1, 64, 1024, 4096):
        assert tuner.default_knobs(g, t).fc2_early_weights
    clustered = dataclasses.replace(tuner.default_knobs(g, 64), cluster_m=2)
    assert tuner.is_valid(g, clustered)[0] and clustered in tuner.candidates(g, 64)


def test_decode_fused_knobs_are_validated_and_off_by_default() -> None:
    """The fused decode kernel (drop v37) is off in every bucket's defaults; its warps, ring depth and
    shared memory are checked like the other knobs; its pair limit gives the most tokens a launch takes."""
    g = drop.Geometry(2048, 768, 128, 8, "swiglu", None)
    for t in (1, 64, 1024, 4096):
        assert not tuner.default_knobs(g, t).decode_fused
    ok = drop.Bf16Knobs(decode_fused=True)
    assert tuner.is_valid(g, ok)[0]
    assert drop.Bf16Frontend(g, ok).decode_max_tokens == 32
    assert "decode_warps=12" in tuner.is_valid(g, drop.Bf16Knobs(decode_warps=12))[1]
    assert "decode_stages=1" in tuner.is_valid(g, drop.Bf16Knobs(decode_stages=1))[1]
    big = drop.Bf16Knobs(decode_warps=16, decode_stages=5)  # 16 x 5 stages x 3 KiB: past 227 KiB
    with pytest.raises(ValueError, match="bytes of shared"):
        drop.Bf16Frontend(g, big).check()
    assert tuner.is_valid(g, drop.Bf16Knobs(decode_warps=8, decode_stages=8))[0]
    # FC1 units over 1-16 warps of the CTA (None, the default: all of them), never more than it has
    assert ok.decode_k_warps is None
    for kw in (1, 2, 4, 8, 16):
        assert tuner.is_valid(g, drop.Bf16Knobs(decode_fused=True, decode_k_warps=kw))[0]
    assert "decode_k_warps=3 is not in" in tuner.is_valid(g, drop.Bf16Knobs(decode_k_warps=3))[1]
    too_many = drop.Bf16Knobs(decode_fused=True, decode_warps=8, decode_k_warps=16)
    assert "at most decode_warps=8" in tuner.is_valid(g, too_many)[1]
    # autotune times it in the single bucket only, against the chain's default
    fused = [k for k in tuner.candidates(g, 1) if k.decode_fused]
    chain = tuner.default_knobs(g, 1)
    assert fused == [dataclasses.replace(chain, decode_fused=True, pair_blocks=False, pair_combine=False)]
    assert not any(k.decode_fused for t in (2, 64, 4096) for k in tuner.candidates(g, t))


def test_a_fused_decode_launch_past_its_pair_limit_raises_before_anything_runs() -> None:
    g = drop.Geometry(256, 128, 16, 4, "swiglu", None)
    fe = drop.Bf16Frontend(g, drop.Bf16Knobs(fc1_tile_n=256, fc2_tile_n=256, decode_fused=True))
    x = torch.zeros(fe.decode_max_tokens + 1, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="decode_fused serves at most 64 tokens"):
        fe.launch(x, None, None, None, None, None, {})
    fe._check_launch(x[:64])  # within the limit (a CPU tensor: no SM count to check)


def test_resolve_takes_an_exact_cache_hit_else_the_defaults(tmp_path: Path) -> None:
    g = drop.Geometry(2048, 768, 128, 8, "swiglu", None)
    ctx = knob_cache.TuneContext("NVIDIA H200")
    path = tmp_path / "knobs.json"
    decode, prefill = (next(b for b in tuner.TOKEN_BUCKETS if b.name == n) for n in ("decode", "prefill"))
    assert tuner.resolve_knobs(g, decode, ctx, path=path) == (tuner.default_knobs(g, 2), "defaults")
    key = knob_cache.KnobKey.make(tuner.BF16, g, "decode", ctx)
    knob_cache.record(key, {"tile_m": 64, "fc1_tile_n": 256}, path)
    want = dataclasses.replace(drop.default_bf16_knobs(g), tile_m=64, fc1_tile_n=256)
    assert tuner.resolve_knobs(g, decode, ctx, path=path) == (want, "knob cache")
    # the layer's layout knobs (from its largest bucket) win over a bucket's cached ones
    pinned = tuner.resolve_knobs(g, decode, ctx, path=path, pinned={"fc1_tile_n": 128})[0]
    assert pinned == dataclasses.replace(want, fc1_tile_n=128)
    assert tuner.resolve_knobs(g, prefill, ctx, path=path)[1] == "defaults"  # another bucket
    assert tuner.resolve_knobs(g, decode, knob_cache.TuneContext("NVIDIA H100"), path=path)[1] == "defaults"
    # a cached entry that is no longer valid is ignored
    knob_cache.record(key, {"tile_m": 96}, path)
    assert tuner.resolve_knobs(g, decode, ctx, path=path) == (tuner.default_knobs(g, 2), "defaults")
    knob_cache.record(key, {"retired_knob": 1}, path)
    assert tuner.resolve_knobs(g, decode, ctx, path=path)[1] == "defaults"


def test_buckets_share_one_workspace_with_their_own_shapes() -> None:
    g = drop.Geometry(256, 128, 16, 4, "swiglu", None)
    fes = [drop.Bf16Frontend(g, drop.Bf16Knobs(tile_m=m)) for m in (64, 128)]
    cap = 300
    views = drop.allocate_shared_workspace(fes, cap, torch.device("cpu"))
    for fe, ws in zip(fes, views, strict=True):
        specs = fe.workspace_spec(cap)
        assert list(ws) == [s.name for s in specs]
        assert [tuple(t.shape) for t in ws.values()] == [tuple(s.shape) for s in specs]
        assert all(int(t.abs().sum()) == 0 for t in ws.values())  # zero-filled
    for name in views[0]:
        assert views[0][name].data_ptr() == views[1][name].data_ptr()  # one allocation per buffer
    single = fes[0].allocate_workspace(cap, torch.device("cpu"))
    assert [t.shape for t in single.values()] == [t.shape for t in views[0].values()]


def test_a_launch_past_its_workspace_tokens_raises_before_anything_runs() -> None:
    g = drop.Geometry(256, 128, 16, 4, "swiglu", None)
    bf16 = drop.Bf16Frontend(g, drop.Bf16Knobs())
    mxfp8 = drop.Mxfp8Frontend(g, drop.QuantKnobs())
    for fe in (bf16, mxfp8):
        ws = fe.allocate_workspace(7, torch.device("cpu"))
        assert ws.max_tokens == 7
        x = torch.zeros(8, 256, dtype=torch.bfloat16)
        args = (x, None, None, None, None, None, ws) if fe is bf16 else (x, None, None, None, None, None, None, ws)
        with pytest.raises(ValueError, match="allocated for at most 7 tokens, got T=8"):
            fe.launch(*args)  # raises before load(): no kernel library is needed to get here
        fe.check_workspace_tokens(7, ws)  # within the size
        fe.check_workspace_tokens(10**6, dict(ws))  # a plain dict carries no size
