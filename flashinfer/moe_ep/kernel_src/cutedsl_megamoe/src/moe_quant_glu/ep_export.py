"""Compile ``Sm90MegaMoEQuantEpKernel`` ahead of time and export it as a TVM-FFI library (DRAFT).

Calling convention: the block-scaled operands of ``export`` in place of the BF16 EP kernel's ``x``,
``w13``, ``w2``, then what every EP kernel takes (``ep_workspace.EP_ARGS`` from ``out`` on)::

    fn(x, x_scale, topk_ids, topk_weights, w13_data, w13_scale, w2_data, w2_scale,
       w13_gscale, w2_gscale, act_gscale, out, live_tokens, <symmetric buffers>, <pointer tables>,
       <local workspace>, abort, rank, timeout_ns)

Weights are this rank's experts (``E_loc = E / R``), packed as for world size 1.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import cutlass
import cutlass.cute as cute

from ..common import constants
from ..moe_bf16_glu.ep_export import ep_protocol_fake_arguments, fake_matrix
from ..moe_bf16_glu.export import link_library
from .ep_kernel import Sm90MegaMoEQuantEpKernel
from .export import check_problem


def check_quant_ep_problem(
    kernel: Sm90MegaMoEQuantEpKernel, hidden: int, inter: int, num_experts: int, top_k: int
) -> None:
    """``num_experts`` is global; raises ValueError when the shape does not fit the knobs."""
    if num_experts % kernel.world_size:
        raise ValueError(f"{num_experts} experts do not split over {kernel.world_size} ranks")
    if num_experts > constants.ROUTING_THREADS:
        raise ValueError(f"at most {constants.ROUTING_THREADS} global experts, got {num_experts}")
    check_problem(kernel, hidden, inter, num_experts // kernel.world_size, top_k)


def quant_ep_fake_arguments(
    kernel: Sm90MegaMoEQuantEpKernel, hidden: int, inter: int, num_experts: int, top_k: int
) -> list[Any]:
    bf16, i32, f32, u8 = cutlass.BFloat16, cutlass.Int32, cutlass.Float32, cutlass.Uint8
    e_loc = num_experts // kernel.world_size
    n1 = 2 * inter if kernel.activation in constants.GATED_ACTIVATIONS else inter
    d = constants.QUANT_DATA_BYTES[kernel.fmt]
    spt = constants.QUANT_SCALES_PER_TILE[kernel.fmt]
    tk = constants.TILE_K
    t = cute.sym_int()
    mat = fake_matrix
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
        mat(u8, (e_loc, hidden // tk, n1, d)),  # w13 data
        mat(u8, (e_loc, hidden // tk, n1, spt)),  # w13 scale bytes
        mat(u8, (e_loc, inter // tk, hidden, d)),  # w2 data
        mat(u8, (e_loc, inter // tk, hidden, spt)),  # w2 scale bytes
        mat(f32, (e_loc,)),  # w13_gscale
        mat(f32, (e_loc,)),  # w2_gscale
        mat(f32, (2,)),  # act_gscale
        mat(bf16, (t, hidden)),  # out
        *ep_protocol_fake_arguments(kernel, hidden, inter, num_experts),
    ]


def compile_moe_quant_ep(
    kernel: Sm90MegaMoEQuantEpKernel, hidden: int, inter: int, num_experts: int, top_k: int
) -> Any:
    check_quant_ep_problem(kernel, hidden, inter, num_experts, top_k)
    args = quant_ep_fake_arguments(kernel, hidden, inter, num_experts, top_k)
    return cute.compile(kernel, *args, options="--enable-tvm-ffi")


def export_moe_quant_ep(
    kernel: Sm90MegaMoEQuantEpKernel,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    out_dir: str | os.PathLike,
    function_name: str = "moe_quant_ep",
) -> Path:
    """Compile, export and link ``lib<function_name>.so`` in ``out_dir``."""
    return link_library(compile_moe_quant_ep(kernel, hidden, inter, num_experts, top_k), out_dir, function_name)
