"""Compile ``Sm90MegaMoEQuantKernel`` ahead of time and export it as a TVM-FFI shared library.

Same recipe and calling convention style as ``moe_bf16_glu.export``; argument order::

    fn(x, x_scale, topk_ids, topk_weights, w13_data, w13_scale, w2_data, w2_scale, w13_gscale, w2_gscale,
       act_gscale, out,
       pair_row, pair_rank, expert_count, cta_base, expert_off, m_block_expert, meta, a_buf, h_buf, x_rows,
       split_ws, split_count)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from ..common import constants
from ..common.host_utils import pair_combine_counters, swap_tile_plan
from ..moe_bf16_glu.export import link_library
from .kernel import Sm90MegaMoEQuantKernel


def check_problem(kernel: Sm90MegaMoEQuantKernel, hidden: int, inter: int, num_experts: int, top_k: int) -> None:
    """Raise ValueError when the static problem shape does not fit the kernel's knobs."""
    if num_experts > constants.MAX_EXPERTS:
        raise ValueError(f"at most {constants.MAX_EXPERTS} experts, got {num_experts}")
    if hidden % constants.TILE_K or inter % constants.TILE_K:
        raise ValueError(f"H and I must be multiples of {constants.TILE_K}")
    n1 = 2 * inter if kernel.activation in constants.GATED_ACTIVATIONS else inter
    if getattr(kernel, "gemv", False):
        if n1 % (constants.SWAP_GATE_UP_BLOCK if gated_act(kernel) else 64) or hidden % 64:
            raise ValueError(f"gemv: FC1 N={n1} must divide by 256 (gated) or 64, H={hidden} by 64")
        unit = kernel.fc1.unit_k
        if hidden % unit or inter % unit:
            raise ValueError(f"gemv ({kernel.fmt}): H={hidden} and I={inter} must be multiples of {unit}")
    elif kernel.swap_ab:
        gated = kernel.activation in constants.GATED_ACTIVATIONS
        swap_tile_plan(n1, gated, kernel.tile_m, kernel.fc1.max_wg, kernel.fc1.max_atoms)
        swap_tile_plan(hidden, False, kernel.tile_m, kernel.fc2.max_wg, kernel.fc2.max_atoms)
    elif n1 % kernel.fc1.tile_n or hidden % kernel.fc2.tile_n:
        raise ValueError(
            f"FC1 N={n1} must divide by fc1_tile_n={kernel.fc1.tile_n} and H={hidden} by fc2_tile_n={kernel.fc2.tile_n}"
        )
    if top_k < 1:
        raise ValueError("top_k must be >= 1")


def gated_act(kernel: Any) -> bool:
    return kernel.activation in constants.GATED_ACTIVATIONS


def fake_arguments(kernel: Sm90MegaMoEQuantKernel, hidden: int, inter: int, num_experts: int, top_k: int) -> list[Any]:
    bf16, i32 = cutlass.BFloat16, cutlass.Int32
    t = cute.sym_int()
    m_cap = cute.sym_int()
    mat = _matrix
    counters = (
        pair_combine_counters(num_experts, top_k, hidden, constants.GEMV_ROW_WARP_ROWS) if kernel.pair_combine else 0
    )
    return [
        *operand_fake_arguments(kernel, hidden, inter, num_experts, top_k, t),
        mat(bf16, (t, hidden)),  # out
        mat(i32, (cute.sym_int(),)),
        mat(i32, (cute.sym_int(),)),
        mat(i32, (num_experts + 1 + counters,)),  # expert_count
        mat(i32, (kernel.num_sms, num_experts)),
        mat(i32, (num_experts,)),
        mat(i32, (cute.sym_int(),)),
        mat(i32, (4,)),
        mat(bf16, (m_cap, hidden)),
        mat(bf16, (cute.sym_int(), inter)),
        mat(bf16, (cute.sym_int(), hidden)),  # x_rows
        mat(cutlass.Float32, (cute.sym_int(),)),  # split_ws
        mat(i32, (cute.sym_int(),)),  # split_count
        make_fake_stream(use_tvm_ffi_env_stream=True),
    ]


def _matrix(dtype: Any, shape: tuple) -> Any:
    order = tuple(range(len(shape) - 1, -1, -1))
    return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=16)


def operand_fake_arguments(kernel: Any, hidden: int, inter: int, experts: int, top_k: int, t: Any) -> list[Any]:
    """The block-scaled kernels' arguments before ``out`` (world size 1 and EP): ``x`` (bf16, or codes),
    ``x_scale``, ``topk_ids``, ``topk_weights``, the packed weights of ``experts`` experts with their
    scales and global scales, ``act_gscale``; ``t``: the symbolic token count."""
    bf16, i32, f32, u8 = cutlass.BFloat16, cutlass.Int32, cutlass.Float32, cutlass.Uint8
    n1 = 2 * inter if kernel.activation in constants.GATED_ACTIVATIONS else inter
    d = constants.QUANT_DATA_BYTES[kernel.fmt]
    spt = constants.QUANT_SCALES_PER_TILE[kernel.fmt]
    tk = constants.TILE_K
    mat = _matrix
    if kernel.prequantized:
        x = mat(u8, (t, hidden if kernel.fmt == constants.FMT_MXFP8 else hidden // 2))
        x_scale = mat(u8, (t, hidden // constants.QUANT_BLOCK[kernel.fmt]))
    else:
        x, x_scale = mat(bf16, (t, hidden)), mat(u8, (1,))
    return [
        x,
        x_scale,
        mat(i32, (t, top_k)),  # topk_ids
        mat(f32, (t, top_k)),  # topk_weights
        mat(u8, (experts, hidden // tk, n1, d)),  # w13 data
        mat(u8, (experts, hidden // tk, n1, spt)),  # w13 scale bytes
        mat(u8, (experts, inter // tk, hidden, d)),  # w2 data
        mat(u8, (experts, inter // tk, hidden, spt)),  # w2 scale bytes
        mat(f32, (experts,)),  # w13_gscale
        mat(f32, (experts,)),  # w2_gscale
        mat(f32, (2,)),  # act_gscale
    ]


def compile_moe_quant(kernel: Sm90MegaMoEQuantKernel, hidden: int, inter: int, num_experts: int, top_k: int) -> Any:
    check_problem(kernel, hidden, inter, num_experts, top_k)
    args = fake_arguments(kernel, hidden, inter, num_experts, top_k)
    return cute.compile(kernel, *args, options="--enable-tvm-ffi")


def export_moe_quant(
    kernel: Sm90MegaMoEQuantKernel,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    out_dir: str | os.PathLike,
    function_name: str = "moe_quant",
) -> Path:
    """Compile, export the object file and link ``lib<function_name>.so`` in ``out_dir``."""
    return link_library(compile_moe_quant(kernel, hidden, inter, num_experts, top_k), out_dir, function_name)
