"""The SM90 BF16 backend on the GPU against the fp32 reference (marked ``gpu``; skipped elsewhere).

Every case: fresh random inputs, output poisoned with NaN before the run, mean relative error < 1 %
over |ref| > 1e-2 max|ref|, every element within ``MAX_ULPS`` of the rounding the semantics allow
(``core.inputs.rounding_ulps``), and a second run bitwise equal to the first. The elementwise max
relative error is printed, not gated: under cancellation one-ulp differences of the bf16
intermediates (which the reference rounds too, after fp32 sums of another order) exceed 5 % relative
on correct results; the fp32 reference against the fp64 one reaches 3.5 % on the CPU.
Kernels come from the kernel cache (``FLASHINFER_MOE_EP_KERNEL_CACHE``); ``scripts/gpu_session.py
build`` compiles exactly ``GPU_VARIANTS`` on any machine.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.core.contracts import CONTRACTS
from flashinfer.moe_ep.core.inputs import make_expert_weights, relative_errors, rounding_ulps
from flashinfer.moe_ep.core.reference import moe_reference

from . import graph_replay
from .layer_inputs import fresh_inputs

pytestmark = pytest.mark.gpu

MAX_T = 8192
MAX_ULPS = 4.0
SMALL = {"hidden_size": 256, "intermediate_size": 128, "num_experts": 16, "top_k": 4}
ACTIVATIONS = [
    ("swiglu", None),
    ("swiglu", 4.0),
    ("swiglu_oai", None),
    ("geglu", None),
    ("reglu", None),
    ("relu2", None),
]
TOKENS = (1, 7, 128, 1000, MAX_T)
ROUTINGS = ("uniform", "skewed", "empty")

#: pair_blocks (the chain without a routing kernel, one M block per pair): 64-row tiles, 128-row tiles (the
#: second warpgroup's rows all padding) with relu2, and the single bucket's knobs of qwen3-30b-a3b
PAIR_VARIANTS = [
    ("small-swiglu-pairs", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        **SMALL, knobs={"tile_m": 64, "pair_blocks": True})),
    ("small-relu2-pairs", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        **SMALL, activation="relu2", knobs={"tile_m": 128, "pair_blocks": True})),
    ("qwen3-30b-a3b-pairs", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        2048, 768, 128, 8, "swiglu", knobs={"tile_m": 64, "fc2_tile_n": 128, "fc1_split_n": True,
                                             "pair_blocks": True})),
]  # fmt: skip

#: (name, config) of every variant these tests run; the GPU session script prebuilds them.
GPU_VARIANTS = [
    (f"small-{act}{'' if lim is None else f'-limit{lim:g}'}", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        **SMALL, activation=act, activation_limit=lim))
    for act, lim in ACTIVATIONS
] + [
    # Clusters of two CTAs along M (weight tiles shared within an expert, unshared across a boundary,
    # a phantom block for odd counts): both tile heights, through every routing and T of the small
    # tests (the skewed routing gives long runs of one expert, the uniform one many boundaries).
    (f"small-{act}-cluster2-tm{tm}", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        **SMALL, activation=act, knobs={"tile_m": tm, "fc1_tile_n": 128, "fc2_tile_n": 128, "cluster_m": 2}))
    for act, tm in (("swiglu", 128), ("geglu", 64))
] + [
    # FC1 weights untiled (fc1_tiled=False; every other variant here stores them tiled, the default)
    ("small-swiglu-untiled", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        **SMALL, knobs={"tile_m": 64, "fc1_tile_n": 128, "fc2_tile_n": 128, "fc1_tiled": False})),
] + [
    # each WGMMA batch waited for before the next stage (mma_overlap=False, drop v47; every other variant
    # here keeps one in flight, the default): both tile heights, a cluster pair at 128
    ("small-swiglu-mma-serial-tm64", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        **SMALL, knobs={"tile_m": 64, "fc1_tile_n": 128, "fc2_tile_n": 128, "mma_overlap": False})),
    ("small-relu2-mma-serial-cluster2-tm128", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        **SMALL, activation="relu2", knobs={"tile_m": 128, "cluster_m": 2, "mma_overlap": False})),
] + [
    (name, moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit))
    for name, c in CONTRACTS.items() if name in ("qwen3-30b-a3b", "gpt-oss-120b")
] + [
    # The fused decode kernel (decode_fused) for every token count of a layer of DECODE_MAX_T tokens:
    # every activation (FC1 units over all 16 warps of a CTA, the default), untiled FC1 weights with 8
    # warps, 2-stage rings and whole FC1 units per warp, units over 4 and 8 of 16 warps, 8 warps with
    # 3-stage rings (units over all 8), a real contract.
    (f"small-{act}{'' if lim is None else f'-limit{lim:g}'}-fused", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        **SMALL, activation=act, activation_limit=lim, knobs={"tile_m": 64, "decode_fused": True}))
    for act, lim in ACTIVATIONS
] + [
    ("small-swiglu-fused-untiled-w8s2k1", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        **SMALL, knobs={"tile_m": 64, "fc1_tile_n": 128, "fc1_tiled": False, "decode_fused": True,
                        "decode_warps": 8, "decode_stages": 2, "decode_k_warps": 1})),
    ("small-geglu-fused-k4", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        **SMALL, activation="geglu", knobs={"tile_m": 64, "decode_fused": True, "decode_k_warps": 4})),
    ("small-reglu-fused-k8", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        **SMALL, activation="reglu", knobs={"tile_m": 64, "decode_fused": True, "decode_k_warps": 8})),
    ("small-relu2-fused-w8s3", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        **SMALL, activation="relu2", knobs={"tile_m": 64, "decode_fused": True, "decode_warps": 8,
                                             "decode_stages": 3})),
    ("qwen3-30b-a3b-fused", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        2048, 768, 128, 8, "swiglu", knobs={"tile_m": 64, "fc2_tile_n": 128, "decode_fused": True})),
] + PAIR_VARIANTS + [
    # pair_combine (FC2 combines the pairs itself): each pair_blocks variant with it (its twin: without)
    (f"{name}-combine", moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k, cfg.activation, cfg.activation_limit,
        knobs={**cfg.knobs, "pair_combine": True}))
    for name, cfg in PAIR_VARIANTS
]  # fmt: skip
#: token capacity of the fused variants' layers: T * top_k <= 256 pairs (top_k 8: 32 tokens)
DECODE_MAX_T = 32
DECODE_TOKENS = (0, 1, 2, 7, DECODE_MAX_T)


def capacity(name: str) -> int:
    """The token capacity of a test variant's layer: the fused kernel's pair limit, ``pair_blocks``'
    ``T * top_k <= num_experts``, else MAX_T."""
    if "fused" in name:
        return DECODE_MAX_T
    if "pairs" in name:
        cfg = dict(GPU_VARIANTS)[name]
        return cfg.num_experts // cfg.top_k
    return MAX_T


_layers: dict[str, tuple] = {}


def _layer(name: str):
    if name not in _layers:
        cfg = dict(GPU_VARIANTS)[name]
        g = torch.Generator().manual_seed(len(_layers) + 17)
        w13, w2 = make_expert_weights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.activation,
                                      generator=g, device="cuda")  # fmt: skip
        layer = moe.MoEEpLayer(
            moe.BootstrapConfig(device="cuda"),
            moe.FleetParams(cfg.num_experts, capacity(name), cfg.hidden_size),
            moe.MoEWeightPack(w13, w2),
            backend=moe.MegaConfig(cfg),
        )
        layer.warmup()
        _layers[name] = (layer, cfg, w13, w2)
    return _layers[name]


def _check(layer, cfg, w13, w2, inp) -> None:
    t = inp.hidden_states.shape[0]
    out = torch.full((t, cfg.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
    layer.forward(inp, output=out)
    ref, scale = moe_reference(inp.hidden_states, inp.topk_ids, inp.topk_weights, w13, w2, cfg.activation,
                               cfg.activation_limit, return_term_scale=True)  # fmt: skip
    assert not bool(out.isnan().any()), "some output rows were never written"
    mean_err, max_err = relative_errors(out, ref)
    ulps = rounding_ulps(out, ref, scale)
    print(f"T={t}: mean rel {mean_err:.2e}, max rel {max_err:.2e}, max {ulps:.2f} rounding units")
    assert mean_err < 1e-2 and ulps <= MAX_ULPS, (mean_err, max_err, ulps)
    again = torch.full_like(out, float("nan"))
    layer.forward(inp, output=again)
    assert torch.equal(out, again), "two runs on the same inputs differ"


def _capture(layer, cfg, t: int, seed: int, launches: int = 1):
    return graph_replay.capture(layer, fresh_inputs(cfg, t, "uniform", seed=seed), cfg.hidden_size, launches)


def _replay_equals_eager(layer, cfg, captured, seed: int) -> bool:
    """Fresh skewed inputs through the graph (output poisoned first) against an eager forward."""
    return graph_replay.replay_equals_eager(layer, captured, fresh_inputs(cfg, captured[2].shape[0], "skewed", seed))


@pytest.mark.parametrize(
    "variant", [n for n, _ in GPU_VARIANTS if n.startswith("small-") and "fused" not in n and "pairs" not in n]
)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_small_every_activation(variant: str, routing: str) -> None:
    layer, cfg, w13, w2 = _layer(variant)
    for i, t in enumerate(TOKENS):
        _check(layer, cfg, w13, w2, fresh_inputs(cfg, t, routing, seed=zlib.crc32(f"{variant}/{routing}/{i}".encode())))


@pytest.mark.parametrize("variant", ["qwen3-30b-a3b", "gpt-oss-120b"])
@pytest.mark.parametrize("t", [1, 7, 128, 1000, MAX_T])
def test_real_contracts(variant: str, t: int) -> None:
    layer, cfg, w13, w2 = _layer(variant)
    _check(layer, cfg, w13, w2, fresh_inputs(cfg, t, "uniform" if t % 2 else "skewed", seed=t))


@pytest.mark.parametrize("variant", [n for n, _ in GPU_VARIANTS if "fused" in n])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_fused_decode(variant: str, routing: str) -> None:
    """``decode_fused`` at every T its layer takes (T = 0 too), one hot expert (groups of 8 pairs of one
    expert, several per expert) and empty experts; the grid barrier's words end zero."""
    layer, cfg, w13, w2 = _layer(variant)
    assert all(fe.knobs.decode_fused for fe, _ in layer._backend._by_bucket.values())
    for i, t in enumerate(DECODE_TOKENS):
        inp = fresh_inputs(cfg, t, routing, seed=zlib.crc32(f"{variant}/{routing}/{i}".encode()))
        if t == 0:
            assert layer.forward(inp).shape == (0, cfg.hidden_size)
            continue
        _check(layer, cfg, w13, w2, inp)
    for _, ws in layer._backend._by_bucket.values():
        assert ws["meta"][2:4].tolist() == [0, 0]


@pytest.mark.parametrize("variant", [n for n, _ in GPU_VARIANTS if n.endswith("-pairs-combine")])
def test_pair_combine_gives_the_combine_kernels_bits(variant: str) -> None:
    """``pair_combine`` (FC2 sums a token's pairs itself, the last arrival per N tile) against its twin without it
    (the combine kernel), same weights and inputs: bitwise equal at every T the layer takes and every routing,
    and every arrival counter zero again after the calls."""
    layer, cfg, w13, w2 = _layer(variant)
    assert all(fe.knobs.pair_combine for fe, _ in layer._backend._by_bucket.values())
    twin = moe.MoEEpLayer(
        moe.BootstrapConfig(device="cuda"),
        moe.FleetParams(cfg.num_experts, capacity(variant), cfg.hidden_size),
        moe.MoEWeightPack(w13, w2),
        backend=moe.MegaConfig(dict(GPU_VARIANTS)[variant.removesuffix("-combine")]),
    )
    twin.warmup()
    assert not any(fe.knobs.pair_combine for fe, _ in twin._backend._by_bucket.values())
    cap = capacity(variant)
    for routing in ROUTINGS:
        for i, t in enumerate(sorted({1, 2, cap // 2, cap})):
            inp = fresh_inputs(cfg, t, routing, seed=zlib.crc32(f"{variant}/combine/{routing}/{i}".encode()))
            mine = layer.forward(inp).clone()
            theirs = twin.forward(inp).clone()
            assert not mine.isnan().any(), (routing, t)
            assert torch.equal(mine, theirs), (routing, t, (mine.float() - theirs.float()).abs().max().item())
    for _, ws in layer._backend._by_bucket.values():
        assert ws["expert_count"].numel() > cfg.num_experts + 1
        assert not ws["expert_count"].any()


@pytest.mark.parametrize("variant", [n for n, _ in GPU_VARIANTS if "pairs" in n])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_pair_blocks(variant: str, routing: str) -> None:
    """``pair_blocks`` (no routing kernel) at every T its layer takes (T = 0 too), one hot expert and empty
    experts; a graph replay equals eager; a launch past its token limit raises before anything runs."""
    layer, cfg, w13, w2 = _layer(variant)
    assert all(fe.knobs.pair_blocks for fe, _ in layer._backend._by_bucket.values())
    cap = capacity(variant)
    for i, t in enumerate(sorted({0, 1, 2, cap // 2, cap})):
        inp = fresh_inputs(cfg, t, routing, seed=zlib.crc32(f"{variant}/{routing}/{i}".encode()))
        if t == 0:
            assert layer.forward(inp).shape == (0, cfg.hidden_size)
            continue
        _check(layer, cfg, w13, w2, inp)
    if routing == "uniform":
        assert _replay_equals_eager(layer, cfg, _capture(layer, cfg, 1, seed=3), seed=4)
        fe, ws = layer._backend._by_bucket["decode"]
        inp = fresh_inputs(cfg, cap + 1, "uniform", seed=5)
        out = torch.full((cap + 1, cfg.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="pair_blocks serves at most"):
            fe.launch(inp.hidden_states, inp.topk_ids, inp.topk_weights, layer._backend.w13, layer._backend.w2, out,
                      ws)  # fmt: skip
        assert bool(out.isnan().all())


def test_fused_decode_refuses_more_tokens_than_it_takes() -> None:
    """A launch past the fused kernel's pair limit raises before anything is enqueued."""
    layer, cfg, _, _ = _layer("small-swiglu-fused")
    fe, ws = layer._backend._by_bucket["single"]
    inp = fresh_inputs(cfg, fe.decode_max_tokens + 1, "uniform", seed=1)
    out = torch.full((inp.hidden_states.shape[0], cfg.hidden_size), float("nan"), dtype=torch.bfloat16,
                     device="cuda")  # fmt: skip
    with pytest.raises(ValueError, match="decode_fused serves at most"):
        fe.launch(inp.hidden_states, inp.topk_ids, inp.topk_weights, layer._backend.w13, layer._backend.w2, out, ws)
    assert bool(out.isnan().all())


def test_fused_decode_graph_replay_equals_eager() -> None:
    layer, cfg, _, _ = _layer("qwen3-30b-a3b-fused")
    for t in (1, 3):
        captured = _capture(layer, cfg, t, seed=t, launches=3)  # back to back: the barrier words reset
        for seed in (6, 7):
            assert _replay_equals_eager(layer, cfg, captured, seed), (t, seed)


def test_zero_tokens() -> None:
    layer, cfg, _, _ = _layer("small-swiglu")
    out = layer.forward(fresh_inputs(cfg, 0, "uniform", 0))
    assert out.shape == (0, cfg.hidden_size)


def test_cuda_graph_replay_equals_eager() -> None:
    layer, cfg, _, _ = _layer("qwen3-30b-a3b")
    captured = _capture(layer, cfg, 300, seed=5)
    for seed in (6, 7):
        assert _replay_equals_eager(layer, cfg, captured, seed)


def test_cuda_graph_per_token_bucket() -> None:
    """A graph captured at a decode T and one at a prefill T each hold their bucket's kernel (the bucket
    is picked from the host-side T at capture); replays interleaved with fresh inputs equal eager."""
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import tuner

    layer, cfg, _, _ = _layer("qwen3-30b-a3b")
    sizes = (64, 4096)
    assert tuner.bucket_of(sizes[0]) == "decode" and tuner.bucket_of(sizes[1]) == "prefill"
    by_bucket = layer._backend._by_bucket
    assert by_bucket["decode"][0].knobs != by_bucket["prefill"][0].knobs
    graphs = {t: _capture(layer, cfg, t, seed=t) for t in sizes}
    for rnd in range(2):
        for t in sizes:
            assert _replay_equals_eager(layer, cfg, graphs[t], seed=100 * rnd + t), (rnd, t)


def test_live_token_count_is_read_on_the_host_at_world_size_1() -> None:
    """World size 1 takes ``num_tokens`` eagerly (read on the host: the live rows equal a forward on
    them alone, the rest stay untouched) and refuses it inside a CUDA graph, which could not replay it."""
    layer, cfg, _, _ = _layer("qwen3-30b-a3b")
    inp = fresh_inputs(cfg, 40, "uniform", seed=41)
    inp.num_tokens = torch.tensor([23], dtype=torch.int32, device="cuda")
    out = torch.full((40, cfg.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
    layer.forward(inp, output=out)
    alone = layer.forward(moe.MoEEpTensors(inp.hidden_states[:23], inp.topk_ids[:23], inp.topk_weights[:23]))
    assert torch.equal(out[:23], alone)
    assert bool(out[23:].isnan().all())
    with pytest.raises(moe.MoEEpConfigError, match="one graph per token count"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layer.forward(inp, output=out)
    assert torch.equal(layer.forward(moe.MoEEpTensors(inp.hidden_states[:23], inp.topk_ids[:23],
                                                      inp.topk_weights[:23])), alone)  # fmt: skip


def test_layers_of_one_geometry_share_one_workspace_unless_told_not_to() -> None:
    """Two layers of one geometry share the pooled workspace (refcounted); ``share_workspace=False``
    gets its own. Forwards of the three, interleaved, each match their own weights."""
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm

    base = dict(GPU_VARIANTS)["small-swiglu"]
    layers = []
    for i, share in enumerate((True, True, False)):
        cfg = base.replace(share_workspace=share)
        g = torch.Generator().manual_seed(900 + i)
        w13, w2 = make_expert_weights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, generator=g,
                                      device="cuda")  # fmt: skip
        layer = moe.MoEEpLayer(moe.BootstrapConfig(device="cuda"), moe.FleetParams(cfg.num_experts, 512,
                               cfg.hidden_size), moe.MoEWeightPack(w13, w2), backend=moe.MegaConfig(cfg))  # fmt: skip
        layers.append((layer, cfg, w13, w2))
    keys = [layer._backend._workspace_key for layer, *_ in layers]
    assert keys[0] == keys[1] != keys[2]
    assert comm.WORKSPACES.refcount(keys[0]) == 2 and comm.WORKSPACES.refcount(keys[2]) == 1
    for rnd in range(2):
        for j, (layer, cfg, w13, w2) in enumerate(layers):
            _check(layer, cfg, w13, w2, fresh_inputs(cfg, 300 + 7 * j, "uniform", seed=50 * rnd + j))
    layers[0][0].destroy()
    assert comm.WORKSPACES.refcount(keys[0]) == 1
    _check(*layers[1], fresh_inputs(base, 77, "skewed", seed=3))
    for layer, *_ in layers[1:]:
        layer.destroy()
    assert comm.WORKSPACES.refcount(keys[0]) == 0 and comm.WORKSPACES.refcount(keys[2]) == 0
