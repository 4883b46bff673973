"""The SM90 MXFP8 / NVFP4 backends on the CPU: the packed weight layout (emulating the kernel's
dequantization bit for bit), config and input validation, cache keys, and AOT builds for sm_90a."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.backends.mega.kernel.sm90.block_scaled import (
    BUCKETS,
    EP_FRONTENDS,
    FALLBACKS,
    FRONTENDS,
    EpPlacement,
    bucket_frontends,
    check_launch_limits,
    ep_buckets,
    ep_token_bucket,
    make_frontend,
    token_bucket,
)
from flashinfer.moe_ep.cli import main as cli_main
from flashinfer.moe_ep.core.contracts import CONTRACTS
from flashinfer.moe_ep.core.inputs import make_expert_weights
from flashinfer.moe_ep.core.quant import unpack_e2m1
from flashinfer.moe_ep.core.reference_quant import quantize_expert_weights
from flashinfer.moe_ep.errors import MoEEpBackendUnavailableError, MoEEpConfigError
from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop
from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_cache, kernel_resources
from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh

from .sass import pdl_order, wgmma_batches

FORMATS = ("mxfp8", "nvfp4")
CONFIG = {
    "mxfp8": moe.Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
    "nvfp4": moe.Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
}


def _dequantize_packed(data: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """A packed matrix (data [E, K/64, N, D], scales [E, K/64, N, S]) back to [E, N, K] fp32 values
    times block scales (without NVFP4 global scales), through the drop's inverse of the packing."""
    raw, sc = kh.unpack_quantized_matrix(data, scales, fmt)
    e, n, _ = raw.shape
    if fmt == "mxfp8":
        vals, scale = raw.view(torch.float8_e4m3fn).float(), torch.exp2(sc.float() - 127)
    else:
        vals, scale = unpack_e2m1(raw), sc.view(torch.float8_e4m3fn).float()
    block = kh.constants.QUANT_BLOCK[fmt]
    return (vals.reshape(e, n, -1, block) * scale[..., None]).reshape(e, n, -1)


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
    c = kh.constants
    assert pw.w13.dtype == torch.uint8 and pw.w13.shape[-1] == c.QUANT_DATA_BYTES[fmt]
    assert pw.w13_scale.shape[-1] == c.QUANT_SCALES_PER_TILE[fmt]
    ref13, ref2 = q.dequantize()
    got13 = _dequantize_packed(pw.w13, pw.w13_scale, fmt)
    if activation == "swiglu":
        got13 = kh.deinterleave_gate_up(got13, fe.knobs.fc1_tile_n)
    got2 = _dequantize_packed(pw.w2, pw.w2_scale, fmt)
    if fmt == "nvfp4":  # the kernel applies the global scale to the fp32 accumulator: compare without it
        ref13 = ref13 / q.w13_global_scale[:, None, None]
        ref2 = ref2 / q.w2_global_scale[:, None, None]
        torch.testing.assert_close(got13, ref13, rtol=2**-22, atol=0)
        torch.testing.assert_close(got2, ref2, rtol=2**-22, atol=0)
        assert torch.equal(pw.w13_gscale, q.w13_global_scale)
    else:
        assert torch.equal(got13, ref13) and torch.equal(got2, ref2)
        assert torch.equal(pw.w13_gscale, torch.ones(3))


#: what 32-bit word q of a data segment holds, as the kernels read it: the K positions (relative to the
#: segment) of its bytes. MXFP8: the pairs (2q, 2q+1) and (2q+8, 2q+9) of a K16 block (one lane's A
#: fragment); NVFP4: bytes q, q+4, q+8, q+12 = element pairs 2q + 8j of two K16 blocks.
FRAGMENT_WORD = {
    "mxfp8": lambda q: [2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9],
    "nvfp4": lambda q: [2 * (q + 4 * j) for j in range(4)],  # first element of each byte
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_segment_words_hold_fragment_elements_and_slots_are_swizzled(fmt: str) -> None:
    """The layout contract the kernels rely on, written out independently of the packing code: every
    byte's K position, and the slot of segment s of row r (``s ^ (r // (128 / D)) % (D / 16)``), so
    that 8 consecutive rows cover 8 different 16-byte bank groups. An NVFP4 word is first read back
    through its stored bit layout (``e2m1_word_sources``; the conversion that reads that layout is
    replayed in ``test_block_quant_bits``)."""
    c = kh.constants
    sources = kh.e2m1_word_sources()

    def logical_bytes(stored: list[int]) -> list[int]:
        if fmt == "mxfp8":
            return stored
        word = sum(b << (8 * k) for k, b in enumerate(stored))
        logical = sum(((word >> b) & 1) << (4 * n + i) for b, (n, i) in enumerate(sources))
        return [(logical >> (8 * k)) & 0xFF for k in range(4)]

    d, e, n, k = c.QUANT_DATA_BYTES[fmt], 1, 16, 128
    per_byte = 1 if fmt == "mxfp8" else 2
    pos = torch.arange(k // per_byte, dtype=torch.int64)  # byte b holds K position b * per_byte
    data = (pos % 256).to(torch.uint8).expand(e, n, -1).contiguous()
    # scale 1.0 (a zero NVFP4 scale would zero its block's codes)
    scale = torch.full((e, n, k // c.QUANT_BLOCK[fmt]), 127 if fmt == "mxfp8" else 0x38, dtype=torch.uint8)
    packed, _ = kh.pack_quantized_weights(data, scale, data, scale, fmt, 64, False)[0]
    segs = d // 16
    for row in range(n):
        swz = (row // (128 // d)) % segs
        for t in range(k // 64):
            for s in range(segs):
                seg = packed[0, t, row, 16 * (s ^ swz) : 16 * (s ^ swz) + 16]
                for q in range(4):
                    got = [b * per_byte for b in logical_bytes([int(x) for x in seg[4 * q : 4 * q + 4]])]
                    want = [(64 * t + 16 * per_byte * s + x) % (256 * per_byte) for x in FRAGMENT_WORD[fmt](q)]
                    assert got == want, (row, t, s, q)
        if row % 8 == 7:  # rows row-7..row: segment 0 lands in 8 distinct bank groups of 16 bytes
            groups = {((r * d + 16 * (0 ^ (r // (128 // d)) % segs)) // 16) % 8 for r in range(row - 7, row + 1)}
            assert len(groups) == 8


def test_mxfp8_scales_beyond_bf16_multiplier_are_rejected() -> None:
    weights = kh.pack_quantized_weights
    q = torch.zeros(1, 64, 64, dtype=torch.float8_e4m3fn)
    scale = torch.full((1, 64, 2), 143, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scale bytes > 142"):
        weights(q, scale, q, scale, "mxfp8", 64, False)


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL (pip install .[test])")
def test_drop_refuses_tma_store_where_it_was_not_validated() -> None:
    """The drop's kernel itself refuses ``swap_tma_store`` where the shim does (four warpgroups, one atom), for
    callers that construct it directly; the validated plans construct."""
    kernel = kh.Sm90MegaMoEQuantKernel
    for fmt in ("mxfp8", "nvfp4"):
        for wg, atoms, act in ((4, 1, "swiglu"), (4, 2, "swiglu"), (2, 1, "relu2")):
            with pytest.raises(ValueError, match=f"tma_store is refused with max_wg={wg}, max_atoms={atoms}"):
                kernel(fmt, act, None, 128, 128, 128, 132, swap_ab=True, swap_wg=wg, swap_atoms=atoms,
                       swap_tma_store=True)  # fmt: skip
        for wg, atoms in ((2, 4), (2, 2), (1, 4)):
            kernel(fmt, "swiglu", None, 128, 128, 128, 132, swap_ab=True, swap_wg=wg, swap_atoms=atoms,
                   swap_tma_store=True)  # fmt: skip


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
        for stagger in (-1, 9):
            with pytest.raises(MoEEpConfigError, match="swap_stagger must be 0 to 8"):
                bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 16, "swap_ab": True,
                                                                    "swap_stagger": stagger}), 8)  # fmt: skip
        with pytest.raises(MoEEpConfigError, match="gather_in_fc1 needs the swap-AB GEMMs"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 128, "gather_in_fc1": True}), 8)
        with pytest.raises(MoEEpConfigError, match="swap_split_k needs the swap-AB GEMMs"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 128, "swap_split_k": 2}), 8)
        with pytest.raises(MoEEpConfigError, match="swap_narrow needs the swap-AB GEMMs"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 128, "swap_narrow": True}), 8)
        with pytest.raises(MoEEpConfigError, match="swap_tma_store needs the swap-AB GEMMs"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 128, "swap_tma_store": True}), 8)
        with pytest.raises(MoEEpConfigError, match="swap_tma_store needs the swap-AB GEMMs"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 8, "swap_ab": True, "gemv": True,
                                                                "swap_tma_store": True}), 8)  # fmt: skip
        # four 1-atom warpgroups stored wrong FC2 results through the staging buffers on the H200 (session 38):
        # refused, with four warpgroups of 2 atoms and one atom in two warpgroups (relu2: FC1 plain; never
        # validated) alike
        for wg, atoms, act in ((4, 1, "swiglu"), (4, 2, "swiglu"), (2, 1, "relu2")):
            with pytest.raises(MoEEpConfigError, match="swap_tma_store is refused with four consumer warpgroups"):
                bucket_frontends(CONFIG[fmt](256, 128, 8, 2, activation=act, activation_limit=None,
                                             knobs={"tile_m": 128, "swap_ab": True, "swap_wg": wg,
                                                    "swap_atoms": atoms, "swap_tma_store": True}), 8)  # fmt: skip
        with pytest.raises(MoEEpConfigError, match="gemv_fc1_k_warps needs gemv=True"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 16, "swap_ab": True,
                                                                "gemv_fc1_k_warps": 8}), 8)  # fmt: skip
        gemv = {"tile_m": 8, "swap_ab": True, "gemv": True}
        with pytest.raises(MoEEpConfigError, match="gemv_fc1_k_warps must be 2, 4, 8 or 16, got 3"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={**gemv, "gemv_fc1_k_warps": 3}), 8)
        # FC1's CTA alone outgrows shared memory (16 warps of 3-deep rings); FC2's 4 warps would fit
        with pytest.raises(MoEEpConfigError, match=r"gemv_fc1_k_warps=16 with 8-token blocks and gemv_stages=3"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={**gemv, "gemv_stages": 3, "gemv_fc1_k_warps": 16}), 8)
        bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={**gemv, "gemv_stages": 3, "gemv_fc1_k_warps": 4}), 8)
        with pytest.raises(MoEEpConfigError, match="gemv_early_ring needs gemv=True and fc2_early_weights=True"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={**gemv, "gemv_early_ring": True}), 8)
        pairs = {**gemv, "fc2_early_weights": True, "pair_blocks": True}
        with pytest.raises(MoEEpConfigError, match="gemv_pair_cluster needs pair_combine=True"):
            bucket_frontends(CONFIG[fmt](256, 128, 16, 2, knobs={**pairs, "gemv_pair_cluster": True}), 16)
        with pytest.raises(MoEEpConfigError, match="a cluster holds at most 8 CTAs, top_k=9"):
            bucket_frontends(CONFIG[fmt](256, 128, 32, 9, knobs={**pairs, "pair_combine": True,
                                                                 "gemv_pair_cluster": True}), 32)  # fmt: skip
        clustered = {**pairs, "pair_combine": True, "gemv_pair_cluster": True}
        # FC1's row by bulk copy (drop v57): the pair chain's BF16 row only
        with pytest.raises(MoEEpConfigError, match="gemv_row_tma needs pair_blocks=True and BF16 activations"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={**gemv, "gemv_row_tma": True}), 8)
        with pytest.raises(MoEEpConfigError, match="gemv_row_tma needs pair_blocks=True and BF16 activations"):
            bucket_frontends(CONFIG[fmt](256, 128, 16, 2, knobs={**pairs, "gemv_row_tma": True},
                                         prequantized_input=True), 16)  # fmt: skip
        bucket_frontends(CONFIG[fmt](256, 128, 16, 2, knobs={**pairs, "gemv_row_tma": True}), 16)
        bucket_frontends(CONFIG[fmt](256, 128, 32, 8, knobs=clustered), 32)  # top_k 8: a cluster of 8
        with pytest.raises(MoEEpConfigError, match="gemv_l2_prefetch needs gemv=True"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 16, "swap_ab": True,
                                                                "gemv_l2_prefetch": True}), 8)  # fmt: skip
        with pytest.raises(MoEEpConfigError, match="fc2_early_weights needs the swap-AB GEMMs"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 128, "fc2_early_weights": True}), 8)
        # FC1's early weight loads need the gather kernel before FC1 (its trigger orders the routing)
        with pytest.raises(MoEEpConfigError, match="fc1_early_weights needs the swap-AB GEMMs"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 32, "swap_ab": True, "gather_in_fc1": True,
                                                                "fc1_early_weights": True}), 8)  # fmt: skip
        with pytest.raises(MoEEpConfigError, match=r"swap_split_k must be one of \(1, 2, 4\)"):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 16, "swap_ab": True, "swap_split_k": 3}), 8)
        # four warpgroups of 2 atoms spill from 64-token tiles (measured: stack 32 B at 64, 1.3 KB at 128);
        # rows of 512 (H 2048, 2 I 1536) so that the tile plan does take four warpgroups
        wg4 = {"swap_ab": True, "swap_wg": 4}
        for tile_m in (64, 128):
            with pytest.raises(MoEEpConfigError, match=f"spill registers at {tile_m}-token tiles"):
                bucket_frontends(CONFIG[fmt](2048, 768, 8, 2, knobs={**wg4, "tile_m": tile_m, "swap_atoms": 2}), 8)
        for tile_m, atoms in ((16, 2), (32, 2), (64, 1), (128, 1)):
            fe = bucket_frontends(CONFIG[fmt](2048, 768, 8, 2, knobs={**wg4, "tile_m": tile_m, "swap_atoms": atoms}), 8)
            assert kh.swap_tile_plan(1536, True, tile_m, 4, atoms)[1] == 4, fe
        # where four warpgroups of 2 atoms do not divide the rows the plan takes two: no spill, accepted
        bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={**wg4, "tile_m": 128, "swap_atoms": 2}), 8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_buckets_share_the_weight_layout(fmt: str) -> None:
    fes = bucket_frontends(CONFIG[fmt](256, 128, 8, 2), 8)
    layout = make_frontend(CONFIG[fmt](256, 128, 8, 2), 8)
    mine = [b for b in BUCKETS if b.applies_to(fmt, 256)]  # gemv8r: MXFP8 only; gemv8k2, gemv8r2: NVFP4 only
    assert list(fes) == [b.name for b in mine] and ("gemv8r" in fes) == (fmt == "mxfp8")
    assert ("gemv8k2" in fes) == ("gemv8r2" in fes) == (fmt == "nvfp4")
    for b in mine:
        k, bk = fes[b.name].knobs, b.knobs_for(fmt)
        assert k.swap_ab and k.tile_m == bk["tile_m"] and k.swap_wg == bk.get("swap_wg", 2)
        assert k.swap_atoms == bk.get("swap_atoms", 4) and k.swap_stagger == bk.get("swap_stagger", 0)
        assert k.gather_in_fc1 == bk.get("gather_in_fc1", False)
        assert k.swap_split_k == bk.get("swap_split_k", 1)
        # early weight loads: FC2's in every swap-AB bucket, FC1's where the gather kernel precedes it at T <= 2
        assert k.fc2_early_weights and k.fc1_early_weights == (b.name in ("split16", "sparse16"))
        gemv = b.name in ("gemv8k8", "gemv8", "gemv8k2", "gemv8r", "gemv8r2")
        assert k.gemv == gemv and k.gemv_k_warps == bk.get("gemv_k_warps", 4)
        nvfp4_gemv8 = (b.name, fmt) == ("gemv8", "nvfp4")  # FC2 over 2 warps, FC1 over 4, 3-deep rings (session 43)
        fc1_k_warps = {"gemv8k8": 8, "gemv8r": 8, "gemv8k2": 2, "gemv8r2": 4}.get(b.name, 4 if nvfp4_gemv8 else None)
        assert k.gemv_fc1_k_warps == fc1_k_warps
        assert k.gemv_stages == (3 if nvfp4_gemv8 else 2)
        # FC2's whole ring before its wait: MXFP8's gemv8 and gemv8r (session 42), and its gemv8k8 (session 46)
        # and NVFP4's gemv8r2 (session 51)
        routed = b.name in ("gemv8r", "gemv8r2")
        assert k.gemv_early_ring == (routed or (fmt == "mxfp8" and b.name in ("gemv8", "gemv8k8")))
        # the pair chain (the GEMV buckets but the routed ones: no routing, gather or combine kernel) and elsewhere
        # the gather, which quantizes its first items before it waits for the routing
        paired = gemv and not routed
        assert k.pair_blocks == k.pair_combine == paired and k.gather_early_rows == (not paired)
        assert k.fc1_tile_n == layout.knobs.fc1_tile_n  # one packed layout
    assert len({fe.key.digest() for fe in fes.values()}) == len(fes)
    gathering = {b for b, fe in fes.items() if fe.knobs.gather_in_fc1}
    assert gathering == ({"swap32", "swap128"} if fmt == "mxfp8" else {"swap32", "swap64", "swap128"})
    four = {b for b, fe in fes.items() if fe.knobs.swap_wg == 4}  # NVFP4 swap16: four consumer warpgroups
    assert four == (set() if fmt == "mxfp8" else {"swap16"})
    assert fes["swap16"].knobs.swap_atoms == (4 if fmt == "mxfp8" else 2)
    assert {b for b, fe in fes.items() if fe.knobs.swap_split_k > 1} == {"split16"}
    staged = {b for b, fe in fes.items() if fe.knobs.swap_tma_store}  # FC2 through TMA stores (session 38)
    assert staged == (set() if fmt == "mxfp8" else {"swap128"})
    assert fes["split16"].knobs == dataclasses.replace(fes["sparse16"].knobs, swap_split_k=2)
    explicit = bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 128}), 8)
    assert len({id(fe) for fe in explicit.values()}) == 1


@pytest.mark.parametrize("fmt", (None, *FORMATS))
def test_token_buckets_follow_the_pairs_per_expert(fmt: str | None) -> None:
    """By T * top_k / experts: <= 1/2 sparse16 (NVFP4 <= 1/8: its swap16 has four warpgroups; T = 1 there
    on every contract), <= 8 swap16, <= 16 swap32, <= 32 swap64, else swap128."""
    sparse = 8 if fmt == "nvfp4" else 2  # 1 / the sparse16 bound
    for k, e in ((8, 128), (8, 256), (4, 16)):
        assert token_bucket(0, k, e, fmt) == "sparse16"
        t = e // (sparse * k)
        assert token_bucket(t, k, e, fmt) == "sparse16" and token_bucket(t + 1, k, e, fmt) == "swap16", (k, e, t)
        for bucket, top in (("swap16", 8), ("swap32", 16), ("swap64", 32)):
            t = top * e // k
            assert token_bucket(t, k, e, fmt) == bucket and token_bucket(t + 1, k, e, fmt) != bucket, (k, e, t)
        assert token_bucket(10**6, k, e, fmt) == "swap128"
    assert [token_bucket(t, 8, 128, fmt) for t in (1, 2, 3, 8, 9, 128, 129, 256, 257, 512, 513)] == [
        "sparse16", "sparse16", "sparse16" if sparse == 2 else "swap16", "sparse16" if sparse == 2 else "swap16",
        "swap16", "swap16", "swap32", "swap32", "swap64", "swap64", "swap128",
    ]  # fmt: skip
    assert token_bucket(1, 8, 256, fmt) == token_bucket(1, 8, 128, fmt) == "sparse16"  # T = 1 on every contract


@pytest.mark.parametrize("fmt", FORMATS)
def test_nvfp4_sparse16_serves_while_its_fc1_fits_one_wave(fmt: str) -> None:
    """NVFP4's ``sparse16`` also needs its 256-row FC1 tiles over ``min(T * top_k, experts)`` busy
    experts to fit the grid (session 18 A/B: it wins in one wave, four-warpgroup ``swap16`` from two);
    MXFP8, and callers that give no frontends, follow the pairs per expert alone. Before both,
    ``split16`` (``sparse16`` with split K) serves where twice those tiles fit (its split then runs):
    qwen3-30b-a3b T = 1 (2 x 48 of 132), in both formats; never without frontends."""
    last = {"qwen3-30b-a3b": 2, "qwen3-235b-a22b": 1, "deepseek-v3": 1}  # the last NVFP4 sparse16 T
    split = {"qwen3-30b-a3b": 1, "qwen3-235b-a22b": 0, "deepseek-v3": 0}  # T served by split16
    for name, last_t in last.items():
        c = CONTRACTS[name]
        fes = bucket_frontends(CONFIG[fmt](c.hidden_size, c.intermediate_size, c.num_experts, c.top_k), c.num_experts)
        fc1_rows = 2 * c.intermediate_size
        assert fes["sparse16"].fc1_cta_tiles(c.top_k) == c.top_k * fc1_rows // 256  # T = 1: 256-row CTAs
        assert fes["swap16"].fc1_cta_tiles(c.top_k) == c.top_k * fc1_rows // 512
        picks = [token_bucket(t, c.top_k, c.num_experts, fmt, fes) for t in range(1, 5)]
        by_pairs = [token_bucket(t, c.top_k, c.num_experts, fmt) for t in range(1, 5)]
        assert "split16" not in by_pairs
        n = split[name]
        assert picks[:n] == ["split16"] * n and "split16" not in picks[n:], (name, picks)
        assert (2 * fes["split16"].fc1_cta_tiles(c.top_k) <= 132) == (n == 1)  # T = 1: two parts per FC1 tile
        picks = ["sparse16" if p == "split16" else p for p in picks]
        if fmt == "mxfp8":
            assert picks == by_pairs, name
        else:
            assert picks == ["sparse16"] * last_t + ["swap16"] * (4 - last_t), (name, picks)
            assert by_pairs[:last_t] == picks[:last_t]  # the wave only ever moves T up to swap16
    # EP: the global tokens, this rank's share of the busy experts, its grid (loopback: the SMs / ranks).
    # qwen3-235b-a22b, 2 ranks x 1 row: 16 busy experts, 8 on a rank -> 96 FC1 tiles: one wave of 132
    # CTAs (a rank per GPU), two of 66 (two loopback ranks on one GPU)
    c = CONTRACTS["qwen3-235b-a22b"]
    cfg = CONFIG[fmt](c.hidden_size, c.intermediate_size, c.num_experts, c.top_k)
    for per_gpu, want in ((1, "sparse16"), (2, "swap16")):
        fes = bucket_frontends(cfg, c.num_experts // 2, EpPlacement(2, per_gpu))
        assert fes["sparse16"].fc1_cta_tiles(8) == 96 and fes["sparse16"].knobs.grid == 132 // per_gpu
        got = ep_token_bucket(1, 2, c.top_k, c.num_experts, fmt, fes)
        assert got == (want if fmt == "nvfp4" else "sparse16"), (per_gpu, got)
    # H = 1024: 16 K tiles, too short for two parts of 16, so split16 never serves (its kernel would not split)
    short = bucket_frontends(CONFIG[fmt](1024, 768, 128, 8), 128)
    assert not short["split16"].fc1_splits_into(2) and bucket_frontends(cfg, 128)["split16"].fc1_splits_into(2)
    assert 2 * short["split16"].fc1_cta_tiles(8) <= 132
    assert token_bucket(1, 8, 128, fmt, short) == "sparse16"
    # a fallback frontend (no swap-AB: I = 192) has no FC1 wave: the pairs decide
    fes = bucket_frontends(CONFIG[fmt](256, 192, 8, 2), 8)
    assert fes["sparse16"].fc1_cta_tiles(8) is None
    assert [token_bucket(t, 2, 8, fmt, fes) for t in range(4)] == [token_bucket(t, 2, 8, fmt) for t in range(4)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv8_serves_its_formats_pairs_and_hidden_sizes(fmt: str) -> None:
    """The expert GEMV buckets (sessions 24, 32, 33 and 40 A/B; session 39's wider range was a misread A/B, undone
    in session 40): ``gemv8k8`` (FC1 over 8 GEMV warps; MXFP8's FC2 too, session 41) up to 1/16 pair per expert,
    ``gemv8`` up to 1/8 (T = 1 and T = 2 on the qwen3 contracts; ``gemv8k8`` combining in clusters, NVFP4's since
    session 45, MXFP8's with FC2 over 4 warps and its early ring since session 46), where H <= 2048 (qwen3-30b-a3b;
    qwen3-235b-a22b's 4096 and deepseek-v3's 7168 keep the swap-AB buckets), in both formats, with the pair chain
    and without the L2 prefetches (measured slower), and never for callers that give no H, nor in an EP layer (its
    knobs are world-size-1 knobs)."""
    gemvs = ("gemv8k8", "gemv8")
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"):
        c = CONTRACTS[name]
        first, last = c.num_experts // c.top_k // 16, c.num_experts // c.top_k // 8  # 1/16 and 1/8 pair per expert
        cfg = CONFIG[fmt](c.hidden_size, c.intermediate_size, c.num_experts, c.top_k)
        fes = bucket_frontends(cfg, c.num_experts)
        picks = [token_bucket(t, c.top_k, c.num_experts, fmt, fes, c.hidden_size) for t in range(1, last + 9)]
        if c.hidden_size <= 2048:
            assert first >= 1 and picks[:last] == ["gemv8k8"] * first + ["gemv8"] * (last - first), (name, picks)
            assert not set(gemvs) & set(picks[last:]), (name, picks)
            for b in gemvs:
                k = fes[b].knobs
                fc2_warps = {("gemv8", "nvfp4"): 2}.get((b, fmt), 4)
                stages = 3 if (b, fmt) == ("gemv8", "nvfp4") else 2  # session 43
                assert k.gemv and k.tile_m == 8 and k.gemv_stages == stages and k.gemv_k_warps == fc2_warps
                assert k.pair_blocks and k.pair_combine and not k.gemv_l2_prefetch
                # every T the bucket serves fits one pair chain launch (T * top_k <= num_experts)
                assert fes[b].pair_blocks_max_tokens >= last
            assert fes["gemv8k8"].knobs == dataclasses.replace(fes["gemv8"].knobs, gemv_fc1_k_warps=8, gemv_k_warps=4,
                                                               gemv_early_ring=fmt == "mxfp8", gemv_stages=2,
                                                               gemv_pair_cluster=True)  # fmt: skip
            assert fes["gemv8"].knobs.gemv_early_ring == (fmt == "mxfp8")  # session 42
            assert not fes["gemv8"].knobs.gemv_pair_cluster  # session 45
        else:
            assert not set(gemvs) & (set(picks) | set(fes)), (name, picks)  # no kernel built for them
        assert not set(gemvs) & {token_bucket(t, c.top_k, c.num_experts, fmt, fes) for t in range(1, 10)}
        assert not set(gemvs) & set(bucket_frontends(cfg, c.num_experts // 2, EpPlacement(2)))
    assert not set(gemvs) & {b.name for b in ep_buckets(2)}


def test_gemv8k8_clusters_the_pairs_only_where_a_cluster_holds_them() -> None:
    """``gemv8k8`` sets ``gemv_pair_cluster`` (NVFP4 since session 45; MXFP8 since session 46, with FC2 over 4 warps
    and its early ring) where top_k <= 8; a layer of top_k 9 keeps the bucket's GEMV pair chain with the counters'
    combine (not the fallback tiles), and MXFP8 there keeps FC2 over 8 warps without the early ring."""
    for fmt in FORMATS:
        for top_k, clustered in ((8, True), (9, False)):
            cfg = CONFIG[fmt](2048, 768, 16 * top_k, top_k)
            k = bucket_frontends(cfg, cfg.num_experts)["gemv8k8"].knobs
            assert k.gemv and k.pair_combine and k.tile_m == 8 and k.gemv_pair_cluster == clustered, (fmt, top_k)
            assert k.gemv_fc1_k_warps == 8 and k.gemv_stages == 2
            mx_chain = fmt == "mxfp8" and not clustered  # session 41's MXFP8 chain: FC2 over 8 warps
            assert k.gemv_k_warps == (8 if mx_chain else 4), (fmt, top_k)
            assert k.gemv_early_ring == (fmt == "mxfp8" and clustered), (fmt, top_k)
    bucket = next(b for b in BUCKETS if b.name == "gemv8k8")
    assert bucket.knobs_for("mxfp8") == bucket.knobs_for("mxfp8", 8) != bucket.knobs_for("mxfp8", 9)


def test_pair_chain_bulk_copies_bf16_rows_only() -> None:
    """The pair chain's buckets (``gemv8k8``, ``gemv8``, NVFP4's ``gemv8k2``) set ``gemv_row_tma`` (session 47) where
    the layer's activations arrive as BF16; a ``prequantized_input`` layer keeps the same buckets (the GEMV pair
    chain, not the fallback tiles) with the same knobs but that one, its FC1 preparing the row from the codes as
    before."""
    for fmt in FORMATS:
        chain = ("gemv8k8", "gemv8", "gemv8k2") if fmt == "nvfp4" else ("gemv8k8", "gemv8")
        for top_k in (8, 9):
            cfg = CONFIG[fmt](2048, 768, 16 * top_k, top_k)
            pre = dataclasses.replace(cfg, prequantized_input=True)
            bf16_fes, pre_fes = bucket_frontends(cfg, cfg.num_experts), bucket_frontends(pre, pre.num_experts)
            for name in chain:
                k, kp = bf16_fes[name].knobs, pre_fes[name].knobs
                assert k.pair_blocks and k.gemv_row_tma and kp.pair_blocks and not kp.gemv_row_tma, (fmt, top_k, name)
                assert dataclasses.replace(k, gemv_row_tma=False) == kp, (fmt, top_k, name)
            assert not any(fe.knobs.gemv_row_tma for b, fe in bf16_fes.items() if b not in chain)


def _gemv_bucket_layers(bucket: str, fmt: str) -> list[tuple[Any, dict[str, Any], dict[int, str], list[int]]]:
    """The bench contracts' world-size-1 layers of weight format ``fmt`` with H <= 2048, where a GEMV bucket may
    serve: (contract, bucket frontends, T -> bucket for T = 1-39, the T that ``bucket`` serves) each. Every other
    layer (the other format, a larger H) is checked here to neither serve nor build ``bucket``, and so is an EP
    layer's bucket list (the GEMV is a world-size-1 knob)."""
    layers = []
    for f in FORMATS:
        for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"):
            c = CONTRACTS[name]
            fes = bucket_frontends(CONFIG[f](c.hidden_size, c.intermediate_size, c.num_experts, c.top_k), c.num_experts)
            picks = {t: token_bucket(t, c.top_k, c.num_experts, f, fes, c.hidden_size) for t in range(1, 40)}
            served = [t for t, b in picks.items() if b == bucket]
            if f == fmt and c.hidden_size <= 2048:
                layers.append((c, fes, picks, served))
            else:
                assert not served and bucket not in fes, (f, name, picks)
    assert bucket not in {b.name for b in ep_buckets(2)}
    assert layers, (bucket, fmt)  # qwen3-30b-a3b at least: the callers' checks are never vacuous
    return layers


def test_routed_gemv_serves_mxfp8_from_one_eighth_to_one_pair_per_expert() -> None:
    """``gemv8r`` (session 42): MXFP8's routed GEMV (FC1 over 8 warps, FC2's early ring, the routing, gather and
    combine kernels around it) past ``gemv8`` up to one pair per expert where H <= 2048 (qwen3-30b-a3b T = 3-16);
    not NVFP4, not the larger contracts, not an EP layer."""
    for c, fes, picks, served in _gemv_bucket_layers("gemv8r", "mxfp8"):
        assert served == list(range(3, c.num_experts // c.top_k + 1)), picks  # up to one pair per expert
        k = fes["gemv8r"].knobs
        assert k.gemv and k.tile_m == 8 and k.gemv_fc1_k_warps == 8 and k.gemv_k_warps == 4
        assert k.gemv_early_ring and k.fc2_early_weights and k.gather_early_rows and not k.fc1_early_weights
        assert not (k.pair_blocks or k.pair_combine or k.gemv_l2_prefetch)


def test_two_warp_pair_chain_serves_nvfp4_to_three_sixteenths_of_a_pair_per_expert() -> None:
    """``gemv8k2`` (session 51): NVFP4's pair chain with FC1 and FC2 over 2 GEMV warps and 2-deep rings, past
    ``gemv8`` up to 3/16 pair per expert where H <= 2048 (qwen3-30b-a3b T = 3, its CTAs then one wave); not MXFP8,
    not the larger contracts, not an EP layer."""
    for c, fes, picks, served in _gemv_bucket_layers("gemv8k2", "nvfp4"):
        assert served == [t for t in picks if 2 * c.num_experts < 16 * t * c.top_k <= 3 * c.num_experts]
        assert served == [3], picks
        k = fes["gemv8k2"].knobs
        assert k.gemv and k.tile_m == 8 and k.gemv_fc1_k_warps == 2 and k.gemv_k_warps == 2
        assert k.gemv_stages == 2 and k.pair_blocks and k.pair_combine and k.gemv_row_tma
        assert not (k.gemv_early_ring or k.gemv_pair_cluster or k.gemv_l2_prefetch)


def test_nvfp4_routed_gemv_serves_past_three_eighths_to_nine_sixteenths_of_a_pair_per_expert() -> None:
    """``gemv8r2`` (session 51): NVFP4's routed GEMV with FC1 over 4 GEMV warps, FC2 over 2 and FC2's early ring,
    past 3/8 up to 9/16 pair per expert where H <= 2048 (qwen3-30b-a3b T = 7-9, where ``swap16``'s FC1 passes one
    wave); ``swap16`` on both sides; not MXFP8, not the larger contracts, not an EP layer."""
    for c, fes, picks, served in _gemv_bucket_layers("gemv8r2", "nvfp4"):
        assert served == [t for t in picks if 3 * c.num_experts < 8 * t * c.top_k <= 4.5 * c.num_experts]
        assert served == [7, 8, 9] and picks[6] == picks[10] == "swap16", picks
        k = fes["gemv8r2"].knobs
        assert k.gemv and k.tile_m == 8 and k.gemv_fc1_k_warps == 4 and k.gemv_k_warps == 2
        assert k.gemv_stages == 2 and k.gemv_early_ring and k.fc2_early_weights and k.gather_early_rows
        assert not (k.pair_blocks or k.pair_combine or k.gemv_row_tma or k.gemv_l2_prefetch)
    # the window's lower bound alone: a bucket serves nothing at or below it
    window = next(b for b in BUCKETS if b.name == "gemv8r2")
    assert not window.serves(6, 8, 128, "nvfp4", hidden=2048) and window.serves(7, 8, 128, "nvfp4", hidden=2048)


def test_nvfp4_split16_serves_many_waves_where_k_is_long() -> None:
    """NVFP4's ``split16`` past 1/8 pair per expert whatever its FC1 waves, up to 1/2, where H >= 4096 (session 42:
    qwen3-235b-a22b T = 3-8, deepseek-v3 T = 5-16); at and below 1/8 the one-wave rule as before (qwen3-235b-a22b
    T = 2, deepseek-v3 T = 2-4: ``swap16``); qwen3-30b-a3b (H = 2048) and MXFP8 keep their buckets."""
    expect = {
        "qwen3-235b-a22b": ["sparse16", "swap16"] + ["split16"] * 6 + ["swap16"] * 4,  # T = 1..12
        "deepseek-v3": ["sparse16"] + ["swap16"] * 3 + ["split16"] * 12 + ["swap16"] * 4,  # T = 1..20
        "qwen3-30b-a3b": ["gemv8k8", "gemv8", "gemv8k2"] + ["swap16"] * 3 + ["gemv8r2"] * 3 + ["swap16"] * 3,
    }
    for name, want in expect.items():
        c = CONTRACTS[name]
        cfg = CONFIG["nvfp4"](c.hidden_size, c.intermediate_size, c.num_experts, c.top_k)
        fes = bucket_frontends(cfg, c.num_experts)
        picks = [token_bucket(t, c.top_k, c.num_experts, "nvfp4", fes, c.hidden_size) for t in range(1, len(want) + 1)]
        assert picks == want, (name, picks)
        # the rule needs H (a caller without it gets the bounds every format shares) and the swap-AB frontend
        assert "split16" not in [token_bucket(t, c.top_k, c.num_experts, "nvfp4", fes) for t in range(3, 9)]
    c = CONTRACTS["qwen3-235b-a22b"]
    mx = bucket_frontends(CONFIG["mxfp8"](c.hidden_size, c.intermediate_size, c.num_experts, c.top_k), c.num_experts)
    assert [token_bucket(t, c.top_k, c.num_experts, "mxfp8", mx, c.hidden_size) for t in (3, 8, 9)] == [
        "sparse16", "sparse16", "swap16"
    ]  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_knob_validation(fmt: str) -> None:
    """``gemv`` needs the swap-AB layout with 8 or 16-token blocks, whole tiles (no split K), no token-row
    gather, and H and I multiples of its K unit (NVFP4: 128); the EP frontends refuse it."""
    base = {"swap_ab": True, "tile_m": 8, "gemv": True}
    bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs=base), 8)
    bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={**base, "tile_m": 16, "gemv_k_warps": 2}), 8)
    for bad, match in (
        ({"tile_m": 32}, "gemv needs swap_ab=True with tile_m 8 or 16"),
        ({"swap_ab": False}, "gemv needs swap_ab=True"),
        ({"swap_split_k": 2}, "swap_split_k=1"),
        ({"gather_in_fc1": True}, "no gather_in_fc1"),
        ({"gemv_k_warps": 3}, "gemv_k_warps must be 2, 4, 8 or 16"),
    ):
        with pytest.raises(MoEEpConfigError, match=match):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={**base, **bad}), 8)
    if fmt == "nvfp4":  # I = 192: not a multiple of the 128-element unit (nor of 256 gate/up rows)
        with pytest.raises(MoEEpConfigError, match="gemv"):
            bucket_frontends(CONFIG[fmt](256, 192, 8, 2, knobs=base), 8)
    with pytest.raises(MoEEpConfigError, match="gemv is a world-size-1 knob"):
        bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs=base), 4, EpPlacement(2))


PAIR_KNOBS = {"swap_ab": True, "tile_m": 8, "gemv": True, "fc2_early_weights": True, "pair_blocks": True}


@pytest.mark.parametrize("fmt", FORMATS)
def test_pair_knob_validation(fmt: str) -> None:
    """``pair_blocks`` (drop v45) needs the GEMV and makes FC1 the layer's first kernel (no early FC1
    weights, no gather to start early); ``pair_combine`` needs ``pair_blocks``; a launch takes ``T * top_k <=
    num_experts`` (checked before the launch, and at construction where a layer's capacity exceeds it); the
    EP frontends refuse them (the GEMV is a world-size-1 knob)."""
    cfg = CONFIG[fmt](256, 128, 8, 2, knobs={**PAIR_KNOBS, "pair_combine": True})
    (fe,) = set(bucket_frontends(cfg, 8).values())
    assert fe.launch_token_limit == (4, "pair_blocks", "T * top_k <= num_experts")
    fe.check_launch_tokens(4)
    with pytest.raises(ValueError, match=r"pair_blocks serves at most 4 tokens per launch .* got T=5"):
        fe.check_launch_tokens(5)
    check_launch_limits(cfg, {b.name: fe for b in BUCKETS}, 8, 4)
    with pytest.raises(MoEEpConfigError, match="pair_blocks serves at most 4 tokens.*max_tokens_per_rank=5"):
        check_launch_limits(cfg, {b.name: fe for b in BUCKETS}, 8, 5)
    for bad, match in (
        ({"gemv": False, "tile_m": 16}, "pair_blocks needs gemv=True"),
        ({"fc1_early_weights": True}, "fc1_early_weights=False and gather_early_rows=False"),
        ({"gather_early_rows": True}, "fc1_early_weights=False and gather_early_rows=False"),
        ({"pair_blocks": False, "pair_combine": True}, "pair_combine needs pair_blocks=True"),
    ):
        with pytest.raises(MoEEpConfigError, match=match):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={**PAIR_KNOBS, **bad}), 8)
    ep_knobs = {k: v for k, v in PAIR_KNOBS.items() if k != "fc2_early_weights"}
    with pytest.raises(MoEEpConfigError, match="gemv is a world-size-1 knob"):
        bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs=ep_knobs), 4, EpPlacement(2))
    # the default buckets: on in the pair chain's GEMV buckets only (session 32's A/B; NVFP4's gemv8k2, session 51)
    chain = [b.name for b in BUCKETS if b.knobs_for(fmt).get("pair_blocks") and b.applies_to(fmt, 2048)]
    assert chain == (["gemv8k8", "gemv8", "gemv8k2"] if fmt == "nvfp4" else ["gemv8k8", "gemv8"])


FUSED_KNOBS = {**PAIR_KNOBS, "pair_combine": True, "fc2_early_weights": False, "gemv_k_warps": 8, "gemv_stages": 4,
               "gemv_fused": True}  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_fused_knob_validation(fmt: str) -> None:
    """``gemv_fused`` (drop v58) needs the pair chain with its combine, refuses the two-kernel chain's own knobs (they
    do not apply to one grid), checks its CTA's shared memory (rings, partial-sum buffers, two token and two
    activation rows), takes ``T * top_k <= min(num_experts, num_sms)`` per launch, and sizes ``split_ws`` /
    ``split_count`` for its partials, flags and grid barrier; the EP frontends refuse it (the GEMV is world size 1)."""
    cfg = CONFIG[fmt](256, 128, 256, 2, knobs=FUSED_KNOBS)
    (fe,) = set(bucket_frontends(cfg, 256).values())
    assert fe.launch_token_limit == (66, "gemv_fused", "T * top_k <= num_experts and <= num_sms")
    with pytest.raises(ValueError, match=r"gemv_fused serves at most 66 tokens per launch .* got T=67"):
        fe.check_launch_tokens(67)
    (small,) = set(bucket_frontends(CONFIG[fmt](256, 128, 16, 4, knobs=FUSED_KNOBS), 16).values())
    assert small.launch_token_limit[0] == 4
    spec = {b.name: b.shape for b in fe.workspace_spec(4)}
    assert spec["split_ws"] == (132 * 16 * 32,) and spec["split_count"] == (132 + 2,)
    rings, parts, rows = 8 * 4 * (4096 + 1024), 2 * 8 * 2048, 2 * (2048 + 768) * 2
    assert kh.gemv_fused_shared_bytes(8, 4, 2048, 768) == rings + parts + rows + 64
    for bad, match in (
        ({"pair_combine": False}, "gemv_fused needs pair_combine=True"),
        ({"gemv_fc1_k_warps": 8}, "gemv_fc1_k_warps do not apply"),
        ({"gemv_pair_cluster": True}, "gemv_pair_cluster do not apply"),
        ({"gemv_row_tma": True}, "gemv_row_tma do not apply"),
        ({"fc2_early_weights": True, "gemv_early_ring": True}, "gemv_early_ring, fc2_early_weights do not apply"),
        ({"gemv_k_warps": 16}, r"gemv_fused with gemv_k_warps=16 and gemv_stages=4 needs \d+ bytes"),
    ):
        with pytest.raises(MoEEpConfigError, match=match):
            bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={**FUSED_KNOBS, **bad}), 8)
    with pytest.raises(MoEEpConfigError, match="gemv is a world-size-1 knob"):
        bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs=FUSED_KNOBS), 4, EpPlacement(2))
    # not in any default bucket (no GPU measurement of it yet)
    assert not any(b.knobs_for(fmt).get("gemv_fused") for b in BUCKETS)


def test_gemv_fused_refuses_a_device_with_fewer_sms(monkeypatch) -> None:
    """A grid barrier with more CTAs than SMs would hang: ``gemv_fused``'s launch raises first (H100 PCIe: 114
    SMs against the default 132 CTAs), before anything runs, and passes where the SMs suffice."""
    (fe,) = set(bucket_frontends(CONFIG["nvfp4"](256, 128, 8, 2, knobs=FUSED_KNOBS), 8).values())

    class Cuda:  # the launch's tensor, as far as the check reads it
        is_cuda = True

        def __init__(self, index: int) -> None:
            self.device = torch.device("cuda", index)

    sms = {0: 114, 1: 132}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: dataclasses.make_dataclass(
        "Props", [("multi_processor_count", int)])(sms[d.index]))  # fmt: skip
    with pytest.raises(ValueError, match="gemv_fused needs its 132 CTAs co-resident, but cuda:0 has 114 SMs"):
        fe.check_grid_coresident(Cuda(0), "gemv_fused")
    fe.check_grid_coresident(Cuda(1), "gemv_fused")


def test_gemv_shared_bytes_of_the_pair_chain() -> None:
    """A GEMV CTA's shared memory: per warp and ring stage 4 KB of weight data, 1 KB of scale words and the token
    chunks of its 8-token block (MXFP8 1 KB, NVFP4 2 KB), then 2 KB of fp32 partials per warp (16 a lane); the
    pair chain's FC1 (``gather_x``: ``token_row`` = K > 0) holds the token row (2 bytes an element) instead of
    the chunks."""
    assert kh.gemv_shared_bytes("nvfp4", 8, 4, 2) == 4 * 2 * (4096 + 1024 + 2048) + 4 * 2048
    assert kh.gemv_shared_bytes("mxfp8", 8, 4, 2) == 4 * 2 * (4096 + 1024 + 1024) + 4 * 2048
    for fmt in FORMATS:
        assert kh.gemv_shared_bytes(fmt, 8, 8, 2, 2048) == 8 * 2 * (4096 + 1024) + 8 * 2048 + 2 * 2048


@pytest.mark.parametrize("fmt", FORMATS)
def test_pair_combine_sizes_its_counters(fmt: str) -> None:
    """``pair_combine``'s arrival counters (one per token of a ``pair_blocks`` launch and 64-row row warp of
    FC2) extend ``expert_count``; without it ``expert_count`` is E + 1; the shared workspace holds the larger."""
    cfg = CONFIG[fmt](256, 128, 8, 2)
    combined = make_frontend(cfg, 8, {**PAIR_KNOBS, "pair_combine": True})
    plain = make_frontend(cfg, 8, PAIR_KNOBS)
    assert kh.constants.GEMV_ROW_WARP_ROWS == 64
    assert {s.name: s.shape for s in combined.workspace_spec(4)}["expert_count"] == (8 + 1 + 4 * (256 // 64),)
    assert {s.name: s.shape for s in plain.workspace_spec(4)}["expert_count"] == (9,)
    assert combined.key.digest() != plain.key.digest()
    views = drop.allocate_shared_workspace([combined, plain], 4, torch.device("cpu"))
    assert views[0]["expert_count"].shape == (25,) and int(views[0]["expert_count"].abs().sum()) == 0


def test_swap_tile_plan() -> None:
    """(atoms of 64 weight rows per warpgroup, warpgroups per CTA) of the swap-AB GEMMs."""
    plan = kh.swap_tile_plan
    for tok in (16, 32):  # 4 atoms where the rows allow
        assert plan(4096, True, tok) == (4, 2) and plan(1536, True, tok) == (4, 2) and plan(256, True, tok) == (4, 1)
        assert plan(7168, False, tok) == (4, 2) and plan(2048, False, tok, 1) == (4, 1)  # swap_wg=1: 256-row CTAs
        assert plan(128, False, tok) == (2, 1) and plan(384, False, tok) == (2, 1) and plan(768, False, tok) == (4, 1)
    for tok in (64, 128):  # 2 atoms (registers): a gated CTA is one 256-row block over two warpgroups
        assert plan(4096, True, tok) == (2, 2) and plan(256, True, tok) == (2, 2)
        assert plan(7168, False, tok) == (2, 2) and plan(384, False, tok) == (2, 1)
        assert plan(2048, False, tok, 1) == (2, 1)
        with pytest.raises(ValueError, match="needs two consumer warpgroups"):
            plan(4096, True, tok, 1)
    # max_atoms=2: 2 atoms at every token tile (128 rows per warpgroup); gated still two warpgroups
    for tok in (16, 32, 64):
        assert plan(4096, True, tok, 2, 2) == (2, 2) and plan(1536, True, tok, 2, 2) == (2, 2)
        assert plan(2048, False, tok, 2, 2) == (2, 2) and plan(2048, False, tok, 1, 2) == (2, 1)
        assert plan(128, False, tok, 2, 2) == (2, 1)
        with pytest.raises(ValueError, match="needs two consumer warpgroups"):
            plan(4096, True, tok, 1, 2)
    # four warpgroups (112 registers): 2 or 1 atoms; a gated block of 1-atom warpgroups takes all four
    for tok in (16, 32, 64, 128):
        assert plan(1536, True, tok, 4, 1) == (1, 4) and plan(256, True, tok, 4, 1) == (1, 4)
        assert plan(2048, False, tok, 4, 1) == (1, 4) and plan(128, False, tok, 4, 1) == (1, 2)
        assert plan(7168, False, tok, 4, 2) == (2, 4) and plan(384, False, tok, 4, 2) == (2, 1)
        assert plan(1536, True, tok, 4, 2) == (2, 4) and plan(768, True, tok, 4, 2) == (2, 2)
        with pytest.raises(ValueError, match="needs four consumer warpgroups"):
            plan(1536, True, tok, 2, 1)
        with pytest.raises(ValueError, match="take 2 or 1 atoms"):
            plan(1536, True, tok, 4, 4)
    with pytest.raises(ValueError, match="1, 2 or 4 WGMMA atoms"):
        plan(256, False, 16, 2, 3)
    for rows, gated in ((384, True), (192, False), (2880, False)):
        with pytest.raises(ValueError, match="multiple of"):
            plan(rows, gated, 16)
    with pytest.raises(ValueError, match="1, 2 or 4 consumer warpgroups"):
        plan(256, False, 16, 3)
    with pytest.raises(ValueError, match="token tile must be"):
        plan(256, False, 256)


@pytest.mark.parametrize("fmt", FORMATS)
def test_swap_bucket_falls_back_where_the_swap_kernel_does_not_fit(fmt: str) -> None:
    """I = 192: 2I = 384 rows are not interleaved per 256 (fc1_tile_n 128), so the swap-AB GEMMs
    cannot serve FC1 and the buckets use their fallbacks (64-row tiles up to 32 pairs per expert,
    128-row tiles above); an explicit request is refused."""
    fes = bucket_frontends(CONFIG[fmt](256, 192, 8, 2), 8)
    assert not any(fe.knobs.swap_ab for fe in fes.values())
    for b in (b for b in BUCKETS if b.applies_to(fmt, 256)):
        assert fes[b.name] is fes[BUCKETS[-1].name if b.fallback == "prefill" else "sparse16"]
        assert fes[b.name].knobs.tile_m == FALLBACKS[b.fallback].get("tile_m", 128)
    with pytest.raises(MoEEpConfigError, match="interleaved per 256"):
        bucket_frontends(CONFIG[fmt](256, 192, 8, 2, knobs={"tile_m": 16, "swap_ab": True}), 8)
    with pytest.raises(MoEEpConfigError, match="with swap_ab, tile_m must be one of"):
        bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 256, "swap_ab": True}), 8)
    with pytest.raises(MoEEpConfigError, match="needs two consumer warpgroups"):
        bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 64, "swap_ab": True, "swap_wg": 1}), 8)
    with pytest.raises(MoEEpConfigError, match="swap_wg must be 1, 2 or 4"):
        bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 16, "swap_ab": True, "swap_wg": 3}), 8)
    with pytest.raises(MoEEpConfigError, match="swap_atoms 1, 2 or 4"):  # checked without swap_ab too
        bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 64, "swap_atoms": 3}), 8)
    with pytest.raises(MoEEpConfigError, match="2 atoms per warpgroup needs two consumer warpgroups"):
        bucket_frontends(CONFIG[fmt](256, 128, 8, 2, knobs={"tile_m": 16, "swap_ab": True, "swap_wg": 1,
                                                            "swap_atoms": 2}), 8)  # fmt: skip


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
    """Every contract's decode and prefill kernels compile and export for sm_90a on this CPU machine; with
    cuobjdump (the test extras) none of them spills registers (``build --resources``)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    backend = CONFIG[fmt].kernel_name
    audit = ["--resources"] if kernel_resources.find_cuobjdump() else []
    assert cli_main(["build", "--backend", backend, "--contract", "all", "--cache", str(tmp_path), *audit]) == 0
    out = capsys.readouterr().out
    assert not audit or "resources: no kernel spills" in out
    keys = kernel_cache.entries(tmp_path)
    assert f"build: {len(keys)} kernel(s)" in out
    want = {fe.key.digest() for c in CONTRACTS.values() for fe in bucket_frontends(
        CONFIG[fmt](c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit),
        c.num_experts).values()}  # fmt: skip
    # every bucket of every contract that the bucket applies to (the GEMV buckets: H <= 2048); gpt-oss-120b
    # (H = 2880) and nemotron-relu2 (I = 1856) are not multiples of 128, so their buckets are their two
    # fallback kernels
    swap = [c for name, c in CONTRACTS.items() if name not in ("gpt-oss-120b", "nemotron-relu2")]
    per_contract = [sum(b.applies_to(fmt, c.hidden_size) for b in BUCKETS) for c in swap]
    assert len(keys) == len(want) == sum(per_contract) + 2 * len(FALLBACKS)
    gemvs = sum(b.max_hidden is not None for b in BUCKETS)  # gemv8k8, gemv8; gemv8r (MXFP8); gemv8k2, gemv8r2 (NVFP4)
    mine = sum(b.max_hidden is not None and b.applies_to(fmt, 2048) for b in BUCKETS)
    assert mine == (3 if fmt == "mxfp8" else 4)
    assert sorted(per_contract) == sorted(len(BUCKETS) - gemvs + mine * (c.hidden_size <= 2048) for c in swap)
    for name, c in CONTRACTS.items():
        cfg = CONFIG[fmt](c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit)
        for fe in bucket_frontends(cfg, c.num_experts).values():
            lib = kernel_cache.lookup(fe.key, tmp_path)
            assert lib is not None and b"__tvm_ffi_" in lib.read_bytes(), name


TINY = ("--contract", "tiny")  # build arguments of the tiny layer


def _swap_gemm_lib(cache: Path, knobs: str, fmt: str = "nvfp4", shape: tuple[str, ...] = TINY) -> Path:
    """The library of the tiny layer (or of ``shape``, build arguments) with ``knobs`` (JSON), built in a
    process of its own (cutlass takes the target arch at import)."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    cmd = [sys.executable, "-m", "flashinfer.moe_ep", "build", "--backend", CONFIG[fmt].kernel_name,
           *shape, "--knobs", knobs, "--cache", str(cache)]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (lib,) = cache.glob("*/*.so")
    return lib


def _pair_chain_gemv_sass(cache: Path, knob: str, value: bool, fmt: str) -> list[list[str]]:
    """The SASS of the tiny layer's two GEMVs (FC1, FC2) in the pair chain with the combine, ``knob`` set to
    ``value``."""
    pair = '"tile_m": 8, "swap_ab": true, "gemv": true, "fc2_early_weights": true, "pair_blocks": true'
    knobs = f'{{{pair}, "pair_combine": true, "{knob}": {json.dumps(value)}}}'
    sass = kernel_resources.kernel_sass(_swap_gemm_lib(cache / str(value), knobs, fmt))
    gemvs = [sass[name] for name in sass if "GemvDequant" in name]
    assert len(gemvs) == 2, list(sass)
    return gemvs


def _swap_gemm_sass(cache: Path, knobs: str, fmt: str = "nvfp4") -> list[list[str]]:
    """The SASS of the two swap-AB GEMMs of the tiny layer with ``knobs`` (JSON)."""
    sass = kernel_resources.kernel_sass(_swap_gemm_lib(cache, knobs, fmt))
    gemms = [name for name in sass if "SwapDequantGemm" in name]
    assert len(gemms) == 2, list(sass)
    return [sass[g] for g in gemms]


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
def test_swap_stagger_reaches_both_gemms_as_one_named_barrier(tmp_path: Path) -> None:
    """``swap_stagger`` > 0 on a CTA of two consumer warpgroups (the tiny contract with 2 atoms per
    warpgroup): each swap-AB GEMM's first warpgroup arrives at named barrier 3 once its lag is taken
    and the second one waits there; in lock step (0) neither GEMM has that barrier."""
    bars = {}
    for stagger in (0, 2):
        knobs = f'{{"tile_m": 16, "swap_ab": true, "swap_atoms": 2, "swap_stagger": {stagger}}}'
        # the opcodes (modifiers dropped) that name barrier 3, e.g. "@!P1 BAR.SYNC.DEFER_BLOCKING 0x3, 0x100"
        bars[stagger] = [
            sorted({m.group(1) for line in gemm if (m := re.search(r"\b(BAR\.[A-Z]+)[.A-Z_]*\s+0x3,", line))})
            for gemm in _swap_gemm_sass(tmp_path / str(stagger), knobs)
        ]
    assert bars[0] == [[], []]
    assert bars[2] == [["BAR.ARV", "BAR.SYNC"], ["BAR.ARV", "BAR.SYNC"]]


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tile_m", [16, 128])
def test_four_consumer_warpgroups_share_the_register_file(tmp_path: Path, fmt: str, tile_m: int) -> None:
    """``swap_wg=4`` (1 atom: the tiny layer's 256-row FC1 block over four warpgroups of 32 features,
    so the MXFP8 requantization amax spans four warps): 640 threads launch with at most 96 registers
    (20 warps x 96 x 32 fit the 64K file), the producer gives its warpgroup's back down to 24 and the
    four consumer warpgroups take 112 (``SWAP_WG_REGS``), with nothing spilled (stack frame and local
    memory 0), at the smallest and the largest token tile."""
    knobs = f'{{"tile_m": {tile_m}, "swap_ab": true, "swap_wg": 4, "swap_atoms": 1}}'
    lib = _swap_gemm_lib(tmp_path, knobs, fmt)
    gemms = [r for r in kernel_resources.kernel_resources(lib) if "SwapDequantGemm" in r.name]
    assert len(gemms) == 2 and all(r.registers <= 96 and r.spill_bytes == 0 for r in gemms), gemms
    for name, sass in kernel_resources.kernel_sass(lib).items():
        if "SwapDequantGemm" in name:
            ops = sorted(line.split("USETMAXREG.")[1].split()[0] + " " + line.split()[-1]
                         for line in sass if "USETMAXREG." in line)  # fmt: skip
            assert ops == ["DEALLOC.CTAPOOL 0x18", "TRY_ALLOC.CTAPOOL 0x70"], (name, ops)


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
def test_block_scaled_gemms_keep_a_wgmma_batch_in_flight(tmp_path: Path) -> None:
    """No block-scaled GEMM closes its WGMMA batches with an empty one (``sass.wgmma_batches``): the fallback
    GEMM (64-row tiles; drop v48 took its padding branch around the whole K loop), and the swap-AB GEMMs with
    ``swap_narrow`` (drop v49), where each of the widths 128, 64, 32 and 16 commits its own batch inside its
    branch; every K loop waits with one batch pending."""
    cases = (
        ('{"tile_m": 64, "fc1_tile_n": 128, "fc2_tile_n": 128}', "DequantGroupedGemm", None),
        ('{"tile_m": 128, "swap_ab": true, "swap_narrow": true}', "SwapDequantGemm", {128, 64, 32, 16}),
    )
    for i, (knobs, gemm, widths) in enumerate(cases):
        sass = kernel_resources.kernel_sass(_swap_gemm_lib(tmp_path / str(i), knobs))
        codes = [code for kernel, code in sass.items() if gemm in kernel]
        assert len(codes) == 2, list(sass)
        for code in codes:
            b = wgmma_batches(code)
            assert b["hgmma"] > 0 and b["empty"] == 0 and b["in_flight"] > 0, (knobs, b)
            if widths:
                found = {int(m.group(1)) for line in code if (m := re.search(r"\bHGMMA\.64x(\d+)x16\.F32", line))}
                assert found == widths, (knobs, found)


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
@pytest.mark.parametrize(("knobs", "per_group"), [
    ('{"tile_m": 128, "swap_ab": true, "swap_tma_store": true}', 1),  # 2 atoms: a warp's 32 features, one x4
    ('{"tile_m": 16, "swap_ab": true, "swap_tma_store": true}', 2),  # 4 atoms: 64 features, two x4
])  # fmt: skip
def test_swap_tma_store_stages_fc2_through_shared_memory(tmp_path: Path, knobs: str, per_group: int) -> None:
    """``swap_tma_store`` (drop v50): FC2's swap-AB epilogue writes each column group of 8 tokens with transposing
    ``stmatrix`` (one x4 per 4 groups of 8 features) into the warp's staging buffer and one TMA store, with no
    32-bit global store or shuffle left; FC1 (gated, register stores) keeps its shuffles and stores."""
    fc1, fc2 = _swap_gemm_sass(tmp_path, knobs)

    def count(code: list[str], pattern: str) -> int:
        return sum(1 for line in code if re.search(pattern, line))

    groups = json.loads(knobs)["tile_m"] // 8  # column groups of a tile (the epilogue is unrolled over them)
    assert count(fc2, r"\bUTMASTG\.2D\b") == groups
    assert count(fc2, r"\bSTSM\.16\.MT88\.4\b") == per_group * groups
    assert count(fc2, r"\bSTG\.") == 0 and count(fc2, r"\bSHFL\.BFLY") == 0
    assert count(fc1, r"\bSTG\.") > 0 and count(fc1, r"\bUTMASTG") == 0


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_l2_prefetch_requests_the_later_units(tmp_path: Path, fmt: str) -> None:
    """``gemv_l2_prefetch`` (drop v52) on the GEMV's pair chain: each GEMV issues bulk L2 prefetches (one of the
    weight rows and one of their scales per item, ``UBLKPF.L2``); FC1, the layer's first kernel, after its
    ``griddepcontrol.wait`` (``ACQBULK``: it learns its expert from ``topk_ids`` only then), FC2 (early weights)
    before it. Without the knob neither GEMV has one."""
    for on in (False, True):
        for i, code in enumerate(_pair_chain_gemv_sass(tmp_path, "gemv_l2_prefetch", on, fmt)):
            at = [j for j, line in enumerate(code) if re.search(r"\bUBLKPF\.L2\b", line)]
            wait = next(j for j, line in enumerate(code) if re.search(r"\bACQBULK\b", line))
            if not on:
                assert at == [], (fmt, i)
                continue
            assert len(at) == 2, (fmt, i, at)
            assert (min(at) > wait) if i == 0 else (max(at) < wait), (fmt, i, at, wait)


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_early_ring_copies_the_whole_ring_before_the_wait(tmp_path: Path, fmt: str) -> None:
    """``gemv_early_ring`` (drop v54) on the pair chain: before its ``griddepcontrol.wait`` (``ACQBULK``) FC2 issues
    both stages of its 2-deep ring's weight copies (a ``cp.async``, ``LDGSTS``, per weight row's data and per its
    scales: 16 a stage) instead of one; FC1 (no early weights) is the same kernel with and without the knob."""
    early, fc1 = [], []
    for on in (False, True):
        gemvs = _pair_chain_gemv_sass(tmp_path, "gemv_early_ring", on, fmt)
        wait = next(j for j, line in enumerate(gemvs[1]) if re.search(r"\bACQBULK\b", line))
        early.append(sum(1 for line in gemvs[1][:wait] if re.search(r"\bLDGSTS", line)))
        fc1.append(gemvs[0])
    assert early == [16, 32], (fmt, early)
    assert fc1[0] == fc1[1], fmt


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_row_tma_requests_the_row_before_the_weights(tmp_path: Path, fmt: str) -> None:
    """``gemv_row_tma`` (drop v57) on the pair chain: FC1 issues one bulk copy (``UBLKCP``) after its wait
    (``ACQBULK``) and before its first weight copy (``LDGSTS``), and waits for it on an mbarrier; without the knob it
    has neither; FC2 is the same kernel either way."""
    fc2 = []
    for on in (False, True):
        fc1, second = _pair_chain_gemv_sass(tmp_path, "gemv_row_tma", on, fmt)
        first = {op: next((j for j, line in enumerate(fc1) if re.search(rf"\b{op}", line)), None)
                 for op in ("ACQBULK", "UBLKCP", "LDGSTS", "SYNCS.PHASECHK")}  # fmt: skip
        if on:
            assert first["ACQBULK"] < first["UBLKCP"] < first["LDGSTS"] < first["SYNCS.PHASECHK"], (fmt, first)
        else:
            assert first["UBLKCP"] is None and first["SYNCS.PHASECHK"] is None, (fmt, first)
        fc2.append(second)
    assert fc2[0] == fc2[1], fmt


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_pair_cluster_combines_through_a_cluster_barrier(tmp_path: Path, fmt: str) -> None:
    """``gemv_pair_cluster`` (drop v56) on the pair chain: FC2 meets its cluster twice (an arrive and a wait at its
    start and after its slot stores: ``UCGABAR_ARV`` / ``UCGABAR_WAIT``) and counts nothing (no ``ATOM``); without
    the knob it has no cluster barrier and counts with one atomic; FC1 is the same kernel either way."""
    ops, fc1 = [], []
    barriers = ("UCGABAR_ARV", "UCGABAR_WAIT")
    for on in (False, True):
        gemvs = _pair_chain_gemv_sass(tmp_path, "gemv_pair_cluster", on, fmt)
        count = {op: sum(1 for line in gemvs[1] if re.search(rf"\b{op}\b", line)) for op in barriers}
        count["ATOM"] = sum(1 for line in gemvs[1] if re.search(r"\bATOMG?\.", line))
        ops.append(count)
        fc1.append(gemvs[0])
    assert ops[0] == {"UCGABAR_ARV": 0, "UCGABAR_WAIT": 0, "ATOM": 1}, (fmt, ops[0])
    assert ops[1] == {"UCGABAR_ARV": 2, "UCGABAR_WAIT": 2, "ATOM": 0}, (fmt, ops[1])
    assert fc1[0] == fc1[1], fmt


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
def test_nvfp4_quantization_divides_without_a_branch(tmp_path: Path) -> None:
    """NVFP4 quantizes the tokens (the gather) and requantizes FC1's output (its epilogue) with IEEE
    divisions by a reciprocal hoisted per block (``block_quant.div_by``, drop v32): no kernel of the
    layer has ``div.rn``'s range check (``FCHK``) or its call to the slow path (drop v31's FC1 had 96
    of each at 128-token tiles)."""
    lib = _swap_gemm_lib(tmp_path, '{"tile_m": 16, "swap_ab": true}')
    sass = kernel_resources.kernel_sass(lib)
    assert any("quant_gather" in name for name in sass), list(sass)
    for name, code in sass.items():
        assert not [line for line in code if re.search(r"\b(FCHK|CALL\.REL)", line)], name


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
def test_mxfp8_amax_exchange_serves_four_column_groups(tmp_path: Path) -> None:
    """MXFP8's gated FC1 with 2 atoms per warpgroup (128-token tiles) spreads a 32-feature block over
    two warps, which trade their partial amax through shared memory between two warpgroup barriers:
    once per 4 groups of 8 token columns (drop v32; v31: once per group), so 16 groups take 8 barrier
    waits (``BAR.SYNC`` of 128 threads); FC2 does not requantize and has none."""
    fc1, fc2 = _swap_gemm_sass(tmp_path, '{"tile_m": 128, "swap_ab": true}', "mxfp8")
    exchange = [sum(1 for line in gemm if re.search(r"\bBAR\.SYNC\S*\s+\S+, 0x80$", line)) for gemm in (fc1, fc2)]
    assert exchange == [2 * (128 // 8) // 4, 0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_in_fc1_sizes_the_token_rows(fmt: str) -> None:
    """``gather_in_fc1``: the workspace adds ``x_rows``, one prepared row per token of the capacity (one
    row without the knob, not read); before it the BF16 kernel's buffers, after it the split-K ones;
    the layer's buckets share it."""
    with_rows = make_frontend(CONFIG[fmt](256, 128, 8, 2), 8, {"tile_m": 16, "swap_ab": True, "gather_in_fc1": True})
    without = make_frontend(CONFIG[fmt](256, 128, 8, 2), 8, {"tile_m": 16, "swap_ab": True})
    bf16 = drop.Bf16Frontend(drop.Geometry(256, 128, 8, 2, "swiglu", None))
    for fe, rows in ((with_rows, 300), (without, 1)):
        spec = {s.name: s for s in fe.workspace_spec(300)}
        assert list(spec)[-3] == "x_rows" and (spec["x_rows"].shape, spec["x_rows"].dtype) == ((rows, 256), "bfloat16")
        assert list(spec)[:-3] == [s.name for s in bf16.workspace_spec(300)]  # then the split-K buffers
    assert with_rows.key.digest() != without.key.digest()
    views = drop.allocate_shared_workspace([with_rows, without], 300, torch.device("cpu"))
    assert views[0]["x_rows"].shape == (300, 256) and views[1]["x_rows"].shape == (1, 256)


@pytest.mark.parametrize("fmt", FORMATS)
def test_split_k_sizes_its_workspace_for_one_wave(fmt: str) -> None:
    """``swap_split_k``: the workspace adds the partial accumulators (one wave of work units of at most
    ``SWAP_MAX_CTA_ROWS`` rows x the token tile) and the part counters (per tile of one wave and consumer
    warpgroup), one element each without the knob; the counters start at zero (shared allocation)."""
    cfg = CONFIG[fmt](256, 128, 8, 2)
    split = make_frontend(cfg, 8, {"tile_m": 32, "swap_ab": True, "swap_split_k": 4})
    whole = make_frontend(cfg, 8, {"tile_m": 32, "swap_ab": True})
    assert kh.constants.SWAP_MAX_CTA_ROWS == 512
    for fe, partials, counters in ((split, 132 * 512 * 32, 66 * 4), (whole, 1, 1)):
        spec = {s.name: s for s in fe.workspace_spec(300)}
        assert list(spec)[-2:] == ["split_ws", "split_count"]
        assert (spec["split_ws"].shape, spec["split_ws"].dtype) == ((partials,), "float32")
        assert (spec["split_count"].shape, spec["split_count"].dtype) == ((counters,), "int32")
    assert split.key.digest() != whole.key.digest()
    views = drop.allocate_shared_workspace([split, whole], 300, torch.device("cpu"))
    assert int(views[0]["split_count"].abs().sum()) == 0
    with pytest.raises(MoEEpConfigError, match="swap_split_k is a world-size-1 knob"):
        make_frontend(CONFIG[fmt](256, 128, 16, 4, knobs={"tile_m": 16, "swap_ab": True, "swap_split_k": 2}), 8,
                      None, EpPlacement(2))  # fmt: skip


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
def test_split_k_counts_parts_with_one_atomic_per_gemm(tmp_path: Path) -> None:
    """``swap_split_k`` 2 on H = 2048, I = 256: FC1 (32 K tiles: parts of 16) counts its K parts with one
    global atomic (``ATOMG``) and reads the parts back with strong loads (``LDG.E.STRONG``: not from a
    stale L1), without spilling; FC2 (4 K tiles, under ``SWAP_SPLIT_MIN_K_TILES`` a part) has neither,
    nor has either GEMM without the knob."""
    assert kh.constants.SWAP_SPLIT_MIN_K_TILES == 16
    shape = ("--hidden", "2048", "--intermediate", "256", "--experts", "16", "--top-k", "4")
    ops = {}
    for split in (1, 2):
        knobs = f'{{"tile_m": 16, "swap_ab": true, "swap_split_k": {split}}}'
        lib = _swap_gemm_lib(tmp_path / str(split), knobs, shape=shape)
        gemms = [r for r in kernel_resources.kernel_resources(lib) if "SwapDequantGemm" in r.name]
        assert len(gemms) == 2 and all(r.spill_bytes == 0 for r in gemms), gemms
        ops[split] = [
            (sum(1 for line in sass if re.search(r"\bATOMG\b", line)), any("LDG.E.STRONG" in line for line in sass))
            for name, sass in kernel_resources.kernel_sass(lib).items()
            if "SwapDequantGemm" in name
        ]
    assert ops[1] == [(0, False), (0, False)]
    assert ops[2] == [(1, True), (0, False)]


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
@pytest.mark.parametrize("fmt", FORMATS)
def test_pair_chain_is_two_gemvs(tmp_path: Path, fmt: str) -> None:
    """``pair_blocks`` + ``pair_combine`` (drop v45): the layer is FC1 and FC2 alone (no routing, gather or
    combine kernel), FC1 quantizes its token row with shuffles for the block amax and one CTA barrier before
    its K loop, FC2 counts arrivals with one reply-awaited atomic (``ATOMG``) and FC1 has none; nothing
    spills. Without ``pair_combine`` the combine kernel follows."""
    pairs = json.dumps(PAIR_KNOBS)
    both = json.dumps({**PAIR_KNOBS, "pair_combine": True})
    lib = _swap_gemm_lib(tmp_path / "both", both, fmt)
    sass = kernel_resources.kernel_sass(lib)
    assert [k.split("#")[0] for k in sass] == ["GemvDequantSm90", "GemvDequantSm90"], list(sass)
    fc1, fc2 = sass.values()
    assert [sum(bool(re.search(r"\bATOMG\b", line)) for line in code) for code in (fc1, fc2)] == [0, 1]
    assert any("SHFL.BFLY" in line for line in fc1)
    assert all(r.spill_bytes == 0 for r in kernel_resources.kernel_resources(lib))
    names = list(kernel_resources.kernel_sass(_swap_gemm_lib(tmp_path / "pairs", pairs, fmt)))
    assert [k.split("#")[0] for k in names] == ["GemvDequantSm90", "GemvDequantSm90", "combine_kernel"], names


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_fused_is_one_kernel(tmp_path: Path, fmt: str) -> None:
    """``gemv_fused`` (drop v58): the layer is one kernel (no routing, gather, second GEMV or combine kernel) that
    copies nothing and lets no dependent launch before its wait for the kernel before it (``griddepcontrol.wait``),
    with the grid barrier's and the combine's reply-awaited atomics; one CTA an SM (``.minnctapersm 1``), so its nine
    warps hold what registers they need: nothing spills."""
    lib = _swap_gemm_lib(tmp_path, json.dumps(FUSED_KNOBS), fmt)
    sass = kernel_resources.kernel_sass(lib)
    assert [k.split("#")[0] for k in sass] == ["GemvFusedPairSm90"], list(sass)
    (code,) = sass.values()
    assert pdl_order(code, r"LDGSTS") == (0, False), pdl_order(code, r"LDGSTS")  # no copy, no trigger before the wait
    assert sum(bool(re.search(r"\bATOMG\b", line)) for line in code) >= 2
    (res,) = kernel_resources.kernel_resources(lib)
    assert res.spill_bytes == 0, res


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
def test_gather_in_fc1_loads_the_token_rows_with_cp_async(tmp_path: Path) -> None:
    """With ``gather_in_fc1`` the swap-AB FC1 loads its token columns with ``cp.async`` (``LDGSTS``: one per
    producer thread and K tile with 16-token tiles) and only the weight data and scales by TMA; FC2, and
    FC1 without the knob, load all three by TMA and have no ``LDGSTS``."""
    ops = {}
    for gather in (False, True):
        knobs = f'{{"tile_m": 16, "swap_ab": true, "gather_in_fc1": {str(gather).lower()}}}'
        ops[gather] = [
            tuple(sum(1 for line in gemm if re.search(rf"\b{op}\b", line)) for op in ("LDGSTS", "UTMALDG"))
            for gemm in _swap_gemm_sass(tmp_path / str(gather), knobs)
        ]
    assert ops[False] == [(0, 3), (0, 3)]
    assert ops[True] == [(1, 2), (0, 3)]


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
def test_early_weights_load_before_the_wait_for_the_kernel_before(tmp_path: Path) -> None:
    """Drop v34: with ``fc2_early_weights`` FC2 issues its weight data and scale loads (two TMA) before its
    ``griddepcontrol.wait`` and FC1 triggers its dependents after its own wait; ``fc1_early_weights`` does the
    same for FC1 behind the gather, which then triggers after its wait. Without them every kernel triggers
    first and loads after."""
    orders = {}
    for name, early in (("off", {}), ("fc2", {"fc2_early_weights": True}),
                        ("both", {"fc2_early_weights": True, "fc1_early_weights": True})):  # fmt: skip
        knobs = json.dumps({"tile_m": 16, "swap_ab": True, **early})
        sass = kernel_resources.kernel_sass(_swap_gemm_lib(tmp_path / name, knobs))
        orders[name] = [pdl_order(code) for kernel, code in sass.items() if "Gemm" in kernel or "gather" in kernel]
    assert orders["off"] == [(0, True), (0, True), (0, True)]  # gather, FC1, FC2
    assert orders["fc2"] == [(0, True), (0, False), (2, True)]
    assert orders["both"] == [(0, False), (2, False), (2, True)]


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
@pytest.mark.parametrize("prequantized", [False, True])
def test_gather_early_rows_reads_x_before_the_wait_for_the_routing(tmp_path: Path, prequantized: bool) -> None:
    """Drop v35: with ``gather_early_rows`` the activation gather loads its first items of ``x`` (``LDG``)
    before its ``griddepcontrol.wait``, and the routing kernel triggers its dependents after its own wait (so
    ``x`` is complete when the gather starts); without, the routing triggers first and the gather loads after."""
    shape = (*TINY, *(["--prequantized-input"] if prequantized else []))
    orders = {}
    for early in (False, True):
        knobs = json.dumps({"tile_m": 16, "swap_ab": True, "gather_early_rows": early})
        sass = kernel_resources.kernel_sass(_swap_gemm_lib(tmp_path / str(early), knobs, shape=shape))
        route = next(code for kernel, code in sass.items() if "route" in kernel)
        gather = next(code for kernel, code in sass.items() if "gather" in kernel)
        orders[early] = (pdl_order(route)[1], pdl_order(gather, r"\bLDG\b")[0] > 0)
    assert orders == {False: (True, False), True: (False, True)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_prequantized_input_is_a_kernel_variant(fmt: str) -> None:
    """``prequantized_input=True``: every bucket's kernel takes codes and scales (its own cache keys),
    the BF16 kernels refuse that input format, and the flag must be a bool."""
    plain = bucket_frontends(CONFIG[fmt](256, 128, 8, 2), 8)
    pre = bucket_frontends(CONFIG[fmt](256, 128, 8, 2, prequantized_input=True), 8)
    assert CONFIG[fmt](256, 128, 8, 2, prequantized_input=True).input_format == fmt
    assert CONFIG[fmt](256, 128, 8, 2).input_format == "bf16"
    for name in plain:
        assert pre[name].prequantized and not plain[name].prequantized
        assert pre[name].geometry.input_format == fmt
        assert pre[name].key.digest() != plain[name].key.digest()
    with pytest.raises(MoEEpConfigError, match="prequantized_input must be a bool"):
        CONFIG[fmt](256, 128, 8, 2, prequantized_input=1)
    g = drop.Geometry(256, 128, 8, 2, "swiglu", None, input_format=fmt)
    with pytest.raises(ValueError, match="takes hidden_states as bf16"):
        drop.Bf16Frontend(g).check()
    other = "nvfp4" if fmt == "mxfp8" else "mxfp8"
    with pytest.raises(ValueError, match=f"not '{other}'"):
        getattr(drop, FRONTENDS[fmt])(drop.Geometry(256, 128, 8, 2, "swiglu", None, input_format=other)).check()


# -- expert parallelism (world_size > 1) -------------------------------------------------------------
def test_ep_buckets_follow_the_global_tokens() -> None:
    """An EP forward's bucket is the world-size-1 rule at ``world_size * rows`` over the global experts
    (every bucket is reachable: none serves fewer tokens than a world of ranks forwards), without the
    split-K bucket (a world-size-1 knob: at world size > 1 it would repeat ``sparse16``) and the GEMV
    bucket (a world-size-1 kernel)."""
    gemv = ("gemv8k8", "gemv8", "gemv8k2", "gemv8r", "gemv8r2")
    split_free = [b.name for b in BUCKETS if b.name not in ("split16", *gemv)]
    assert [b.name for b in ep_buckets(2)] == [b.name for b in ep_buckets(1)] == split_free
    cases = ((0, 2, "sparse16"), (1, 2, "sparse16"), (4, 2, "sparse16"), (5, 2, "swap16"), (64, 2, "swap16"),
             (65, 2, "swap32"), (64, 4, "swap32"), (1000, 2, "swap128"))  # fmt: skip
    for rows, world, bucket in cases:
        assert ep_token_bucket(rows, world, 8, 128) == bucket, (rows, world)
        assert ep_token_bucket(rows, world, 8, 128) == token_bucket(max(2, world * rows), 8, 128)
    # NVFP4: sparse16 up to 1/8 pair per expert, of the global tokens too
    assert [ep_token_bucket(r, 2, 8, 128, "nvfp4") for r in (1, 2)] == ["sparse16", "swap16"]
    assert [token_bucket(t, 8, 128, "nvfp4") for t in (2, 4)] == ["sparse16", "swap16"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_ep_bucket_frontends_take_the_global_experts_and_the_layer_dispatch(fmt: str) -> None:
    cfg = CONFIG[fmt](256, 128, 16, 4, knobs={"dispatch": "push"})
    fronts = bucket_frontends(cfg, 8, EpPlacement(2, 2, "push"))
    assert list(fronts) == [b.name for b in ep_buckets(2)]
    for name, fe in fronts.items():
        assert isinstance(fe, drop.QuantEpFrontend) and fe.fmt == fmt
        assert fe.geometry.num_experts == 16 and fe.local_experts == 8
        assert not fe.knobs.gather_in_fc1  # a world-size-1 bucket knob: the EP dispatch moves prepared rows
        k = fe.knobs
        assert (k.world_size, k.ranks_per_gpu, k.dispatch, k.cluster_m, k.grid) == (2, 2, "push", 1, 66)
        assert k.tile_m == next(b for b in BUCKETS if b.name == name).knobs["tile_m"]
    assert len({fe.key.digest() for fe in fronts.values()}) == len(fronts)
    one = bucket_frontends(CONFIG[fmt](256, 128, 16, 4, knobs={"tile_m": 128}), 8, EpPlacement(2))
    assert len({id(fe) for fe in one.values()}) == 1 and next(iter(one.values())).knobs.dispatch == "pull"
    with pytest.raises(MoEEpConfigError, match="apply at world_size > 1 only"):
        bucket_frontends(cfg, 16)
    g = drop.Geometry(256, 128, 16, 4, "swiglu", None)
    ep_cls = getattr(drop, EP_FRONTENDS[fmt])
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        ep_cls(g, drop.QuantEpKnobs(tile_m=16, swap_ab=True, world_size=3)).check()
    with pytest.raises(ValueError, match="route at most"):
        ep_cls(drop.Geometry(256, 128, 2048, 4, "swiglu", None), drop.QuantEpKnobs(world_size=8)).check()
    with pytest.raises(MoEEpConfigError, match="dispatch must be one of"):
        make_frontend(CONFIG[fmt](256, 128, 16, 4), 8, None, EpPlacement(2, 1, "broadcast"))
    with pytest.raises(MoEEpConfigError, match="gather_in_fc1 is a world-size-1 knob"):
        make_frontend(CONFIG[fmt](256, 128, 16, 4, knobs={"tile_m": 16, "swap_ab": True, "gather_in_fc1": True}), 8,
                      None, EpPlacement(2))  # fmt: skip
    with pytest.raises(MoEEpConfigError, match="swap_tma_store is a world-size-1 knob"):
        make_frontend(CONFIG[fmt](256, 128, 16, 4, knobs={"tile_m": 16, "swap_ab": True, "swap_tma_store": True}), 8,
                      None, EpPlacement(2))  # fmt: skip
    for early in ("fc1_early_weights", "fc2_early_weights", "gather_early_rows"):
        with pytest.raises(MoEEpConfigError, match="are world-size-1 knobs"):
            make_frontend(CONFIG[fmt](256, 128, 16, 4, knobs={"tile_m": 16, "swap_ab": True, early: True}), 8, None,
                          EpPlacement(2))  # fmt: skip
    wire = CONFIG[fmt](256, 128, 16, 4, combine_dtype="mxfp8")  # the EP combine wire: no wire at world 1
    with pytest.raises(MoEEpConfigError, match="world-size-1 .* kernel has none"):
        bucket_frontends(wire, 16)
    assert {fe.geometry.combine_dtype for fe in bucket_frontends(wire, 8, EpPlacement(2)).values()} == {"mxfp8"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_ep_frontend_sizes_the_ep_buffers_per_token_tile(fmt: str) -> None:
    """The quantized EP frontend has the BF16 EP kernel's buffers (one protocol); its padded rows follow
    its token tile, and buckets of one layer share one rank state sized for all (``merge_specs``)."""
    fronts = bucket_frontends(CONFIG[fmt](256, 128, 16, 4), 8, EpPlacement(2, 2))
    bf16 = drop.Bf16EpFrontend(drop.Geometry(256, 128, 16, 4, "swiglu", None), drop.default_bf16_ep_knobs(
        drop.Geometry(256, 128, 16, 4, "swiglu", None), 2, 2, {"tile_m": 64, "cluster_m": 1}))  # fmt: skip
    small, large = fronts["swap16"], fronts["swap128"]
    assert [s.name for s in small.symmetric_specs(64)] == [s.name for s in bf16.symmetric_specs(64)]
    assert [s.name for s in small.workspace_spec(64)] == [s.name for s in bf16.workspace_spec(64)]
    a_buf = {s.name: s for s in large.symmetric_specs(64)}["a_buf"]
    assert a_buf.shape[0] >= {s.name: s for s in small.symmetric_specs(64)}["a_buf"].shape[0]
    merged = drop.merge_specs([fe.symmetric_specs(64) for fe in fronts.values()])
    assert {s.name: s for s in merged}["a_buf"].shape == a_buf.shape


def test_quant_ep_rank_state_launches_with_the_exported_argument_order(monkeypatch) -> None:
    """``EpRankState.launch`` passes the frontend's operands, ``out``, the live count, the state and the
    timeout: the exported signature of ``Sm90MegaMoEQuantEpKernel`` (``kh.QUANT_EP_KERNEL_CALL``)."""
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm

    fe = bucket_frontends(CONFIG["nvfp4"](256, 128, 16, 4), 8, EpPlacement(2, 2))["swap16"]
    group = kh.LoopbackGroup(2, torch.device("cpu"))
    states = [drop.EpRankState(fe, comm.make_provider("loopback", 2, r, torch.device("cpu"), group), r, 32,
                               torch.device("cpu")) for r in range(2)]  # fmt: skip
    state = states[0]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # no CUDA event on the CPU
    seen: list = []
    operands = tuple(torch.zeros(1) for _ in range(11))
    out = torch.zeros(5, 256)
    state.launch(lambda *args: seen.extend(args), operands, out, 123)
    names = [n for n in kh.QUANT_EP_KERNEL_CALL if n != "stream"]
    assert len(seen) == len(names)
    by_name = dict(zip(names, seen, strict=True))
    assert by_name["out"] is out and by_name["timeout_ns"] == 123 and by_name["rank"] == 0
    assert int(by_name["live_tokens"][0]) == 5  # every row live by default
    assert by_name["x_sym"] is state.host.buffers["x_sym"] and by_name["abort"] is state.abort
    with pytest.raises(TypeError, match="launches through its rank state"):
        fe.launch()
    seen.clear()
    with pytest.raises(ValueError, match="allocated for at most 32 tokens, got T=33"):
        state.launch(lambda *args: seen.extend(args), operands, torch.zeros(33, 256), 123)
    assert not seen  # nothing launched
    for s in states:
        s.release()


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
def test_quant_ep_kernels_compile_and_export_for_sm90a(tmp_path: Path) -> None:
    """EP variants export for sm_90a here: MXFP8 swap-AB 16-token tiles with pull dispatch, NVFP4 from
    codes and scales with 128-row tiles, push dispatch and the mxfp8 combine wire, BF16 with that wire."""
    from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import tuning

    mx = bucket_frontends(CONFIG["mxfp8"](256, 128, 16, 4), 8, EpPlacement(2, 2))["swap16"]
    nv_cfg = CONFIG["nvfp4"](256, 128, 16, 4, knobs={"tile_m": 128, "dispatch": "push"}, prequantized_input=True,
                             combine_dtype="mxfp8")  # fmt: skip
    nv = make_frontend(nv_cfg, 8, None, EpPlacement(2, 2, "push"))
    bf16_wire = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(256, 128, 16, 4, combine_dtype="mxfp8")
    geometry = tuning.make_geometry(bf16_wire, 16)
    bf16 = drop.Bf16EpFrontend(geometry, drop.default_bf16_ep_knobs(geometry, 2, 2, bucket="decode"))
    assert nv.geometry.combine_dtype == bf16.geometry.combine_dtype == "mxfp8"
    for fe in (mx, nv, bf16):
        lib = fe.build(tmp_path)
        assert lib.stat().st_size > 10_000 and f"__tvm_ffi_{fe.key.function_name}".encode() in lib.read_bytes()


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
def test_build_at_world_size_2_builds_the_ep_kernels(tmp_path: Path, monkeypatch) -> None:
    """``build --world-size 2`` builds what an NVSHMEM layer of each backend loads (the EP kernels,
    one GPU per rank), for BF16 (every bucket of the default capacity, one dispatch) and MXFP8."""
    from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import ep_tuning, tuning

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("FLASHINFER_MOE_EP_KNOB_CACHE", str(tmp_path / "knobs.json"))  # no recorded knobs
    shape = ["--hidden", "256", "--intermediate", "128", "--experts", "8", "--top-k", "4", "--world-size", "2"]
    mx = CONFIG["mxfp8"](256, 128, 16, 4)
    bf16 = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(256, 128, 16, 4)
    geometry = tuning.make_geometry(bf16, 16)
    buckets = ep_tuning.ep_buckets(2, 16384)
    bf16_fronts = ep_tuning.bucket_frontends(geometry, 2, 1, buckets, {b.name: {} for b in buckets})
    want = {fe.key.digest() for fe in [*bucket_frontends(mx, 8, EpPlacement(2)).values(), *bf16_fronts.values()]}
    for backend in ("sm90_bf16_bf16_bf16_cutedsl", mx.kernel_name):
        assert cli_main(["build", "--backend", backend, *shape, "--cache", str(tmp_path)]) == 0
    keys = kernel_cache.entries(tmp_path)
    assert len(keys) == len(want) and {k["kernel"] for k in keys} == {"moe_bf16_ep", "moe_mxfp8_ep"}
    assert all(k["knobs"]["world_size"] == 2 and k["knobs"]["ranks_per_gpu"] == 1 for k in keys)
    for fe in [*bucket_frontends(mx, 8, EpPlacement(2)).values()]:
        assert kernel_cache.lookup(fe.key, tmp_path) is not None


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
def test_the_build_command_of_a_cache_miss_builds_that_kernel(tmp_path: Path, monkeypatch) -> None:
    """The command a cache miss prints (``KernelFrontend.build_command``) builds exactly the missing
    kernel: world size 1 (block-scaled and BF16), an EP kernel with pre-quantized inputs and the mxfp8
    wire, a BF16 EP kernel of a bucket whose dispatch the layer pinned."""
    import shlex

    from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import ep_tuning, tuning

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("FLASHINFER_MOE_EP_KNOB_CACHE", "off")
    world1 = bucket_frontends(CONFIG["nvfp4"](256, 128, 16, 4), 16)["swap32"]
    cfg = CONFIG["mxfp8"](256, 128, 16, 4, prequantized_input=True, combine_dtype="mxfp8", knobs={"dispatch": "push"})
    ep = bucket_frontends(cfg, 8, EpPlacement(2, 1, "push"))["swap64"]
    bf16_cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(256, 128, 16, 4)
    g = tuning.make_geometry(bf16_cfg, 16)
    buckets = ep_tuning.ep_buckets(2, 4096)
    bf16 = ep_tuning.bucket_frontends(g, 2, 1, buckets, {b.name: {} for b in buckets})["decode"]
    assert bf16.knobs.dispatch == "push"  # the prefill bucket's, pinned
    bf16_world1 = tuning.layer_profiles(bf16_cfg, 16, 64, tuning.tune_context_named("x", 1)).primary
    for fe in (world1, ep, bf16, bf16_world1):
        cmd = fe.build_command()
        assert kernel_cache.lookup(fe.key, tmp_path) is None
        args = shlex.split(cmd.split("python -m flashinfer.moe_ep ", 1)[1])
        assert cli_main([*args, "--cache", str(tmp_path)]) == 0, cmd
        assert kernel_cache.lookup(fe.key, tmp_path) is not None, cmd
