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
