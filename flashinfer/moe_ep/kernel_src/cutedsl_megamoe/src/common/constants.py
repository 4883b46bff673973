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
# Packed weights (``moe_quant_glu.weights``): per (expert, K tile of TILE_K, row) the row's data bytes
# and, in a separate tensor, its raw block-scale bytes. Data rows are split into 16-byte segments
# whose bytes are reordered so one 32-bit word holds what one lane of a WGMMA fragment needs, and
# whose slots are XOR-swizzled by row so 8 consecutive rows hit 8 different bank groups.
QUANT_DATA_BYTES = {FMT_MXFP8: TILE_K, FMT_NVFP4: TILE_K // 2}
QUANT_SCALES_PER_TILE = {FMT_MXFP8: TILE_K // 32, FMT_NVFP4: TILE_K // 16}
QUANT_SEGMENT_BYTES = 16
# NVFP4 data words: the 32 bits of every 32-bit word (its 8 nibbles: element pair j = byte j of the
# reordered segment) are stored permuted, so that the kernels reach BF16 pair j (element 2j at bits
# 15, 8..6, element 2j + 1 at bits 31, 24..22: ``value * 2**-126`` each) from the stored word W in
# one to four instructions: the OR of the terms (op, amount, mask) of pair j, ``op`` being a left
# shift, a logical right shift or a left rotation of W (``common.host_utils.e2m1_word_sources``
# derives the stored layout from this table; ``src.block_quant.e2m1x8_to_bf16x8`` runs it).
E2M1_BF16_MASK = 0x81C081C0
# NVFP4 weight block scales as the packing stores them: byte b > 0 is the BF16 multiplier
# ``scale * 2**112`` with bits ``(b << 4) + NVFP4_SCALE_BIAS`` (5 exponent bits counted from 2**102, the
# 3 mantissa bits of E4M3; every positive E4M3 value, subnormals included, has one), b = 0 a zero
# scale, whose block's codes the packing zeroes too.
NVFP4_SCALE_BIAS = 229 << 7
E2M1_PAIR_TERMS = (
    (("shl", 0, E2M1_BF16_MASK),),
    (("shl", 4, E2M1_BF16_MASK),),
    (("rotl", 10, E2M1_BF16_MASK),),
    (("shl", 6, 0x80C080C0), ("shr", 2, 0x01000100)),
)
# Token tiles (WGMMA N) of the swap-AB kernel (``moe_quant_glu.swap_gemm``).
SWAP_TOKEN_TILES = (16, 32, 64, 128)
# Rows of one gate/up block of a gated w13 as the swap-AB kernel reads it (gate rows, then up rows).
SWAP_GATE_UP_BLOCK = 256
# Weight rows per row warp of the block-scaled GEMV (``moe_quant_glu.gemv``: four 16-row MMA atoms); its
# ``pair_combine`` counts one arrival per (token, row warp) of FC2
GEMV_ROW_WARP_ROWS = 64
# K parts per CTA tile of the swap-AB kernel's split K (``split_k``), its counters per tile (one per
# consumer warpgroup, at most 4) and the most weight rows of a swap-AB CTA (4 warpgroups x 2 atoms,
# or 2 x 4, of 64 rows), which bounds the partial accumulators of one work unit.
SWAP_SPLIT_FACTORS = (1, 2, 4)
SWAP_SPLIT_COUNTERS = 4
# The fewest K tiles a split-K part holds: shorter parts do not pay for the partials' round trip
# (TUNING.md, session 20: qwen3-30b-a3b T = 1, parts of 16 K tiles 2.7 us faster, of 6 K tiles 0.6 us slower).
SWAP_SPLIT_MIN_K_TILES = 16
SWAP_MAX_CTA_ROWS = 512

# The fused decode kernel (``moe_bf16_glu.decode``): the most pairs (T * top_k) its in-CTA routing takes
# (one thread each), its warps per CTA and per FC1 unit, the pairs of one FC1 group (an m16n8k16 MMA's 8 token columns)
# and the bytes of one stage of a warp's ring (two weight rows and one token column, 32 bytes a lane each).
DECODE_MAX_PAIRS = 256
DECODE_WARPS = (8, 16)
DECODE_K_WARPS = (1, 2, 4, 8, 16)  # warps splitting one FC1 unit's K steps (at most the CTA's warps)
DECODE_GROUP_PAIRS = 8
DECODE_STAGE_BYTES = 3 * 1024
