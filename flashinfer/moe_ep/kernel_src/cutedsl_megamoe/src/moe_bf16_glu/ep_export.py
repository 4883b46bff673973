"""Compile ``Sm90MegaMoEBf16EpKernel`` ahead of time and export it as a TVM-FFI library (DRAFT).

CPU-only machines: set ``CUTE_DSL_ARCH=sm_90a`` before cutlass is imported. Calling convention
(torch tensors, the current torch stream; scalars as Python ints), argument order
``ep_workspace.EP_ARGS``::

    fn(x[T,H] bf16, topk_ids[T,K] i32, topk_weights[T,K] f32, w13[E_loc,N1,H] bf16,
       w2[E_loc,H,I] bf16, out[T,H] bf16, live_tokens[1] i32,
       flags[5,R] i32, x_sym[T_cap,H] bf16, send_list[T_cap*K,2] i32, expert_cnt[E] i32,
       expert_start[E] i32, row_base[R,E_loc] i32, a_buf[M_cap,H] bf16,      # symmetric (own)
       flags_tab, x_tab, send_tab, cnt_tab, start_tab, row_base_tab, y_tab,    # int64 [R] each
       cta_cnt[G,E] i32, pair_pos[T_cap*K] i32, src_meta[R,4] i32,
       m_block_expert[M_cap/tile_m] i32, meta[4] i32, h_buf[M_cap,I] bf16,
       ep_state[4] i32,                                                         # local
       abort[4] i32, rank, timeout_ns)

T, T_cap, T_cap*K, M_cap and M_cap/tile_m are symbolic; H, I, E_loc, K, R, G are compile-time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from ..common import constants
from .ep_kernel import Sm90MegaMoEBf16EpKernel
from .ep_workspace import NUM_FLAG_KINDS
from .export import check_problem, link_library


def check_ep_problem(kernel: Sm90MegaMoEBf16EpKernel, hidden: int, inter: int, num_experts: int, top_k: int) -> None:
    """``num_experts`` is global; raises ValueError when the shape does not fit the knobs."""
    if num_experts % kernel.world_size:
        raise ValueError(f"{num_experts} experts do not split over {kernel.world_size} ranks")
    if num_experts > constants.ROUTING_THREADS:
        raise ValueError(f"at most {constants.ROUTING_THREADS} global experts, got {num_experts}")
    check_problem(kernel, hidden, inter, num_experts // kernel.world_size, top_k)


def ep_fake_arguments(
    kernel: Sm90MegaMoEBf16EpKernel, hidden: int, inter: int, num_experts: int, top_k: int
) -> list[Any]:
    bf16, i32, f32 = cutlass.BFloat16, cutlass.Int32, cutlass.Float32
    e_loc = num_experts // kernel.world_size
    n1 = 2 * inter if kernel.activation in constants.GATED_ACTIVATIONS else inter
    t = cute.sym_int()
    return [
        fake_matrix(bf16, (t, hidden)),  # x
        fake_matrix(i32, (t, top_k)),  # topk_ids
        fake_matrix(f32, (t, top_k)),  # topk_weights
        fake_matrix(bf16, (e_loc, n1, hidden)),  # w13
        fake_matrix(bf16, (e_loc, hidden, inter)),  # w2
        fake_matrix(bf16, (t, hidden)),  # out
        *ep_protocol_fake_arguments(kernel, hidden, inter, num_experts),
    ]


def fake_matrix(dtype: Any, shape: tuple, align: int = 16) -> Any:
    """A compact row-major fake tensor for ``cute.compile`` (symbolic extents allowed)."""
    order = tuple(range(len(shape) - 1, -1, -1))
    return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align)


def ep_protocol_fake_arguments(kernel: Any, hidden: int, inter: int, num_experts: int) -> list[Any]:
    """The arguments every EP kernel takes after ``out``: ``live_tokens``, the symmetric buffers, the
    pointer tables, the local workspace, the abort word, ``rank``, ``timeout_ns`` and the stream
    (``ep_workspace.EP_ARGS`` from ``live_tokens`` on). ``kernel``: an ``EpProtocol``."""
    bf16, i32, i64 = cutlass.BFloat16, cutlass.Int32, cutlass.Int64
    world = kernel.world_size
    e_loc = num_experts // world
    t_cap = cute.sym_int()
    p_cap = cute.sym_int()
    m_cap = cute.sym_int()
    mat = fake_matrix
    tables = [mat(i64, (world,)) for _ in range(7)]
    return [
        mat(i32, (1,), align=4),  # live_tokens: any int32 element (e.g. a view into a larger tensor)
        mat(i32, (NUM_FLAG_KINDS, world)),  # flags
        mat(bf16, (t_cap, hidden)),  # x_sym
        mat(i32, (p_cap, 2)),  # send_list
        mat(i32, (num_experts,)),  # expert_cnt
        mat(i32, (num_experts,)),  # expert_start
        mat(i32, (world, e_loc)),  # row_base
        mat(bf16, (m_cap, hidden)),  # a_buf
        *tables,
        mat(i32, (kernel.grid, num_experts)),  # cta_cnt
        mat(i32, (p_cap,)),  # pair_pos
        mat(i32, (world, 4)),  # src_meta
        mat(i32, (cute.sym_int(),)),  # m_block_expert
        mat(i32, (4,)),  # meta
        mat(bf16, (m_cap, inter)),  # h_buf
        mat(i32, (4,)),  # ep_state
        mat(i32, (4,)),  # abort
        i32(0),  # rank
        i64(1_000_000_000),  # timeout_ns
        make_fake_stream(use_tvm_ffi_env_stream=True),
    ]


def compile_moe_bf16_ep(kernel: Sm90MegaMoEBf16EpKernel, hidden: int, inter: int, num_experts: int, top_k: int) -> Any:
    check_ep_problem(kernel, hidden, inter, num_experts, top_k)
    args = ep_fake_arguments(kernel, hidden, inter, num_experts, top_k)
    return cute.compile(kernel, *args, options="--enable-tvm-ffi")


def export_moe_bf16_ep(
    kernel: Sm90MegaMoEBf16EpKernel,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    out_dir: str | os.PathLike,
    function_name: str = "moe_bf16_ep",
) -> Path:
    """Compile, export and link ``lib<function_name>.so`` in ``out_dir``."""
    return link_library(compile_moe_bf16_ep(kernel, hidden, inter, num_experts, top_k), out_dir, function_name)
