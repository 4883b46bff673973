"""The SM90 MXFP8 and NVFP4 backends on the GPU against the format-aware reference (marked ``gpu``).

Every case: fresh random inputs, output poisoned with NaN, compared with
``core.reference_quant.moe_reference_quantized`` on the same quantized weights (NVFP4 with the same
static activation global scales): every element within ``MAX_UNITS`` format units (``format_units``)
and, from ``MEAN_GATE_T`` tokens on, mean relative error < 1 % (over |ref| > 1e-2 max|ref|); the max
relative error and the share of bit-equal outputs are printed. A second run is bitwise equal.

Why the mean is gated only over enough tokens: one requantization flip of the FC1 output (an
element on an E2M1 rounding boundary, decided differently after fp32 sums of another order or the
hardware exp/reciprocal of the activation) moves one E2M1 step of one activation, which changes that
token's whole output row by ~3-4 % relative (measured: NVFP4 swiglu_oai, T=1, mean 4.1 %, 0.03
units). Over 128+ tokens such flips are rare enough for the mean; the units gate holds everywhere.

Format units: the kernel and the reference requantize the FC1 output after fp32 sums of different
order, so an element on a rounding boundary may land one quantization step apart (an E4M3 step is
2^-3 relative, an E2M1 step up to a whole unit of the block scale), and the bf16 outputs round
after that. ``format_units`` measures ``|out - ref| / (u (|ref| + S))`` with ``S`` the term scale of
the reference and ``u`` = 2^-4 (MXFP8) or 2^-2 (NVFP4): half a step. A wrong scale, block, expert
or row is tens to thousands of units.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.backends.mega.kernel.sm90.block_scaled import BUCKETS
from flashinfer.moe_ep.core.contracts import CONTRACTS
from flashinfer.moe_ep.core.inputs import make_expert_weights, make_hidden_states, relative_errors
from flashinfer.moe_ep.core.quant import quantize_mxfp8, quantize_nvfp4
from flashinfer.moe_ep.core.reference_quant import moe_reference_quantized, nvfp4_static_scales, quantize_expert_weights

from . import graph_replay
from .layer_inputs import fresh_inputs

pytestmark = pytest.mark.gpu

MAX_T = 4096
FUSED_GRID = 132  # QuantKnobs.num_sms: gemv_fused's CTAs
MAX_UNITS = 4.0
MEAN_GATE_T = 128
UNIT = {"mxfp8": 2.0**-4, "nvfp4": 2.0**-2}
SMALL = {"hidden_size": 256, "intermediate_size": 128, "num_experts": 16, "top_k": 4}
SPLIT = {"num_experts": 16, "top_k": 4}  # with H and I long enough for split-K parts of 16 K tiles
ACTIVATIONS = [
    ("swiglu", None),
    ("swiglu", 4.0),
    ("swiglu_oai", None),
    ("geglu", None),
    ("reglu", None),
    ("relu2", None),
]
FORMATS = ("mxfp8", "nvfp4")
# SMALL (16 experts, top 4): T = 1 sparse16, then by pairs per expert (T / 4): 7 swap16, 60 swap32, 128
# swap64, 300 and 2000 swap128 (the fallback geometry: 64-row tiles to 128, then 128-row tiles)
TOKENS = (1, 7, 60, 128, 300, 2000)
ROUTINGS = ("uniform", "skewed", "empty")
CONFIG_CLS = {
    "mxfp8": moe.Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
    "nvfp4": moe.Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
}


def _config(fmt: str, geometry: dict, **scales: float):
    return CONFIG_CLS[fmt](**geometry, **scales)


GEMV_KNOBS = {
    "tile_m": 8,
    "swap_ab": True,
    "gemv": True,
    "fc1_early_weights": True,
    "fc2_early_weights": True,
    "gather_early_rows": True,
}
#: the GEMV's pair chain without its combine (``QuantKnobs.pair_blocks``): FC1 is the layer's first kernel, so
#: no early FC1 weights and no gather to start early
PAIR_KNOBS = {"tile_m": 8, "swap_ab": True, "gemv": True, "fc2_early_weights": True, "pair_blocks": True}
_Q30 = CONTRACTS["qwen3-30b-a3b"]
#: the pair chain in one persistent launch (``QuantKnobs.gemv_fused``, drop v58): CTAs of 8 warps, 4-deep rings
FUSED_KNOBS = {**PAIR_KNOBS, "pair_combine": True, "fc2_early_weights": False, "gemv_k_warps": 8, "gemv_stages": 4,
               "gemv_fused": True}  # fmt: skip
#: the qwen3-30b-a3b layer's geometry (its decode buckets: the GEMVs' pair chain)
QWEN3_30B = {"hidden_size": _Q30.hidden_size, "intermediate_size": _Q30.intermediate_size,
             "num_experts": _Q30.num_experts, "top_k": _Q30.top_k, "activation": _Q30.activation,
             "activation_limit": _Q30.activation_limit}  # fmt: skip
#: (name, fmt, geometry) of every variant these tests run; the GPU session script prebuilds them
#: (the NVFP4 scales are runtime tensors: they do not change the compiled kernel).
GPU_VARIANTS = [
    (f"{fmt}-small-{act}{'' if lim is None else f'-limit{lim:g}'}", fmt,
     {**SMALL, "activation": act, "activation_limit": lim})
    for fmt in FORMATS for act, lim in ACTIVATIONS
] + [
    (f"{fmt}-qwen3-30b-a3b", fmt, QWEN3_30B) for fmt in FORMATS
] + [
    # decode tiles: 64 MMA rows, the second consumer warpgroup converting only
    (f"{fmt}-small-swiglu-m64", fmt, {**SMALL, "activation": "swiglu", "activation_limit": None,
                                      "knobs": {"tile_m": 64, "fc1_tile_n": 128, "fc2_tile_n": 128}})
    for fmt in FORMATS
] + [
    # 128-row tiles (shared-memory dequantization) at every T
    (f"{fmt}-small-swiglu-m128", fmt, {**SMALL, "activation": "swiglu", "activation_limit": None,
                                       "knobs": {"tile_m": 128}})
    for fmt in FORMATS
] + [
    # I = 192: 2I = 384 rows are not whole 256-row gate/up blocks, so the default buckets fall back to
    # the 64 and 128-row kernels
    (f"{fmt}-small-swiglu-i192", fmt, {**SMALL, "intermediate_size": 192, "activation": "swiglu",
                                       "activation_limit": None})
    for fmt in FORMATS
] + [
    # the swap-AB GEMMs at every T, with the token tile the format's swap bucket does not use
    (f"{fmt}-small-swiglu-swap", fmt, {**SMALL, "activation": "swiglu", "activation_limit": None,
                                       "knobs": {"tile_m": 16 if fmt == "mxfp8" else 32, "swap_ab": True}})
    for fmt in FORMATS
] + [
    # swap-AB with one consumer warpgroup per CTA where two would fit (FC1 512 rows, H 512)
    (f"{fmt}-small512-swiglu-wg1", fmt, {**SMALL, "hidden_size": 512, "intermediate_size": 256,
                                         "activation": "swiglu", "activation_limit": None,
                                         "knobs": {"tile_m": 32, "swap_ab": True, "swap_wg": 1}})
    for fmt in FORMATS
] + [
    # wide swap-AB token tiles (2 atoms per warpgroup): gated FC1 over two 256-row blocks (MXFP8: the
    # requantization amax across two warps), and a non-gated FC1 with one warpgroup per CTA
    (f"{fmt}-small512-swiglu-swap{tok}", fmt, {**SMALL, "hidden_size": 512, "intermediate_size": 256,
                                               "activation": "swiglu", "activation_limit": None,
                                               "knobs": {"tile_m": tok, "swap_ab": True}})
    for fmt in FORMATS for tok in (64, 128)
] + [
    # narrower WGMMAs for tiles of few real tokens (swap_narrow, drop v49): every width class below the
    # token tile is reached over TOKENS and the routings (T = 60: 15 pairs per expert, 16 columns; 128:
    # 32; 300: 75, the whole 128-token tile; 2000: full tiles plus each expert's remainder); gathered
    # token rows at 128, the TMA-loaded ones at 64, and a non-gated FC1
    (f"{fmt}-small512-swiglu-swap{tok}-narrow", fmt,
     {**SMALL, "hidden_size": 512, "intermediate_size": 256, "activation": "swiglu", "activation_limit": None,
      "knobs": {"tile_m": tok, "swap_ab": True, "swap_narrow": True, "gather_in_fc1": tok == 128}})
    for fmt in FORMATS for tok in (64, 128)
] + [
    (f"{fmt}-small-relu2-swap128-narrow", fmt, {**SMALL, "activation": "relu2", "activation_limit": None,
                                                "knobs": {"tile_m": 128, "swap_ab": True, "swap_narrow": True}})
    for fmt in FORMATS
] + [
    (f"{fmt}-small-relu2-swap64", fmt, {**SMALL, "activation": "relu2", "activation_limit": None,
                                        "knobs": {"tile_m": 64, "swap_ab": True}})
    for fmt in FORMATS
] + [
    # four consumer warpgroups per swap-AB CTA (112 registers each). 2 atoms: a gated FC1 over two
    # 256-row blocks; 1 atom: one 256-row block over the four warpgroups (32 features each, so the
    # MXFP8 requantization amax spans four warps), with 128-token tiles gathering their token rows;
    # and a non-gated FC1 (relu2, 256 rows) of 1-atom warpgroups
    (f"{fmt}-small512-swiglu-wg4", fmt, {**SMALL, "hidden_size": 512, "intermediate_size": 256,
                                         "activation": "swiglu", "activation_limit": None,
                                         "knobs": {"tile_m": 16, "swap_ab": True, "swap_wg": 4, "swap_atoms": 2}})
    for fmt in FORMATS
] + [
    (f"{fmt}-small-swiglu-wg4a1", fmt, {**SMALL, "activation": "swiglu", "activation_limit": None,
                                        "knobs": {"tile_m": 128, "swap_ab": True, "swap_wg": 4, "swap_atoms": 1,
                                                  "gather_in_fc1": True}})
    for fmt in FORMATS
] + [
    (f"{fmt}-small-relu2-i256-wg4a1", fmt, {**SMALL, "intermediate_size": 256, "activation": "relu2",
                                            "activation_limit": None,
                                            "knobs": {"tile_m": 32, "swap_ab": True, "swap_wg": 4, "swap_atoms": 1}})
    for fmt in FORMATS
] + [
    # split K (swap_split_k): each CTA tile's K parts (of 16 K tiles at least) on CTAs of their own where
    # they fit one wave of the grid (T = 1 to 128 here), the last part summing them; whole tiles where
    # they do not (T = 300, 2000: the same kernel). Two staggered warpgroups, FC1 and FC2 in 2 parts;
    # four warpgroups, FC1 in 4 parts and FC2 in 2 (split_k 4: the most that keep 16 K tiles); gathered
    # token rows (relu2), FC1 in 4 parts and FC2 (16 K tiles) whole
    (f"{fmt}-split2", fmt, {**SPLIT, "hidden_size": 2048, "intermediate_size": 2048, "activation": "swiglu",
                            "activation_limit": None,
                            "knobs": {"tile_m": 16, "swap_ab": True, "swap_stagger": 4, "swap_split_k": 2}})
    for fmt in FORMATS
] + [
    (f"{fmt}-split4-wg4", fmt, {**SPLIT, "hidden_size": 4096, "intermediate_size": 2048, "activation": "swiglu",
                                "activation_limit": None,
                                "knobs": {"tile_m": 16, "swap_ab": True, "swap_wg": 4, "swap_atoms": 2,
                                          "swap_split_k": 4}})
    for fmt in FORMATS
] + [
    (f"{fmt}-split4-relu2-gather", fmt, {**SPLIT, "hidden_size": 4096, "intermediate_size": 1024,
                                         "activation": "relu2", "activation_limit": None,
                                         "knobs": {"tile_m": 32, "swap_ab": True, "gather_in_fc1": True,
                                                   "swap_split_k": 4}})
    for fmt in FORMATS
] + [
    # FC2's epilogue through shared memory and TMA stores (swap_tma_store, drop v50): a warp's 64 features (4 atoms,
    # 16-token tiles: two stmatrix.x4 per column group, 128-byte rows), 32 (2 atoms, 128-token tiles with gathered
    # rows and narrow WGMMAs: one x4, 64-byte rows), and split K (the last part stores). Four 1-atom warpgroups (16
    # features a warp: one x2, 32-byte rows) failed here on the H200 (session 38) and are refused since
    # (test_quant.py, test_config_validation)
    (f"{fmt}-small512-swiglu-swap{tok}-tma", fmt,
     {**SMALL, "hidden_size": 512, "intermediate_size": 256, "activation": "swiglu", "activation_limit": None,
      "knobs": {"tile_m": tok, "swap_ab": True, "swap_tma_store": True, "gather_in_fc1": tok == 128,
                "swap_narrow": tok == 128}})
    for fmt in FORMATS for tok in (16, 128)
] + [
    (f"{fmt}-split2-tma", fmt, {**SPLIT, "hidden_size": 2048, "intermediate_size": 2048, "activation": "swiglu",
                                "activation_limit": None,
                                "knobs": {"tile_m": 16, "swap_ab": True, "swap_stagger": 4, "swap_split_k": 2,
                                          "swap_tma_store": True}})
    for fmt in FORMATS
] + [
    # the expert GEMV (gemv: weights streamed into registers, mma.sync) at every T and activation, with
    # its early loads; K split over 8 warps per CTA (H = 256: more warps than K units, so some add
    # zeros), and over 2 warps with several K units each (the loop after the early unit)
    (f"{fmt}-small-{act}{'' if lim is None else f'-limit{lim:g}'}-gemv", fmt,
     {**SMALL, "activation": act, "activation_limit": lim, "knobs": GEMV_KNOBS})
    for fmt in FORMATS for act, lim in ACTIVATIONS
] + [
    (f"{fmt}-small1024-swiglu-gemv-k2", fmt, {**SMALL, "hidden_size": 1024, "intermediate_size": 512,
                                              "activation": "swiglu", "activation_limit": None,
                                              "knobs": {**GEMV_KNOBS, "gemv_k_warps": 2}})
    for fmt in FORMATS
] + [
    # activations given as codes and block scales (every default bucket)
    (f"{fmt}-preq-swiglu", fmt, {**SMALL, "activation": "swiglu", "activation_limit": None,
                                 "prequantized_input": True})
    for fmt in FORMATS
] + [
    # the GEMV with codes and block scales: the pair chain's twin (built for test_pair_chain_gives_the_gemvs_bits)
    (f"{fmt}-preq-swiglu-gemv", fmt, {**SMALL, "activation": "swiglu", "activation_limit": None,
                                      "prequantized_input": True, "knobs": GEMV_KNOBS})
    for fmt in FORMATS
] + [
    # the GEMV's pair chain (drop v45): FC1 prepares its token's row, FC2 combines ("-combine"); every
    # activation with the combine, swiglu also without it (the combine kernel), codes and scales in, and
    # qwen3-30b-a3b (its T = 1 bucket's GEMV). Token capacity: T * top_k <= num_experts (``capacity``).
    (f"{fmt}-small-{act}{'' if lim is None else f'-limit{lim:g}'}-pairs-combine", fmt,
     {**SMALL, "activation": act, "activation_limit": lim, "knobs": {**PAIR_KNOBS, "pair_combine": True}})
    for fmt in FORMATS for act, lim in ACTIVATIONS
] + [
    (f"{fmt}-small-swiglu-pairs", fmt, {**SMALL, "activation": "swiglu", "activation_limit": None,
                                        "knobs": PAIR_KNOBS})
    for fmt in FORMATS
] + [
    (f"{fmt}-preq-swiglu-pairs-combine", fmt, {**SMALL, "activation": "swiglu", "activation_limit": None,
                                               "prequantized_input": True,
                                               "knobs": {**PAIR_KNOBS, "pair_combine": True}})
    for fmt in FORMATS
] + [
    (f"{fmt}-qwen3-30b-a3b-pairs-combine", fmt, {**QWEN3_30B, "knobs": {**PAIR_KNOBS, "pair_combine": True}})
    for fmt in FORMATS
] + [
    # the GEMVs' bulk L2 prefetches (gemv_l2_prefetch, drop v52): the pair chain of qwen3-30b-a3b (FC1 after its
    # wait, FC2 before it) and the routed GEMV with 2 K warps (8 and more K units a warp: the prefetch loop)
    (f"{fmt}-qwen3-30b-a3b-pairs-combine-l2pf", fmt, {**QWEN3_30B, "knobs": {**PAIR_KNOBS, "pair_combine": True,
                                                                           "gemv_l2_prefetch": True}})
    for fmt in FORMATS
] + [
    (f"{fmt}-small1024-swiglu-gemv-k2-l2pf", fmt, {**SMALL, "hidden_size": 1024, "intermediate_size": 512,
                                                   "activation": "swiglu", "activation_limit": None,
                                                   "knobs": {**GEMV_KNOBS, "gemv_k_warps": 2,
                                                             "gemv_l2_prefetch": True}})
    for fmt in FORMATS
] + [
    # FC1's own GEMV warp count (gemv_fc1_k_warps, drop v53): the qwen3-30b-a3b pair chain with FC1 over 8 warps
    # (FC2 keeps 4), and the routed GEMV with FC1 over 8 warps and FC2 over 2 (H 1024: one or two K units a warp)
    (f"{fmt}-qwen3-30b-a3b-pairs-combine-fc1k8", fmt, {**QWEN3_30B, "knobs": {**PAIR_KNOBS, "pair_combine": True,
                                                                            "gemv_fc1_k_warps": 8}})
    for fmt in FORMATS
] + [
    (f"{fmt}-small1024-swiglu-gemv-fc1k8-k2", fmt, {**SMALL, "hidden_size": 1024, "intermediate_size": 512,
                                                     "activation": "swiglu", "activation_limit": None,
                                                     "knobs": {**GEMV_KNOBS, "gemv_k_warps": 2,
                                                               "gemv_fc1_k_warps": 8}})
    for fmt in FORMATS
] + [
    # MXFP8's gemv8k8 (session 41): FC2 over 8 warps as well
    ("mxfp8-qwen3-30b-a3b-pairs-combine-fc1k8-k8", "mxfp8",
     {**QWEN3_30B, "knobs": {**PAIR_KNOBS, "pair_combine": True, "gemv_fc1_k_warps": 8, "gemv_k_warps": 8}}),
] + [
    # FC2 copying its whole ring's weights before its wait (gemv_early_ring, drop v54): gemv8k8's knobs (MXFP8's FC2
    # over 8 warps: 1-2 K units a warp; NVFP4's over 4: 1-2) and a 1024-wide layer with 2 K warps and a 3-stage
    # ring (FC2's 4-8 units a warp: three before the wait, the rest in the loop)
    (f"{fmt}-qwen3-30b-a3b-pairs-combine-fc1k8{'-k8' if fmt == 'mxfp8' else ''}-ring", fmt,
     {**QWEN3_30B, "knobs": {**PAIR_KNOBS, "pair_combine": True, "gemv_fc1_k_warps": 8,
                             "gemv_k_warps": 8 if fmt == "mxfp8" else 4, "gemv_early_ring": True}})
    for fmt in FORMATS
] + [
    # gemv8's knobs with it (MXFP8's gemv8 since session 42: T = 2 4-5 % faster on the H200, 2 % on the H100)
    ("mxfp8-qwen3-30b-a3b-pairs-combine-ring", "mxfp8",
     {**QWEN3_30B, "knobs": {**PAIR_KNOBS, "pair_combine": True, "gemv_early_ring": True}}),
] + [
    (f"{fmt}-small1024-swiglu-pairs-combine-k2s3-ring", fmt,
     {**SMALL, "hidden_size": 1024, "intermediate_size": 512, "activation": "swiglu", "activation_limit": None,
      "knobs": {**PAIR_KNOBS, "pair_combine": True, "gemv_k_warps": 2, "gemv_stages": 3, "gemv_early_ring": True}})
    for fmt in FORMATS
] + [
    # MXFP8's gemv8r bucket (session 42: the routed GEMV, FC1 over 8 warps, FC2's early ring) at every T of a
    # 1024-wide layer (FC2's 8 K units: two a warp, both copied before the wait)
    ("mxfp8-small1024-swiglu-gemv-fc1k8-ring", "mxfp8",
     {**SMALL, "hidden_size": 1024, "intermediate_size": 512, "activation": "swiglu", "activation_limit": None,
      "knobs": next(b for b in BUCKETS if b.name == "gemv8r").knobs_for("mxfp8")}),
] + [
    # NVFP4's gemv8 with FC2 over 2 GEMV warps, FC1 keeping 4 (session 43: FC2's 512 CTAs at T = 2 then fit one wave):
    # FC2's 6 K units three a warp, through a 2-deep ring, and through the bucket's own 3-deep one (its knobs, BUCKETS;
    # FC1 loading its row, as before drop v57: the bucket's own kernel is the -gemv8-rowtma variant below)
    ("nvfp4-qwen3-30b-a3b-pairs-combine-fc2k2", "nvfp4",
     {**QWEN3_30B, "knobs": {**PAIR_KNOBS, "pair_combine": True, "gemv_k_warps": 2, "gemv_fc1_k_warps": 4}}),
    ("nvfp4-qwen3-30b-a3b-pairs-combine-fc2k2-s3", "nvfp4",
     {**QWEN3_30B, "knobs": {**next(b for b in BUCKETS if b.name == "gemv8").knobs_for("nvfp4"),
                             "gemv_row_tma": False}}),
    # MXFP8's gemv8r with FC2 over 2 warps on the 1024-wide layer (FC2's 8 K units: four a warp)
    ("mxfp8-small1024-swiglu-gemv-fc1k8-ring-fc2k2", "mxfp8",
     {**SMALL, "hidden_size": 1024, "intermediate_size": 512, "activation": "swiglu", "activation_limit": None,
      "knobs": {**next(b for b in BUCKETS if b.name == "gemv8r").knobs_for("mxfp8"), "gemv_k_warps": 2}}),
] + [
    # FC2's pairs combined in a cluster of top_k CTAs (gemv_pair_cluster, drop v56): the small layer (clusters of 4),
    # gemv8k8's and gemv8's knobs on qwen3-30b-a3b (clusters of 8) with FC1 loading its row as before drop v57 (the
    # buckets' own kernels, with the row's bulk copy, are the -rowtma variants below)
    (f"{fmt}-small-swiglu-pairs-combine-cluster", fmt,
     {**SMALL, "activation": "swiglu", "activation_limit": None,
      "knobs": {**PAIR_KNOBS, "pair_combine": True, "gemv_pair_cluster": True}})
    for fmt in FORMATS
] + [
    (f"{fmt}-qwen3-30b-a3b-pairs-combine-{bucket}-cluster", fmt,
     {**QWEN3_30B, "knobs": {**next(b for b in BUCKETS if b.name == bucket).knobs_for(fmt), "gemv_pair_cluster": True,
                             "gemv_row_tma": False}})
    for fmt in FORMATS for bucket in ("gemv8k8", "gemv8")
] + [
    # FC1's token row by one bulk copy (gemv_row_tma, drop v57): the small layers (H = 256 / 1024: one / four items a
    # warp) and gemv8k8's and gemv8's knobs on qwen3-30b-a3b (since session 47 the buckets' own kernels)
    (f"{fmt}-small-{act}-pairs-combine-rowtma", fmt,
     {**SMALL, "activation": act, "activation_limit": lim,
      "knobs": {**PAIR_KNOBS, "pair_combine": True, "gemv_row_tma": True}})
    for fmt in FORMATS for act, lim in (ACTIVATIONS[0], ACTIVATIONS[-1])
] + [
    (f"{fmt}-small1024-swiglu-pairs-combine-k2-rowtma", fmt,
     {**SMALL, "hidden_size": 1024, "intermediate_size": 512, "activation": "swiglu", "activation_limit": None,
      "knobs": {**PAIR_KNOBS, "pair_combine": True, "gemv_k_warps": 2, "gemv_row_tma": True}})
    for fmt in FORMATS
] + [
    (f"{fmt}-qwen3-30b-a3b-pairs-combine-{bucket}-rowtma", fmt,
     {**QWEN3_30B, "knobs": {**next(b for b in BUCKETS if b.name == bucket).knobs_for(fmt), "gemv_row_tma": True}})
    for fmt in FORMATS for bucket in ("gemv8k8", "gemv8")
] + [
    # NVFP4's gemv8k2 (session 51, qwen3-30b-a3b T = 3): the pair chain over 2 GEMV warps in FC1 and FC2, 2-deep
    # rings (FC1's 16 K units eight a warp, FC2's 6 three a warp), the bucket's own kernel
    ("nvfp4-qwen3-30b-a3b-pairs-combine-gemv8k2-rowtma", "nvfp4",
     {**QWEN3_30B, "knobs": next(b for b in BUCKETS if b.name == "gemv8k2").knobs_for("nvfp4")}),
    # NVFP4's gemv8r2 (session 51, qwen3-30b-a3b T = 7-9): the routed GEMV with FC1 over 4 GEMV warps, FC2 over 2 and
    # its early ring (FC2's 6 K units three a warp, two of them copied before its wait), the bucket's own kernel
    ("nvfp4-qwen3-30b-a3b-gemv8r2", "nvfp4",
     {**QWEN3_30B, "knobs": next(b for b in BUCKETS if b.name == "gemv8r2").knobs_for("nvfp4")}),
] + [
    # the pair chain in one launch (gemv_fused, drop v58): qwen3-30b-a3b (FC1 3072 / 6144 items at T = 1, a CTA's range
    # cutting units at both ends), the small layers (fewer items than CTAs: CTAs of no items), gated and relu2, and a
    # 1024-wide layer over 4 warps with 2-deep rings
    (f"{fmt}-qwen3-30b-a3b-fused", fmt, {**QWEN3_30B, "knobs": FUSED_KNOBS}) for fmt in FORMATS
] + [
    (f"{fmt}-small-{act}-fused", fmt, {**SMALL, "activation": act, "activation_limit": lim, "knobs": FUSED_KNOBS})
    for fmt in FORMATS for act, lim in (ACTIVATIONS[0], ACTIVATIONS[-1])
] + [
    (f"{fmt}-small1024-swiglu-fused-k4s2", fmt,
     {**SMALL, "hidden_size": 1024, "intermediate_size": 512, "activation": "swiglu", "activation_limit": None,
      "knobs": {**FUSED_KNOBS, "gemv_k_warps": 4, "gemv_stages": 2}})
    for fmt in FORMATS
]  # fmt: skip
FUSED_VARIANTS = [v[0] for v in GPU_VARIANTS if "-fused" in v[0]]


def capacity(name: str) -> int:
    """The token capacity of a test variant's layer: the pair chain's ``T * top_k <= num_experts`` (``gemv_fused``:
    and ``<= num_sms``), else MAX_T."""
    geometry = next(v[2] for v in GPU_VARIANTS if v[0] == name)
    if "-fused" in name:
        return min(geometry["num_experts"], FUSED_GRID) // geometry["top_k"]
    if "-pairs" in name:
        return geometry["num_experts"] // geometry["top_k"]
    return MAX_T


_layers: dict[str, tuple] = {}


def calibrated_scales(fmt: str, geometry: dict, q, x: torch.Tensor) -> dict[str, float]:
    """NVFP4 static activation global scales from a calibration batch; MXFP8 has none."""
    if fmt != "nvfp4":
        return {}
    gs1, gs2 = nvfp4_static_scales(x, q, geometry["activation"], geometry["activation_limit"])
    return {"input_global_scale": gs1, "fc2_input_global_scale": gs2}


def _layer(name: str):
    if name not in _layers:
        _, fmt, geometry = next(v for v in GPU_VARIANTS if v[0] == name)
        g = torch.Generator().manual_seed(len(_layers) + 23)
        w13, w2 = make_expert_weights(geometry["num_experts"], geometry["hidden_size"], geometry["intermediate_size"],
                                      geometry["activation"], generator=g, device="cuda")  # fmt: skip
        q = quantize_expert_weights(w13, w2, fmt)
        calib = make_hidden_states(256, geometry["hidden_size"], generator=g, device="cuda")
        scales = calibrated_scales(fmt, geometry, q, calib)
        cfg = _config(fmt, geometry, **scales)
        layer = _layer_of(cfg, q, capacity(name))
        _layers[name] = (layer, cfg, q, scales)
    return _layers[name]


def _layer_of(cfg, q, max_tokens: int = MAX_T) -> moe.MoEEpLayer:
    """A warmed-up layer of ``cfg`` on the quantized weights ``q``."""
    layer = moe.MoEEpLayer(
        moe.BootstrapConfig(device="cuda"),
        moe.FleetParams(cfg.num_experts, max_tokens, cfg.hidden_size),
        moe.MoEWeightPack(q.w13, q.w2, q.w13_scale, q.w2_scale, q.w13_global_scale, q.w2_global_scale),
        backend=moe.MegaConfig(cfg),
    )
    layer.warmup()
    return layer


def format_units(out: torch.Tensor, ref: torch.Tensor, term_scale: torch.Tensor, fmt: str) -> float:
    if out.numel() == 0:
        return 0.0
    o, r, s = out.double(), ref.double(), term_scale.double()
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return ((o - r).abs() / (UNIT[fmt] * (r.abs() + s)).clamp_min(1e-30)).max().item()


def _check(name: str, inp, ref_x=None) -> None:
    """``ref_x``: the reference's input when it is not ``inp.hidden_states`` (pre-quantized: the tuple
    of codes, scales and, for NVFP4, the global scale, which then replaces ``input_global_scale``)."""
    layer, cfg, q, scales = _layer(name)
    t = inp.topk_ids.shape[0]
    out = torch.full((t, cfg.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
    layer.forward(inp, output=out)
    if ref_x is not None:
        scales = {k: v for k, v in scales.items() if k != "input_global_scale"}
    ref, term = moe_reference_quantized(inp.hidden_states if ref_x is None else ref_x, inp.topk_ids,
                                        inp.topk_weights, q, cfg.activation, cfg.activation_limit,
                                        fmt=cfg.weight_format, return_term_scale=True, **scales)  # fmt: skip
    assert not bool(out.isnan().any()), "some output rows were never written"
    mean_err, max_err = relative_errors(out, ref)
    units = format_units(out, ref, term, cfg.weight_format)
    exact = (out == ref).float().mean().item()
    print(f"{name} T={t}: mean rel {mean_err:.2e}, max rel {max_err:.2e}, {units:.2f} units, {exact:.1%} bit-equal")
    assert units <= MAX_UNITS, (mean_err, max_err, units)
    assert t < MEAN_GATE_T or mean_err < 1e-2, (mean_err, max_err, units)
    again = torch.full_like(out, float("nan"))
    layer.forward(inp, output=again)
    assert torch.equal(out, again), "two runs on the same inputs differ"


@pytest.mark.parametrize(
    "variant",
    [v for v, _, _ in GPU_VARIANTS if ("-small" in v or "-split" in v) and not ("-pairs" in v or "-fused" in v)],
)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_small_every_activation(variant: str, routing: str) -> None:
    for i, t in enumerate(TOKENS):
        _check(
            variant, fresh_inputs(_layer(variant)[1], t, routing, seed=zlib.crc32(f"{variant}/{routing}/{i}".encode()))
        )


@pytest.mark.parametrize("fmt", FORMATS)
# 2: gemv8; 3: NVFP4's gemv8k2; 5, 12: MXFP8's gemv8r, NVFP4's swap16; 8: NVFP4's gemv8r2
@pytest.mark.parametrize("t", [1, 2, 3, 5, 8, 12, 128, 1000, MAX_T])
def test_qwen3_30b(fmt: str, t: int) -> None:
    name = f"{fmt}-qwen3-30b-a3b"
    _check(name, fresh_inputs(_layer(name)[1], t, "uniform" if t % 2 else "skewed", seed=t))


def _prequantized(cfg, x: torch.Tensor, rule: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(codes, scales, reference input) of ``x``'s shape: ``rule`` "ocp" quantizes ``x`` with
    ``core.quant`` (the kernel's own rule), "random" draws arbitrary valid codes and scales, which the
    kernel's rule would not choose (so a requantization would change them)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    t, h = x.shape
    gs = torch.tensor(getattr(cfg, "input_global_scale", 1.0), dtype=torch.float32, device="cuda")
    if cfg.weight_format == "mxfp8":
        if rule == "ocp":
            codes, sc = quantize_mxfp8(x)
        else:
            b = torch.randint(0, 256, (t, h), generator=g, device="cuda", dtype=torch.int32)
            b = torch.where((b & 0x7F) == 0x7F, b - 1, b)  # no NaN codes
            codes = b.to(torch.uint8).view(torch.float8_e4m3fn)
            sc = torch.randint(118, 130, (t, h // 32), generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)
        return codes, sc, (codes, sc)
    if rule == "ocp":
        packed, bs, _ = quantize_nvfp4(x, gs)
    else:
        packed = torch.randint(0, 256, (t, h // 2), generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)
        mag = torch.rand((t, h // 16), generator=g, device="cuda") * 8 + 0.05
        bs = mag.to(torch.float8_e4m3fn)
    return packed, bs, (packed, bs, gs)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", ["ocp", "random"])
def test_prequantized_activations(fmt: str, rule: str) -> None:
    """Codes and block scales in, against the reference on the same codes (no requantization of the
    input); with codes of the kernel's own rule also bit-equal to the layer fed the bf16 originals."""
    name = f"{fmt}-preq-swiglu"
    layer, cfg, q, _ = _layer(name)
    plain = None
    if rule == "ocp":  # the same weights, bf16 activations quantized by the kernel
        plain = moe.MoEEpLayer(
            moe.BootstrapConfig(device="cuda"),
            moe.FleetParams(cfg.num_experts, MAX_T, cfg.hidden_size),
            moe.MoEWeightPack(q.w13, q.w2, q.w13_scale, q.w2_scale, q.w13_global_scale, q.w2_global_scale),
            backend=moe.MegaConfig(dataclasses.replace(cfg, prequantized_input=False)),
        )
    for i, t in enumerate((0, *TOKENS)):
        inp = fresh_inputs(cfg, t, "skewed" if i % 2 else "uniform", seed=zlib.crc32(f"{name}/{rule}/{t}".encode()))
        codes, sc, ref_x = _prequantized(cfg, inp.hidden_states, rule, seed=t)
        pre = moe.MoEEpTensors(codes, inp.topk_ids, inp.topk_weights, scales=sc)
        if t == 0:
            assert layer.forward(pre).shape == (0, cfg.hidden_size)
            continue
        _check(name, pre, ref_x)
        if plain is not None:
            assert torch.equal(layer.forward(pre), plain.forward(inp)), t
    if plain is not None:
        plain.destroy()
    with pytest.raises(moe.MoEEpInputError, match="pre-quantized"):
        layer.forward(fresh_inputs(cfg, 4, "uniform", seed=1))  # bf16 hidden_states without scales


@pytest.mark.parametrize("routing", ROUTINGS)
def test_nvfp4_routed_gemv_bucket(routing: str) -> None:
    """NVFP4's ``gemv8r2`` kernel (session 51) on qwen3-30b-a3b at the T it serves (7-9) and either side of them, in
    every routing: against the reference (``_check``: poisoned output, format units, a second run bitwise equal)."""
    name = "nvfp4-qwen3-30b-a3b-gemv8r2"
    for t in (1, 6, 7, 8, 9, 40):
        _check(name, fresh_inputs(_layer(name)[1], t, routing, seed=zlib.crc32(f"{name}/{routing}/{t}".encode())))


@pytest.mark.parametrize("variant", [f"nvfp4-small-{act}" for act, lim in ACTIVATIONS if lim is None])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_small_nvfp4_two_tokens(variant: str, routing: str) -> None:
    """On the small layers (16 experts, top_k 4) T = 2 is half a pair per expert, which NVFP4's ``gemv8r2`` serves,
    with more GEMV warps than K units there (FC1's 2 units over 4 warps, FC2's 1 over 2): against the reference."""
    layer, cfg, _, _ = _layer(variant)
    assert layer._backend._bucket(2) == "gemv8r2"
    _check(variant, fresh_inputs(cfg, 2, routing, seed=zlib.crc32(f"{variant}/{routing}/2".encode())))


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_tokens(fmt: str) -> None:
    layer, cfg, _, _ = _layer(f"{fmt}-small-swiglu")
    assert layer.forward(fresh_inputs(cfg, 0, "uniform", 0)).shape == (0, cfg.hidden_size)


@pytest.mark.parametrize("fmt", FORMATS)
# qwen3-30b-a3b: gemv8k8, gemv8, gemv8k2 / gemv8r (T = 3), gemv8r2 / gemv8r (T = 8; NVFP4 / MXFP8), swap16, swap128
@pytest.mark.parametrize("t", [1, 2, 3, 8, 100, 800])
def test_cuda_graph_replay_equals_eager(fmt: str, t: int) -> None:
    _graph_replay_equals_eager(f"{fmt}-qwen3-30b-a3b", t)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t", [1, 3])
def test_gemv_graph_replay_equals_eager(fmt: str, t: int) -> None:
    """The GEMV at every T of a small layer: graph replays equal the eager call."""
    _graph_replay_equals_eager(f"{fmt}-small-swiglu-gemv", t)


SPLIT_VARIANTS = [v[0] for v in GPU_VARIANTS if "-split" in v[0]]


@pytest.mark.parametrize("variant", SPLIT_VARIANTS)
@pytest.mark.parametrize("t", [1, 7, 300])  # split (4 or 2 parts), split, whole tiles
def test_split_k_graph_replay_and_counters(variant: str, t: int) -> None:
    """Graph replays of the split-K GEMMs equal eager runs, and every call leaves the part counters
    at zero (the next call's last part is then found again)."""
    _graph_replay_equals_eager(variant, t)
    layer = _layer(variant)[0]
    for bucket, ws in layer._backend.workspace.items():
        assert ws["split_count"].numel() > 1, bucket
        assert int(ws["split_count"].abs().sum()) == 0, bucket


PAIR_VARIANTS = [v[0] for v in GPU_VARIANTS if "-pairs" in v[0]]


def _pair_inputs(cfg, name: str, t: int, routing: str, tag: str):
    """Fresh inputs of the pair chain's tests: bf16 activations, or for a pre-quantized variant their codes
    of the kernel's own rule (``_prequantized`` "ocp") with the reference's input."""
    inp = fresh_inputs(cfg, t, routing, seed=zlib.crc32(f"{name}/{tag}/{routing}/{t}".encode()))
    if not cfg.prequantized_input:
        return inp, None
    codes, sc, ref_x = _prequantized(cfg, inp.hidden_states, "ocp", seed=t)
    return moe.MoEEpTensors(codes, inp.topk_ids, inp.topk_weights, scales=sc), ref_x


@pytest.mark.parametrize("variant", PAIR_VARIANTS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_pair_chain(variant: str, routing: str) -> None:
    """The GEMV's pair chain (``pair_blocks``, drop v45: no routing, no gather; ``-combine``: no combine kernel)
    at every T its layer takes (T = 0 too), uniform, one hot expert and empty experts: against the
    reference (``_check``: poisoned output, format units, a second run bitwise equal); the arrival counters
    are zero after every call; a graph replay equals eager; a launch past the token limit raises before
    anything runs."""
    layer, cfg, _, _ = _layer(variant)
    assert all(fe.knobs.pair_blocks for fe in layer._backend.frontends.values())
    cap = capacity(variant)
    for t in sorted({0, 1, 2, cap // 2, cap}):
        inp, ref_x = _pair_inputs(cfg, variant, t, routing, "check")
        if t == 0:
            assert layer.forward(inp).shape == (0, cfg.hidden_size)
            continue
        _check(variant, inp, ref_x)
    for bucket, ws in layer._backend.workspace.items():
        extra = ws["expert_count"][cfg.num_experts + 1 :]
        assert extra.numel() == (cap * (cfg.hidden_size // 64) if "-combine" in variant else 0), bucket
        assert not ws["expert_count"].any(), bucket
    if routing == "uniform" and not cfg.prequantized_input:
        _graph_replay_equals_eager(variant, 1)
        _refused_past_capacity(variant, cap, "pair_blocks")


def _refused_past_capacity(variant: str, cap: int, knob: str) -> None:
    """A launch of ``cap + 1`` tokens on the variant's layer raises (``knob`` serves at most ...) before anything runs:
    its NaN-poisoned output is untouched."""
    layer, cfg, _, _ = _layer(variant)
    be = layer._backend
    fe, ws = next(iter(be.frontends.values())), next(iter(be.workspace.values()))
    inp = fresh_inputs(cfg, cap + 1, "uniform", seed=5)
    out = torch.full((cap + 1, cfg.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=f"{knob} serves at most"):
        fe.launch(inp.hidden_states, be.no_scales, inp.topk_ids, inp.topk_weights, be.weights, be.act_gscale, out, ws)
    assert bool(out.isnan().all()), "a refused launch wrote its output"


@pytest.mark.parametrize("variant", FUSED_VARIANTS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_fused_pair_chain(variant: str, routing: str) -> None:
    """The pair chain in one persistent launch (``gemv_fused``, drop v58) at every T its layer takes (T = 0 too),
    uniform, one hot expert and empty experts: against the reference (``_check``: poisoned output, format units, a
    second run bitwise equal); the combine counters, the partials' flags and the grid barrier's count are zero after
    every call; a graph replay equals eager; a launch past its token limit raises before anything runs."""
    layer, cfg, _, _ = _layer(variant)
    assert all(fe.knobs.gemv_fused for fe in layer._backend.frontends.values())
    cap = capacity(variant)
    for t in sorted({0, 1, 2, 3, cap // 2, cap}):
        inp, ref_x = _pair_inputs(cfg, variant, t, routing, "fused")
        if t == 0:
            assert layer.forward(inp).shape == (0, cfg.hidden_size)
            continue
        _check(variant, inp, ref_x)
        for bucket, ws in layer._backend.workspace.items():
            assert not ws["expert_count"].any(), bucket
            assert not ws["split_count"][: FUSED_GRID + 1].any(), bucket  # flags, barrier count (not its generation)
    if routing == "uniform":
        _graph_replay_equals_eager(variant, 1)
        _graph_replay_equals_eager(variant, cap)
        _refused_past_capacity(variant, cap, "gemv_fused")


def routed_gemv_twin(knobs: dict) -> dict:
    """A pair-chain variant's routed GEMV twin: ``GEMV_KNOBS`` with the variant's GEMV warps and ring depth (they
    set how K is split and summed)."""
    same = ("gemv_k_warps", "gemv_fc1_k_warps", "gemv_stages")
    return {**GEMV_KNOBS, **{k: knobs[k] for k in same if k in knobs}}


@pytest.mark.parametrize("variant", PAIR_VARIANTS)
def test_pair_chain_gives_the_gemvs_bits(variant: str) -> None:
    """The pair chain against the routed GEMV chain (``routed_gemv_twin``: routing, gather, the same two GEMVs,
    combine) on the same weights and inputs: FC1's token row is the gather's (the same functions), the
    GEMVs multiply and sum the same way, FC2's combine is the combine kernel's FMA chain, so the outputs
    are bitwise equal at every T the pair layer takes, in every routing."""
    layer, cfg, q, _ = _layer(variant)
    twin = _layer_of(dataclasses.replace(cfg, knobs=routed_gemv_twin(cfg.knobs)), q)
    assert all(fe.knobs.gemv and not fe.knobs.pair_blocks for fe in twin._backend.frontends.values())
    cap = capacity(variant)
    for routing in ROUTINGS:
        for t in sorted({1, 2, cap // 2, cap}):
            inp, _ = _pair_inputs(cfg, variant, t, routing, "twin")
            mine = layer.forward(inp).clone()
            theirs = twin.forward(inp).clone()
            assert not mine.isnan().any(), (routing, t)
            assert torch.equal(mine, theirs), (routing, t, (mine.float() - theirs.float()).abs().max().item())
    twin.destroy()


TMA_VARIANTS = [v[0] for v in GPU_VARIANTS if v[0].endswith("-tma")]


def register_store_twin(knobs: dict) -> dict:
    """A ``-tma`` variant's knobs with FC2's register stores (``swap_tma_store`` off): its bitwise twin's."""
    return {**knobs, "swap_tma_store": False}


@pytest.mark.parametrize("variant", TMA_VARIANTS)
def test_tma_store_gives_the_register_stores_bits(variant: str) -> None:
    """``swap_tma_store`` changes only how FC2's epilogue writes its bf16 values (staged in shared memory, one
    TMA store per column group, instead of 32-bit stores from registers); the values are rounded alike, so the
    layer's outputs are bitwise equal to the register stores' at every T and routing."""
    layer, cfg, q, _ = _layer(variant)
    twin = _layer_of(dataclasses.replace(cfg, knobs=register_store_twin(cfg.knobs)), q)
    assert not any(fe.knobs.swap_tma_store for fe in twin._backend.frontends.values())
    _assert_twin_bits(layer, twin, cfg, f"{variant}/twin", TOKENS)
    twin.destroy()


def _assert_twin_bits(layer, twin, cfg, tag: str, tokens) -> None:
    """``layer`` (output poisoned first) and ``twin`` give bitwise-equal outputs on fresh inputs at each of
    ``tokens`` in every routing (the seeds from ``tag``)."""
    for routing in ROUTINGS:
        for i, t in enumerate(tokens):
            inp = fresh_inputs(cfg, t, routing, seed=zlib.crc32(f"{tag}/{routing}/{i}".encode()))
            mine = torch.full((t, cfg.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
            layer.forward(inp, output=mine)
            theirs = twin.forward(inp).clone()
            assert not mine.isnan().any(), (routing, t)
            assert torch.equal(mine, theirs), (routing, t, (mine.float() - theirs.float()).abs().max().item())


L2PF_VARIANTS = [v[0] for v in GPU_VARIANTS if v[0].endswith("-l2pf")]


def without_l2_prefetch(knobs: dict) -> dict:
    """An ``-l2pf`` variant's knobs without the GEMVs' L2 prefetches: its bitwise twin's."""
    return {**knobs, "gemv_l2_prefetch": False}


@pytest.mark.parametrize("variant", L2PF_VARIANTS)
def test_l2_prefetch_gives_the_same_bits(variant: str) -> None:
    """``gemv_l2_prefetch`` changes only where the GEMVs' weight bytes come from (L2 after a bulk prefetch),
    not what they compute: the layer's outputs are bitwise equal to the same knobs' without it at every T
    the layer takes and in every routing."""
    layer, cfg, q, _ = _layer(variant)
    cap = capacity(variant)
    twin = _layer_of(dataclasses.replace(cfg, knobs=without_l2_prefetch(cfg.knobs)), q, cap)
    assert not any(fe.knobs.gemv_l2_prefetch for fe in twin._backend.frontends.values())
    assert all(fe.knobs.gemv_l2_prefetch for fe in layer._backend.frontends.values())
    _assert_twin_bits(layer, twin, cfg, f"{variant}/l2pf", sorted({1, 2, 7, cap // 2, cap} & set(range(1, cap + 1))))
    twin.destroy()


def _graph_replay_equals_eager(name: str, t: int) -> None:
    layer, cfg, _, _ = _layer(name)
    captured = graph_replay.capture(layer, fresh_inputs(cfg, t, "uniform", seed=5), cfg.hidden_size)
    for seed in (6, 7):
        assert graph_replay.replay_equals_eager(layer, captured, fresh_inputs(cfg, t, "skewed", seed=seed))


@pytest.mark.parametrize("fmt", FORMATS)
def test_layers_of_one_geometry_share_one_workspace(fmt: str) -> None:
    name = f"{fmt}-small-swiglu"
    layer, cfg, q, _ = _layer(name)
    other = moe.MoEEpLayer(
        moe.BootstrapConfig(device="cuda"),
        moe.FleetParams(cfg.num_experts, MAX_T, cfg.hidden_size),
        moe.MoEWeightPack(q.w13, q.w2, q.w13_scale, q.w2_scale, q.w13_global_scale, q.w2_global_scale),
        backend=moe.MegaConfig(cfg),
    )
    for bucket in layer._backend.workspace:
        mine, theirs = layer._backend.workspace[bucket], other._backend.workspace[bucket]
        assert all(mine[k].data_ptr() == theirs[k].data_ptr() for k in mine), bucket
    other.destroy()  # releases its reference only: the first layer keeps working
    _check(name, fresh_inputs(cfg, 300, "uniform", seed=11))


@pytest.mark.parametrize("fmt", FORMATS)
def test_unquantized_weights_are_quantized_at_preprocessing(fmt: str) -> None:
    """A pack of BF16 weights without scales gives the same output bits as the pack quantized
    beforehand with ``quantize_expert_weights`` (the backend quantizes it once, the same way)."""
    g = torch.Generator().manual_seed(31)
    geometry = {**SMALL, "activation": "swiglu", "activation_limit": None}
    w13, w2 = make_expert_weights(SMALL["num_experts"], SMALL["hidden_size"], SMALL["intermediate_size"], "swiglu",
                                  generator=g, device="cuda")  # fmt: skip
    q = quantize_expert_weights(w13, w2, fmt)
    calib = make_hidden_states(256, SMALL["hidden_size"], generator=g, device="cuda")
    scales = calibrated_scales(fmt, geometry, q, calib)
    cfg = _config(fmt, geometry, **scales)
    packs = [
        moe.MoEWeightPack(q.w13, q.w2, q.w13_scale, q.w2_scale, q.w13_global_scale, q.w2_global_scale),
        moe.MoEWeightPack(w13, w2),
    ]
    inp = fresh_inputs(cfg, 64, "uniform", seed=32)
    outs = []
    for pack in packs:
        fleet = moe.FleetParams(cfg.num_experts, 64, cfg.hidden_size)
        layer = moe.MoEEpLayer(moe.BootstrapConfig(device="cuda"), fleet, pack, backend=moe.MegaConfig(cfg))
        outs.append(layer.forward(inp))
        layer.destroy()
    assert not bool(outs[0].isnan().any()) and torch.equal(outs[0], outs[1])
