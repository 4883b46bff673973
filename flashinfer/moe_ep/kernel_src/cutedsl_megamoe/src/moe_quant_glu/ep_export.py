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
from .export import check_problem, operand_fake_arguments


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
    t = cute.sym_int()
    return [
        *operand_fake_arguments(kernel, hidden, inter, num_experts // kernel.world_size, top_k, t),
        fake_matrix(cutlass.BFloat16, (t, hidden)),  # out
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
