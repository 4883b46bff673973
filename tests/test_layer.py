"""The public layer on the reference backend: results, validation errors, recovery after a rejection."""

from __future__ import annotations

import pytest
import torch

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.core.inputs import make_expert_weights, make_hidden_states, make_topk
from flashinfer.moe_ep.core.reference import moe_reference
from flashinfer.moe_ep.errors import MoEEpConfigError, MoEEpError, MoEEpInputError

E, H, I, K, TMAX = 8, 64, 32, 2, 16


def _layer(w13, w2, act="swiglu", **kw):
    return moe.MoEEpLayer(
        moe.BootstrapConfig(device="cpu"),
        moe.FleetParams(E, TMAX, H),
        moe.MoEWeightPack(w13, w2),
        backend=moe.MegaConfig(moe.ReferenceMegaMoeConfig(H, I, E, K, act)),
        **kw,
    )


@pytest.fixture
def setup(gen):
    w13, w2 = make_expert_weights(E, H, I, generator=gen)
    return _layer(w13, w2), w13, w2


def _inputs(t, gen, routing="uniform"):
    x = make_hidden_states(t, H, generator=gen)
    ids, w = make_topk(t, E, K, routing=routing, generator=gen)
    return moe.MoEEpTensors(x, ids, w)


@pytest.mark.parametrize("t", [0, 1, 7, TMAX])
def test_forward_matches_reference_and_writes_output(setup, gen, t) -> None:
    layer, w13, w2 = setup
    inp = _inputs(t, gen)
    out = torch.full((t, H), float("nan"), dtype=torch.bfloat16)
    got = layer.forward(inp, output=out)
    assert got.data_ptr() == out.data_ptr()
    want = moe_reference(inp.hidden_states, inp.topk_ids, inp.topk_weights, w13, w2)
    assert torch.equal(got, want)


def _bad_cases(gen):
    good = _inputs(4, gen)
    x, ids, w = good.hidden_states, good.topk_ids, good.topk_weights
    dup = ids.clone()
    dup[1, 1] = dup[1, 0]
    return {
        "hidden_states must have shape": moe.MoEEpTensors(x[:, :-1].contiguous(), ids, w),
        "hidden_states must have dtype": moe.MoEEpTensors(x.float(), ids, w),
        "topk_ids must have dtype": moe.MoEEpTensors(x, ids.long(), w),
        "topk_weights must have shape": moe.MoEEpTensors(x, ids, w[:3]),
        "must be contiguous": moe.MoEEpTensors(x.t().contiguous().t(), ids, w),
        "outside \\[0, 8\\)": moe.MoEEpTensors(x, ids.masked_fill(ids == ids[0, 0], 8), w),
        "repeats an expert within token 1": moe.MoEEpTensors(x, dup, w),
        "non-finite": moe.MoEEpTensors(x, ids, w.masked_fill(w == w[0, 0], float("inf"))),
        "above FleetParams.max_tokens_per_rank": _inputs(TMAX + 1, gen),
        "num_tokens must have dtype": moe.MoEEpTensors(x, ids, w, num_tokens=torch.tensor([2])),
        "num_tokens must have shape": moe.MoEEpTensors(x, ids, w, num_tokens=torch.tensor(2, dtype=torch.int32)),
        "num_tokens holds 5, outside \\[0, 4\\]": moe.MoEEpTensors(x, ids, w, num_tokens=torch.tensor([5]).int()),
        "holds expert id 8 \\(token 0\\), outside": moe.MoEEpTensors(  # a bad id inside the live rows is still caught
            x, ids.masked_fill(ids == ids[0, 0], 8), w, num_tokens=torch.tensor([4]).int()
        ),
    }


def test_bad_inputs_raise_and_leave_the_layer_usable(setup, gen) -> None:
    layer, w13, w2 = setup
    for message, bad in _bad_cases(gen).items():
        with pytest.raises(MoEEpInputError, match=message):
            layer.forward(bad)
        good = _inputs(5, gen)
        want = moe_reference(good.hidden_states, good.topk_ids, good.topk_weights, w13, w2)
        assert torch.equal(layer.forward(good), want), f"layer broken after rejecting: {message}"


@pytest.mark.parametrize("live", [0, 1, 6, 9])
def test_live_token_count_runs_only_the_live_rows(setup, gen, live) -> None:
    """``num_tokens`` (read on the host by this backend): live rows as a forward on them alone, the
    other output rows untouched, and garbage in the dead input rows (bad expert ids) never read."""
    layer, w13, w2 = setup
    inp = _inputs(9, gen)
    inp.topk_ids[live:] = -1
    inp.num_tokens = torch.tensor([live], dtype=torch.int32)
    out = torch.full((9, H), float("nan"), dtype=torch.bfloat16)
    layer.forward(inp, output=out)
    want = moe_reference(inp.hidden_states[:live], inp.topk_ids[:live], inp.topk_weights[:live], w13, w2)
    assert torch.equal(out[:live], want)
    assert bool(out[live:].isnan().all())


def test_bad_output_buffer(setup, gen) -> None:
    layer, _, _ = setup
    inp = _inputs(3, gen)
    with pytest.raises(MoEEpInputError, match="output must have shape"):
        layer.forward(inp, output=torch.empty(4, H, dtype=torch.bfloat16))
    with pytest.raises(MoEEpInputError, match="output must have dtype"):
        layer.forward(inp, output=torch.empty(3, H))
    buf = torch.zeros(8, H, dtype=torch.bfloat16)
    buf[:3] = inp.hidden_states
    shifted = moe.MoEEpTensors(buf[:3], inp.topk_ids, inp.topk_weights)
    for out in (buf[:3], buf[1:4], buf[2:5]):  # the same rows, or some of them: overlapping memory
        with pytest.raises(MoEEpInputError, match="output must not overlap hidden_states"):
            layer.forward(shifted, output=out)
    assert torch.equal(layer.forward(shifted, output=buf[3:6]), layer.forward(inp))  # adjacent is fine


def test_weight_validation(gen) -> None:
    w13, w2 = make_expert_weights(E, H, I, generator=gen)
    with pytest.raises(MoEEpInputError, match="weights.w13 must have shape"):
        _layer(w13[:, :I].contiguous(), w2)
    with pytest.raises(MoEEpInputError, match="weights.w2 must have shape"):
        _layer(w13, w2.transpose(1, 2).contiguous())
    bad = w13.clone()
    bad[3, 2, 1] = float("nan")
    with pytest.raises(MoEEpInputError, match="non-finite"):
        _layer(bad, w2)
    with pytest.raises(MoEEpInputError, match="takes unquantized weights"):
        moe.MoEEpLayer(
            moe.BootstrapConfig(device="cpu"),
            moe.FleetParams(E, TMAX, H),
            moe.MoEWeightPack(w13, w2, w13_scale=torch.ones(1)),
            backend=moe.MegaConfig(moe.ReferenceMegaMoeConfig(H, I, E, K)),
        )
    # relu2 takes I rows, not 2I
    w13r, w2r = make_expert_weights(E, H, I, "relu2", generator=gen)
    _layer(w13r, w2r, act="relu2")
    with pytest.raises(MoEEpInputError, match="weights.w13 must have shape"):
        _layer(w13, w2, act="relu2")


def test_config_validation(gen) -> None:
    w13, w2 = make_expert_weights(E, H, I, generator=gen)
    with pytest.raises(MoEEpConfigError, match="top_k=9 exceeds"):
        moe.ReferenceMegaMoeConfig(H, I, E, 9)
    with pytest.raises(MoEEpConfigError, match="share_workspace must be a bool"):
        moe.ReferenceMegaMoeConfig(H, I, E, K, share_workspace="no")
    with pytest.raises(MoEEpConfigError, match="hidden_size=64 differs"):
        moe.MoEEpLayer(
            moe.BootstrapConfig(device="cpu"),
            moe.FleetParams(E, TMAX, 128),
            moe.MoEWeightPack(w13, w2),
            backend=moe.MegaConfig(moe.ReferenceMegaMoeConfig(H, I, E, K)),
        )
    with pytest.raises(MoEEpConfigError, match="rank must be in"):
        moe.BootstrapConfig(world_size=2, rank=2)
    with pytest.raises(MoEEpConfigError, match="needs torch.distributed initialized"):
        moe.MoEEpLayer(
            moe.BootstrapConfig(world_size=2, rank=0, device="cpu"),
            moe.FleetParams(E, TMAX, H),
            moe.MoEWeightPack(w13[:4].contiguous(), w2[:4].contiguous()),
            backend=moe.MegaConfig(moe.ReferenceMegaMoeConfig(H, I, E, K)),
        )
    with pytest.raises(MoEEpConfigError, match="must be a backend config"):
        moe.MegaConfig(megakernel="reference")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"device": "gpu"}, "not a device torch knows"),
        ({"device": 3.5}, "must be a torch.device, a str or an int"),
        ({"device": "meta"}, "must be a CPU or CUDA device"),
        ({"device": -1}, "CUDA index >= 0"),
        ({"transport_timeout_s": "x"}, "finite number of seconds > 0"),
        ({"transport_timeout_s": float("inf")}, "finite number of seconds > 0"),
        ({"transport_timeout_s": None}, "finite number of seconds > 0"),
        ({"rank": True}, "rank must be in"),
        ({"local_rank": -5}, "local_rank must be None or an int >= 0"),
        ({"world_size": 2, "rank": 0, "process_group": "junk"}, "must be a torch.distributed ProcessGroup"),
    ],
)
def test_bootstrap_config_rejects_what_torch_would_fail_on_later(fields, match) -> None:
    with pytest.raises(MoEEpConfigError, match=match):
        moe.BootstrapConfig(**fields)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_a_cuda_device_without_cuda_is_named_as_such(gen) -> None:
    w13, w2 = make_expert_weights(E, H, I, generator=gen)
    with pytest.raises(MoEEpConfigError, match="asks for CUDA, but torch sees no CUDA device"):
        moe.MoEEpLayer(
            moe.BootstrapConfig(device="cuda"),
            moe.FleetParams(E, TMAX, H),
            moe.MoEWeightPack(w13, w2),
            backend=moe.MegaConfig(moe.ReferenceMegaMoeConfig(H, I, E, K)),
        )


def test_layer_arguments_are_checked_before_anything_is_built(gen) -> None:
    w13, w2 = make_expert_weights(E, H, I, generator=gen)
    args = (moe.BootstrapConfig(device="cpu"), moe.FleetParams(E, TMAX, H), moe.MoEWeightPack(w13, w2))
    backend = moe.MegaConfig(moe.ReferenceMegaMoeConfig(H, I, E, K))
    with pytest.raises(MoEEpConfigError, match="check_values must be a bool"):
        moe.MoEEpLayer(*args, backend=backend, check_values=None)
    # a kernel backend's geometry is checked before whether it can run here (a CPU machine says both)
    kernel = moe.MegaConfig(moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(H, 64, E, K))
    with pytest.raises(MoEEpConfigError, match="hidden_size=64 differs"):
        moe.MoEEpLayer(args[0], moe.FleetParams(E, TMAX, 2 * H), args[2], backend=kernel)


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        ("Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig", {"knobs": "junk"}, "knobs must be None, 'auto'"),
        ("Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig", {"knobs": {"tile_mm": 64}}, "unknown tile_mm"),
        ("Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig", {"hidden_size": 100}, "hidden_size must be a multiple of 64"),
        ("Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig", {"intermediate_size": 96}, "multiple of 64"),
        ("Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig", {"knobs": [("tile_m", 64)]}, "a dict of knobs"),
    ],
)
def test_kernel_configs_check_sizes_and_knob_names_on_any_machine(cls, kwargs, match) -> None:
    fields = {"hidden_size": 128, "intermediate_size": 64, "num_experts": 8, "top_k": 2, **kwargs}
    with pytest.raises(MoEEpConfigError, match=match):
        getattr(moe, cls)(**fields)


def test_a_registered_backend_that_cannot_load_says_why() -> None:
    from flashinfer.moe_ep.modes.mega.registry import _REGISTRY, get_mega_backend_class, register_mega_kernel

    with pytest.raises(MoEEpConfigError, match="must be 'package.module:Class'"):
        register_mega_kernel("test-junk", "os")
    try:
        register_mega_kernel("test-missing", "no_such_module_here:Backend")
        register_mega_kernel("test-not-a-backend", "os.path:join")
        with pytest.raises(moe.MoEEpBackendUnavailableError, match="cannot be imported here"):
            get_mega_backend_class("test-missing")
        with pytest.raises(MoEEpConfigError, match="not a MegaKernelBackend subclass"):
            get_mega_backend_class("test-not-a-backend")
    finally:
        for name in ("test-missing", "test-not-a-backend"):
            _REGISTRY.pop(name, None)


def test_destroy(setup, gen) -> None:
    layer, _, _ = setup
    layer.destroy()
    layer.destroy()  # idempotent
    with pytest.raises(MoEEpError, match="destroyed"):
        layer.forward(_inputs(2, gen))
