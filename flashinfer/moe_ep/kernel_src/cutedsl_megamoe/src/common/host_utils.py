"""Host-side helpers (pure Python, no device code): workspace sizing, the swap-AB tile plan, the
stored bit layout of NVFP4 weight words."""

from __future__ import annotations

from dataclasses import dataclass

from . import constants


@dataclass(frozen=True)
class BufferSpec:
    """One workspace buffer: name, shape and torch dtype name ("int32", "bfloat16", ...)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def e2m1_term_source(op: str, amount: int, bit: int) -> int | None:
    """The bit of W that term ``(op, amount)`` of ``constants.E2M1_PAIR_TERMS`` moves to ``bit``
    (None: shifted in as 0)."""
    if op == "shl":
        src = bit - amount
    elif op == "shr":
        src = bit + amount
    elif op == "rotl":
        return (bit - amount) % 32
    else:
        raise ValueError(f"unknown E2M1 term {op!r}")
    return src if 0 <= src < 32 else None


def e2m1_word_sources() -> list[tuple[int, int]]:
    """Where the packing stores each bit of an NVFP4 data word: entry b = (nibble n, bit i of it) of
    the logical word (nibble n = element n, the low nibble of byte n // 2 for even n) that stored bit b
    holds, so that ``constants.E2M1_PAIR_TERMS`` produce each BF16 pair. BF16 bits 6, 7, 8 and 15 of a
    half take the element's nibble bits 0 (m), 1 (e0), 2 (e1) and 3 (sign)."""
    role = {6: 0, 7: 1, 8: 2, 15: 3}
    sources: dict[int, tuple[int, int]] = {}
    for pair, terms in enumerate(constants.E2M1_PAIR_TERMS):
        for op, amount, mask in terms:
            for bit in range(32):
                if not mask >> bit & 1:
                    continue
                if (bit % 16) not in role or not constants.E2M1_BF16_MASK >> bit & 1:
                    raise ValueError(f"E2M1 term mask {mask:#x} sets bit {bit}, outside the BF16 pattern")
                src = e2m1_term_source(op, amount, bit)
                if src is None or src in sources:
                    raise ValueError(f"E2M1 terms of pair {pair}: stored bit {src} is not free for bit {bit}")
                sources[src] = (2 * pair + bit // 16, role[bit % 16])
    if sorted(sources) != list(range(32)) or len(set(sources.values())) != 32:
        raise ValueError("the E2M1 terms do not place each of the 32 nibble bits exactly once")
    return [sources[b] for b in range(32)]


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def max_rows(max_tokens: int, top_k: int, num_experts: int, tile_m: int, cluster_m: int = 1) -> int:
    """Rows of the permuted buffers: every pair plus the padding of each non-empty expert (to a
    multiple of tile_m), the block count rounded up to a multiple of cluster_m."""
    pairs = max(1, max_tokens) * top_k
    return round_up(pairs + min(num_experts, pairs) * (tile_m - 1), tile_m * cluster_m)


#: shared memory an SM90 CTA may use (227 KiB)
SM90_SMEM_BYTES = 227 * 1024


def gemv_shared_bytes(fmt: str, tok_tile: int, k_warps: int, stages: int, token_row: int = 0) -> int:
    """Shared memory of a ``moe_quant_glu.gemv`` CTA: each warp's ``stages``-deep ring (per stage the 16
    data bytes and a scale word of its 8 weight rows per lane, and the token chunks of every 8-column
    group: 2 (MXFP8) or 4 (NVFP4) 16-byte chunks per lane), the K slices' fp32 partial sums; with
    ``gather_x`` (``token_row`` > 0) the prepared token row of ``token_row`` (K) BF16 elements instead of
    the ring's token chunks."""
    groups = tok_tile // 8
    chunks = 0 if token_row else (2 if fmt == "mxfp8" else 4)
    stage = 8 * 32 * 16 + 8 * 32 * 4 + groups * chunks * 32 * 16
    return k_warps * stages * stage + k_warps * 16 * groups * 32 * 4 + 2 * token_row


def decode_shared_bytes(warps: int, stages: int, top_k: int) -> int:
    """Shared memory of a ``moe_bf16_glu.decode`` CTA: each warp's ``stages``-deep ring (per stage 16
    weight rows of 128 bytes and 32 bytes of one token column per lane), the routing tables (five words
    per pair, eight pair slots per group), FC1's K parts (four accumulators a lane) and FC2's partial
    sums (16 rows per pair and part of I: ``top_k * (warps // min(top_k, warps))`` of them)."""
    ring = warps * stages * constants.DECODE_STAGE_BYTES
    routing = (5 + constants.DECODE_GROUP_PAIRS) * constants.DECODE_MAX_PAIRS * 4
    fc1_parts = warps * 4 * 32 * 4  # a lane's four accumulators per warp
    return ring + routing + fc1_parts + top_k * (warps // min(top_k, warps)) * 16 * 4


def swap_tile_plan(rows: int, gated: bool, tok_tile: int, max_wg: int = 2, max_atoms: int = 4) -> tuple[int, int]:
    """(WGMMA atoms of 64 weight rows per warpgroup, warpgroups per CTA) of the swap-AB GEMM
    (``moe_quant_glu.swap_gemm``) over a weight matrix of ``rows`` rows with ``tok_tile`` tokens.

    Registers bound the atoms: a thread holds ``atoms * tok_tile / 2`` fp32 accumulators and two
    A fragments of ``16 * atoms`` words, so 4 atoms up to 32 tokens, 2 atoms from 64; with four
    consumer warpgroups (``SWAP_WG_REGS``: 112 registers a thread) 2 atoms at most. Weight rows: a
    gated FC1 (gate/up interleaved per 256 rows) takes whole 256-row blocks per CTA, a block's 128
    features split over ``4 / atoms`` warpgroups (4 atoms: one block per warpgroup; 2: two warpgroups
    of 64 features; 1: four of 32); other matrices 4 atoms when 256 divides ``rows``, else 2.
    ``max_atoms`` 2 or 1 takes that many atoms at any token tile (fewer weight rows per warpgroup:
    more CTA tiles or warpgroups over the same rows). The most warpgroups up to ``max_wg`` (1, 2, 4)
    whose rows divide ``rows`` (fewer: more CTA tiles, for few tokens where tiles are scarce); four
    put 16 converting warps on an SM instead of 8."""
    if max_wg not in SWAP_WG_REGS:
        raise ValueError(f"the swap-AB kernel takes 1, 2 or 4 consumer warpgroups per CTA, got {max_wg}")
    if max_atoms not in (1, 2, 4):
        raise ValueError(f"the swap-AB kernel takes 1, 2 or 4 WGMMA atoms per warpgroup at most, got {max_atoms}")
    if tok_tile not in (16, 32, 64, 128):
        raise ValueError(f"the swap-AB token tile must be 16, 32, 64 or 128, got {tok_tile}")
    if max_wg == 4 and max_atoms == 4:
        raise ValueError("four consumer warpgroups (112 registers a thread) take 2 or 1 atoms (swap_atoms=2 or 1)")
    wide = tok_tile > 32  # 2 atoms at most
    if gated:
        if rows % 256:
            raise ValueError(f"the swap-AB kernel needs gated FC1 rows (2 * I = {rows}) to be a multiple of 256")
        atoms = min(2 if wide else 4, max_atoms)
        if atoms * max_wg < 4:
            need = 4 // atoms
            raise ValueError(
                f"a gated FC1 with {atoms} atoms per warpgroup needs {'two' if need == 2 else 'four'} consumer "
                f"warpgroups (swap_wg={need}; {tok_tile}-token tiles, swap_atoms={max_atoms})"
            )
        fits = [wg for wg in SWAP_WG_REGS if wg * atoms >= 4]
    else:
        if rows % 128:
            raise ValueError(f"the swap-AB kernel needs {rows} rows to be a multiple of 128")
        atoms = 4 if rows % 256 == 0 and not wide and max_atoms == 4 else min(2, max_atoms)
        fits = list(SWAP_WG_REGS)
    wg_rows = 64 * atoms
    return atoms, max(wg for wg in fits if wg <= max_wg and rows % (wg * wg_rows) == 0)


#: consumer warpgroups of a swap-AB CTA -> (producer, consumer) registers a thread after ``setmaxnreg``
#: (the register file is 64K: four consumer warpgroups leave 112 each beside a 24-register producer)
SWAP_WG_REGS = {1: (40, 240), 2: (40, 232), 4: (24, 112)}


def moe_bf16_workspace_spec(
    max_tokens: int,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    tile_m: int,
    num_sms: int = 132,
    cluster_m: int = 1,
    combine_counters: int = 0,
    gemv_fused: bool = False,
) -> list[BufferSpec]:
    """Workspace buffers of ``Sm90MegaMoEBf16Kernel.__call__``, in call order.

    Allocate each once for the largest token count to serve (``max_tokens``); the same buffers
    serve every T <= max_tokens. ``tile_m``, ``num_sms`` and ``cluster_m`` are the kernel's knobs. Only
    ``expert_count`` and ``meta`` need initialization: zero them once at allocation (every call leaves
    ``expert_count`` and ``meta[2:4]`` zero again); the kernels write everything else before reading it.

    - pair_row [max_tokens*K] int32: row of pair (t, k) at index t*K + k
    - pair_rank [max_tokens*K] int32: rank of a pair inside its routing CTA's chunk
    - expert_count [E+1+combine_counters] int32: ZERO-INITIALIZED ONCE; pairs per expert, a CTA done-counter,
      then the arrival counters of FC2's own combine (``Sm90MegaMoEBf16Kernel.pair_combine``; their number is
      ``pair_combine_counters``, 0 without it)
    - cta_base [num_sms, E] int32: first slot of each routing CTA inside each expert segment
    - expert_off [E] int32: first row of each (padded) expert segment
    - m_block_expert [M_cap/tile_m * cluster_m] int32: per M block, expert | (rows holding real
      pairs) << 16; with ``cluster_m = 2`` the second half holds the pair table of the expert-aware
      cluster schedule (``Sm90MegaMoEBf16Kernel.pair_by_expert``): two block indices per cluster
    - meta [4] int32: ZERO-INITIALIZED ONCE; meta[0] = number of M blocks, meta[1] = number of rows
      (padded); meta[2:4] the grid barrier of ``moe_bf16_glu.decode`` (zero between calls)
    - a_buf [M_cap, H] bf16: the row -> token map (first 4 * M_cap bytes, as int32) when FC1 gathers its
      own A rows (the default), else the gathered activations; then reused for the FC2 output
    - h_buf [M_cap, I] bf16: FC1 output after the activation (``decode``: row = pair t * K + k)
    """
    m_cap = max_rows(max_tokens, top_k, num_experts, tile_m, cluster_m)
    return [
        BufferSpec("pair_row", (max(1, max_tokens) * top_k,), "int32"),
        BufferSpec("pair_rank", (max(1, max_tokens) * top_k,), "int32"),
        BufferSpec("expert_count", (num_experts + 1 + combine_counters,), "int32"),
        BufferSpec("cta_base", (num_sms, num_experts), "int32"),
        BufferSpec("expert_off", (num_experts,), "int32"),
        BufferSpec("m_block_expert", (m_cap // tile_m * cluster_m,), "int32"),
        BufferSpec("meta", (4,), "int32"),
        BufferSpec("a_buf", (m_cap, hidden), "bfloat16"),
        BufferSpec("h_buf", (m_cap, inter), "bfloat16"),
    ]


def pair_combine_counters(num_experts: int, top_k: int, hidden: int, fc2_tile_n: int) -> int:
    """Arrival counters of FC2's own combine (``pair_combine``): one per (token, FC2 N tile) of the most tokens
    a ``pair_blocks`` launch takes (``T * top_k <= num_experts``)."""
    return num_experts // top_k * (hidden // fc2_tile_n)


def swap_split_workspace(num_sms: int, tok_tile: int, split_k: int) -> tuple[int, int]:
    """(fp32 partial accumulators, int32 counters) of the swap-AB GEMMs' split K (one element each
    without it): a split runs in one wave, so at most ``num_sms`` work units hold partials of
    ``SWAP_MAX_CTA_ROWS x tok_tile`` at most, and at most ``num_sms / 2`` tiles count their parts."""
    if split_k not in constants.SWAP_SPLIT_FACTORS:
        raise ValueError(f"split_k must be one of {constants.SWAP_SPLIT_FACTORS}, got {split_k}")
    if split_k == 1:
        return 1, 1
    return num_sms * constants.SWAP_MAX_CTA_ROWS * tok_tile, num_sms // 2 * constants.SWAP_SPLIT_COUNTERS


#: fp32 accumulators of a GEMV lane (``moe_quant_glu.gemv``: four 16-row atoms, one 8-token column group)
GEMV_LANE_ACCS = 16


def gemv_fused_workspace(grid: int) -> tuple[int, int]:
    """(fp32 partial sums, int32 flags) of ``moe_quant_glu.gemv_fused`` over ``grid`` CTAs: each CTA's tail partials
    (``GEMV_LANE_ACCS`` accumulators of 32 lanes) and flag, then the grid barrier's count and generation."""
    return grid * GEMV_LANE_ACCS * 32, grid + 2


def gemv_fused_shared_bytes(k_warps: int, stages: int, hidden: int, inter: int) -> int:
    """Shared memory of a ``moe_quant_glu.gemv_fused`` CTA: each warp's ``stages``-deep ring of weight items (the 16
    data bytes and a scale word of its 8 rows per lane), two buffers of the warps' partial sums, two token rows (H)
    and two activation rows (I) of BF16, and a few counters."""
    ring = k_warps * stages * (8 * 32 * 16 + 8 * 32 * 4)
    parts = 2 * k_warps * GEMV_LANE_ACCS * 32 * 4
    return ring + parts + 2 * (hidden + inter) * 2 + 64


def moe_quant_workspace_spec(
    max_tokens: int,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    tile_m: int,
    num_sms: int = 132,
    gather_in_fc1: bool = False,
    split_k: int = 1,
    combine_counters: int = 0,
    gemv_fused: bool = False,
) -> list[BufferSpec]:
    """Workspace buffers of ``moe_quant_glu.Sm90MegaMoEQuantKernel.__call__``, in call order: those of
    ``moe_bf16_workspace_spec`` (``cluster_m`` 1; ``a_buf`` holds the row -> token map with
    ``gather_in_fc1``, else the prepared activations of the pairs; ``expert_count`` extended by the
    ``combine_counters`` of ``pair_combine``: ``pair_combine_counters(E, K, H, 64)``, one per token and
    64-column row warp of the GEMV's FC2), then

    - x_rows [max_tokens, H] bf16: with ``gather_in_fc1`` each token's prepared activation row (FC1
      gathers from it); otherwise one row, not read
    - split_ws fp32: the partial accumulators of the swap-AB split K (``swap_split_workspace``), or with
      ``gemv_fused`` those of its split units (``gemv_fused_workspace``); one element without either
    - split_count int32: ZERO-INITIALIZED ONCE; the split-K part counters (every call leaves them zero), or
      ``gemv_fused``'s flags and grid barrier (every call leaves them zero but the barrier's generation)
    """
    spec = moe_bf16_workspace_spec(max_tokens, hidden, inter, num_experts, top_k, tile_m, num_sms, 1, combine_counters)
    rows = max(1, max_tokens) if gather_in_fc1 else 1
    partials, counters = swap_split_workspace(num_sms, tile_m, split_k)
    if gemv_fused:
        partials, counters = gemv_fused_workspace(num_sms)
    return [
        *spec,
        BufferSpec("x_rows", (rows, hidden), "bfloat16"),
        BufferSpec("split_ws", (partials,), "float32"),
        BufferSpec("split_count", (counters,), "int32"),
    ]
