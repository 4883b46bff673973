"""Buffers of ``Sm90MegaMoEBf16EpKernel`` (host side, torch only: importable without cutlass).

Symmetric buffers (one ``SymBufferHost`` arena per rank, same sizes on every rank; peers read or
write them through the int64 [R] pointer tables) and local workspace, both sized from
``max_tokens`` (per-rank capacity T_cap). ``flags`` (symmetric) and ``ep_state`` (local) need
initialization: zero them once at allocation, on every rank, before any rank's first forward (the
local specs are allocated zeroed). After that the device owns ``ep_state`` (epoch, reuse-wait
targets: ``ep_kernels.STATE_*``) and the abort word (kernel 0 clears it); the host writes
``ep_state`` only to recover after an abort, with every rank idle: ``resync_state(epoch)``.

Symmetric bytes per rank (bf16, int32)::

    2*T_cap*H (x_sym) + 8*T_cap*K (send_list) + 8*E (counts, starts) + 4*R*E_loc (row_base)
    + 20*R (flags) + 2*M_cap*H (a_buf),  M_cap = max_rows(R*T_cap, K, E_loc, tile_m, cluster_m)

Exported call (``ep_export``), argument order ``EP_ARGS``; scalars are Python ints.
"""

from __future__ import annotations

from ..common.host_utils import max_rows
from ..src.symm_buffers import SymBufferSpec

#: symmetric buffer names, in the order of the exported arguments
EP_SYM_BUFFERS = ("flags", "x_sym", "send_list", "expert_cnt", "expert_start", "row_base", "a_buf")
#: pointer tables (int64 [R]) in argument order, and the symmetric buffer each one points at
EP_TABLES = (
    ("flags_tab", "flags"),
    ("x_tab", "x_sym"),
    ("send_tab", "send_list"),
    ("cnt_tab", "expert_cnt"),
    ("start_tab", "expert_start"),
    ("row_base_tab", "row_base"),
    ("y_tab", "a_buf"),
)
EP_LOCAL_BUFFERS = ("cta_cnt", "pair_pos", "src_meta", "m_block_expert", "meta", "h_buf", "ep_state")
EP_ARGS = (
    ("x", "topk_ids", "topk_weights", "w13", "w2", "out", "live_tokens")
    + EP_SYM_BUFFERS
    + tuple(t for t, _ in EP_TABLES)
    + EP_LOCAL_BUFFERS
    + ("abort", "rank", "timeout_ns")
)
ABORT_LEN = 4
#: rows of the symmetric ``flags`` array: ready, done, finished (both dispatches), planned, pushed (push)
NUM_FLAG_KINDS = 5
#: ep_state slots (local workspace: zeroed at allocation, then owned by the device)
STATE_EPOCH = 0  # epoch of the forward in flight (kernel 0 increments it)
STATE_NEXT_PREV = 1  # reuse-wait target of the next forward (0: skip that wait)
STATE_PREV = 2  # reuse-wait target of the forward in flight
STATE_LEN = 4


def resync_state(epoch: int) -> list[int]:
    """The ``ep_state`` a recovery writes (every rank idle): continue after ``epoch`` (the largest any
    rank reached, so the next flags are newer than anything a failed forward left) and skip the next
    forward's reuse wait (nobody reads this rank's buffers any more)."""
    state = [0] * STATE_LEN
    state[STATE_EPOCH] = epoch
    return state


ABORT_STAGES = {1: "owner waits ready (dispatch)", 2: "owner waits finished (buffer reuse)",
                3: "source waits done (combine)", 4: "source waits planned (push dispatch)",
                5: "owner waits pushed (push dispatch)"}  # fmt: skip


def ep_grid(num_sms: int, ranks_per_gpu: int) -> int:
    return max(1, num_sms // ranks_per_gpu)


def ep_max_rows(
    max_tokens: int, top_k: int, local_experts: int, tile_m: int, world_size: int, cluster_m: int = 1
) -> int:
    """Rows an owner can receive, padded per expert; a multiple of ``tile_m * cluster_m`` (room for
    the phantom block that closes an odd block count under GEMM clusters)."""
    return max_rows(max(1, max_tokens) * world_size, top_k, local_experts, tile_m, cluster_m)


def ep_symmetric_specs(
    max_tokens: int, hidden: int, num_experts: int, top_k: int, tile_m: int, world_size: int, cluster_m: int = 1
) -> list[SymBufferSpec]:
    """Symmetric buffers of one rank (``num_experts`` is global, divisible by ``world_size``)."""
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts do not split over {world_size} ranks")
    e_loc = num_experts // world_size
    t_cap = max(1, max_tokens)
    m_cap = ep_max_rows(max_tokens, top_k, e_loc, tile_m, world_size, cluster_m)
    return [
        SymBufferSpec("flags", (NUM_FLAG_KINDS, world_size), "int32"),
        SymBufferSpec("x_sym", (t_cap, hidden), "bfloat16"),
        SymBufferSpec("send_list", (t_cap * top_k, 2), "int32"),
        SymBufferSpec("expert_cnt", (num_experts,), "int32"),
        SymBufferSpec("expert_start", (num_experts,), "int32"),
        SymBufferSpec("row_base", (world_size, e_loc), "int32"),
        SymBufferSpec("a_buf", (m_cap, hidden), "bfloat16"),
    ]


def ep_local_specs(
    max_tokens: int,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    tile_m: int,
    world_size: int,
    num_sms: int,
    ranks_per_gpu: int,
    cluster_m: int = 1,
) -> list[tuple[str, tuple[int, ...], str]]:
    """Local (non-symmetric) workspace: (name, shape, torch dtype name), in argument order."""
    e_loc = num_experts // world_size
    t_cap = max(1, max_tokens)
    m_cap = ep_max_rows(max_tokens, top_k, e_loc, tile_m, world_size, cluster_m)
    return [
        ("cta_cnt", (ep_grid(num_sms, ranks_per_gpu), num_experts), "int32"),
        ("pair_pos", (t_cap * top_k,), "int32"),
        ("src_meta", (world_size, 4), "int32"),
        ("m_block_expert", (m_cap // tile_m,), "int32"),
        ("meta", (4,), "int32"),
        ("h_buf", (m_cap, inter), "bfloat16"),
        ("ep_state", (STATE_LEN,), "int32"),
    ]


__all__ = [
    "ABORT_LEN",
    "ABORT_STAGES",
    "EP_ARGS",
    "EP_LOCAL_BUFFERS",
    "EP_SYM_BUFFERS",
    "EP_TABLES",
    "NUM_FLAG_KINDS",
    "STATE_EPOCH",
    "STATE_LEN",
    "STATE_NEXT_PREV",
    "STATE_PREV",
    "ep_grid",
    "ep_local_specs",
    "ep_max_rows",
    "ep_symmetric_specs",
    "resync_state",
]
