"""Compile-time constants of the drop."""

from __future__ import annotations

# Activation names understood by the kernels and the drop's reference.
ACT_SWIGLU = "swiglu"  # silu(g) * u; with a clamp limit L: g = min(g, L), u = clamp(u, -L, L)
ACT_SWIGLU_OAI = "swiglu_oai"  # gpt-oss: (clamp(u) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit)
ACT_GEGLU = "geglu"  # gelu_tanh(g) * u
ACT_REGLU = "reglu"  # relu(g) * u
ACT_RELU2 = "relu2"  # non-gated: relu(h) ** 2, FC1 has I rows
ACTIVATIONS = (ACT_SWIGLU, ACT_SWIGLU_OAI, ACT_GEGLU, ACT_REGLU, ACT_RELU2)
GATED_ACTIVATIONS = (ACT_SWIGLU, ACT_SWIGLU_OAI, ACT_GEGLU, ACT_REGLU)

SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0

# H200: 132 SMs. Persistent grids are sized from this (a compile-time knob of the kernel).
DEFAULT_NUM_SMS = 132
# Threads of the single routing CTA; it also bounds the number of experts (one expert per thread
# in the prefix sum).
ROUTING_THREADS = 1024
MAX_EXPERTS = ROUTING_THREADS
# WGMMA K block per pipeline stage for bf16 (4 x k16 instructions).
TILE_K = 64
# Elements per 16-byte vector of bf16.
BF16_PER_16B = 8

# Block-scaled weight formats of the quantized kernel (moe_quant_glu).
FMT_MXFP8 = "mxfp8"  # E4M3 elements, UE8M0 scale per 32
FMT_NVFP4 = "nvfp4"  # E2M1 elements (2 per byte), E4M3 scale per 16, fp32 global scale per tensor
QUANT_FORMATS = (FMT_MXFP8, FMT_NVFP4)
QUANT_BLOCK = {FMT_MXFP8: 32, FMT_NVFP4: 16}
# Bytes of one packed weight row per K tile (TILE_K elements): the data, its scales, zero padding
# to a multiple of 16 (one TMA box carries a tile's data and scales).
QUANT_DATA_BYTES = {FMT_MXFP8: TILE_K, FMT_NVFP4: TILE_K // 2}
QUANT_ROW_BYTES = {FMT_MXFP8: 80, FMT_NVFP4: 48}
