"""The SM90 MXFP8 / NVFP4 backends on the CPU: the packed weight layout (emulating the kernel's
dequantization bit for bit), config and input validation, cache keys, and AOT builds for sm_90a."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.backends.mega.kernel.sm90.block_scaled import DECODE_MAX_TOKENS, FRONTENDS, bucket_frontends
from flashinfer.moe_ep.cli import main as cli_main
from flashinfer.moe_ep.core.contracts import CONTRACTS
from flashinfer.moe_ep.core.inputs import make_expert_weights
from flashinfer.moe_ep.core.quant import unpack_e2m1
from flashinfer.moe_ep.core.reference_quant import quantize_expert_weights
from flashinfer.moe_ep.errors import MoEEpBackendUnavailableError, MoEEpConfigError
from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop
from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_cache
from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh

FORMATS = ("mxfp8", "nvfp4")
CONFIG = {
    "mxfp8": moe.Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
    "nvfp4": moe.Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
}


def _emulate_kernel_dequant(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the kernel's conversion produces from a packed matrix [E, K/64, N, row]: element x block
    multiplier x 2**-112 (the bit move), as [E, N, K] fp32 (without NVFP4 global scales)."""
    e, kt, n, _ = packed.shape
    d = kh.constants.QUANT_DATA_BYTES[fmt]
    spt = 64 // kh.constants.QUANT_BLOCK[fmt]
    data = packed[..., :d].contiguous()
    vals = data.view(torch.float8_e4m3fn).float() if fmt == "mxfp8" else unpack_e2m1(data)
    mult = packed[..., d : d + 2 * spt].contiguous().view(torch.bfloat16).float()
    out = vals.reshape(e, kt, n, spt, 64 // spt) * mult[..., None] * 2.0**-112
    return out.reshape(e, kt, n, 64).transpose(1, 2).reshape(e, n, kt * 64)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_packed_layout_dequantizes_exactly(fmt: str, activation: str) -> None:
    w13, w2 = make_expert_weights(3, 128, 64, activation, generator=torch.Generator().manual_seed(1))
    q = quantize_expert_weights(w13, w2, fmt)
    g = drop.Geometry(128, 64, 3, 2, activation, None)
    fe = getattr(drop, FRONTENDS[fmt])(
        g, drop.QuantKnobs(fc1_tile_n=128 if activation == "swiglu" else 64, fc2_tile_n=128)
    )
    pw = fe.prepare_weights(q.w13, q.w13_scale, q.w2, q.w2_scale, q.w13_global_scale, q.w2_global_scale)
    assert pw.w13.dtype == torch.uint8 and pw.w13.shape[-1] == kh.constants.QUANT_ROW_BYTES[fmt]
    ref13, ref2 = q.dequantize()
    got13 = _emulate_kernel_dequant(pw.w13, fmt)
    if activation == "swiglu":
        got13 = kh.deinterleave_gate_up(got13, fe.knobs.fc1_tile_n)
    got2 = _emulate_kernel_dequant(pw.w2, fmt)
    if fmt == "nvfp4":  # the kernel applies the global scale to the fp32 accumulator: compare without it
        ref13 = ref13 / q.w13_global_scale[:, None, None]
        ref2 = ref2 / q.w2_global_scale[:, None, None]
        torch.testing.assert_close(got13, ref13, rtol=2**-22, atol=0)
        torch.testing.assert_close(got2, ref2, rtol=2**-22, atol=0)
        assert torch.equal(pw.w13_gscale, q.w13_global_scale)
    else:
        assert torch.equal(got13, ref13) and torch.equal(got2, ref2)
        assert torch.equal(pw.w13_gscale, torch.ones(3))


def test_mxfp8_scales_beyond_bf16_multiplier_are_rejected() -> None:
    weights = kh.pack_quantized_weights
    q = torch.zeros(1, 64, 64, dtype=torch.float8_e4m3fn)
    scale = torch.full((1, 64, 2), 143, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scale bytes > 142"):
        weights(q, scale, q, scale, "mxfp8", 64, False)


def test_config_validation() -> None:
    with pytest.raises(MoEEpConfigError, match="unknown bogus"):
        CONFIG["mxfp8"](256, 128, 8, 2, knobs={"bogus": 1})
    with pytest.raises(MoEEpConfigError, match="input_global_scale must be a finite float > 0"):
        CONFIG["nvfp4"](256, 128, 8, 2, input_global_scale=0.0)
    with pytest.raises(TypeError):
        CONFIG["mxfp8"](256, 128, 8, 2, input_global_scale=1.0)  # MXFP8 has no global scales
    cfg = CONFIG["nvfp4"](256, 128, 8, 2, input_global_scale=0.5, fc2_input_global_scale=0.25)
    assert cfg.weight_format == "nvfp4" and cfg.kernel_name == "sm90_nvfp4_nvfp4_bf16_cutedsl"
    for fmt in FORMATS:  # bad knobs are reported when the backend builds its frontends
        with pytest.raises(MoEEpConfigError, match="tile_m must be 64 or 128"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 256}), 8)
        with pytest.raises(MoEEpConfigError, match="fc2_tile_n"):
            bucket_frontends(CONFIG[fmt](320, 128, 8, 2, knobs={"fc2_tile_n": 256}), 8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_buckets_share_the_weight_layout_and_differ_in_tile_m(fmt: str) -> None:
    fes = bucket_frontends(CONFIG[fmt](256, 128, 8, 2), 8)
    assert fes["decode"].knobs.tile_m == 64 and fes["prefill"].knobs.tile_m == 128
    assert fes["decode"].knobs.fc1_tile_n == fes["prefill"].knobs.fc1_tile_n
    assert fes["decode"].key.digest() != fes["prefill"].key.digest()
    explicit = bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 128}), 8)
    assert explicit["decode"] is explicit["prefill"]
    assert DECODE_MAX_TOKENS == 1024


def test_format_is_part_of_the_cache_key() -> None:
    g = drop.Geometry(256, 128, 8, 2, "swiglu", None)
    keys = {drop.Mxfp8Frontend(g).key.digest(), drop.Nvfp4Frontend(g).key.digest(), drop.Bf16Frontend(g).key.digest()}
    assert len(keys) == 3
    assert "--backend sm90_nvfp4_nvfp4_bf16_cutedsl" in drop.Nvfp4Frontend(g).build_command()


@pytest.mark.parametrize("fmt", FORMATS)
def test_layer_on_cpu_names_what_is_missing(fmt: str) -> None:
    w13, w2 = make_expert_weights(8, 256, 128, "swiglu")
    q = quantize_expert_weights(w13, w2, fmt)
    with pytest.raises(MoEEpBackendUnavailableError, match="CUDA device"):
        moe.MoEEpLayer(
            moe.BootstrapConfig(device="cpu"),
            moe.FleetParams(8, 16, 256),
            moe.MoEWeightPack(q.w13, q.w2, q.w13_scale, q.w2_scale, q.w13_global_scale, q.w2_global_scale),
            backend=moe.MegaConfig(CONFIG[fmt](256, 128, 8, 2)),
        )


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.parametrize("fmt", FORMATS)
def test_build_every_default_variant_for_sm90a(fmt: str, tmp_path: Path, capsys) -> None:
    """Every contract's decode and prefill kernels compile and export for sm_90a on this CPU machine."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    backend = CONFIG[fmt].kernel_name
    assert cli_main(["build", "--backend", backend, "--contract", "all", "--cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    keys = kernel_cache.entries(tmp_path)
    assert f"build: {len(keys)} kernel(s)" in out
    assert len(keys) == 2 * len(CONTRACTS)  # decode and prefill of every contract
    for name, c in CONTRACTS.items():
        cfg = CONFIG[fmt](c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit)
        for fe in bucket_frontends(cfg, c.num_experts).values():
            lib = kernel_cache.lookup(fe.key, tmp_path)
            assert lib is not None and b"__tvm_ffi_" in lib.read_bytes(), name
