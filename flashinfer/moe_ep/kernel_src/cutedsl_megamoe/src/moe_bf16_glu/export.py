"""Compile ``Sm90MegaMoEBf16Kernel`` ahead of time and export it as a TVM-FFI shared library.

Runs on a CPU-only machine: set ``CUTE_DSL_ARCH=sm_90a`` before cutlass is imported. The library
needs only ``libcute_dsl_runtime.so`` and ``tvm_ffi`` at run time. Calling convention of the
exported function (torch tensors, current torch stream)::

    mod = tvm_ffi.load_module("/abs/path/lib.so")
    getattr(mod, function_name)(x, topk_ids, topk_weights, w13_prepared, w2, out,
                                pair_row, pair_rank, expert_count, cta_base, expert_off, m_block_expert,
                                meta, a_buf, h_buf)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from ..common import constants, host_utils
from .kernel import Sm90MegaMoEBf16Kernel


def check_problem(kernel: Sm90MegaMoEBf16Kernel, hidden: int, inter: int, num_experts: int, top_k: int) -> None:
    """Raise ValueError when the static problem shape does not fit the kernel's knobs."""
    if num_experts > constants.MAX_EXPERTS:
        raise ValueError(f"at most {constants.MAX_EXPERTS} experts, got {num_experts}")
    if hidden % constants.TILE_K or inter % constants.TILE_K:
        raise ValueError(f"H and I must be multiples of {constants.TILE_K}")
    n1 = 2 * inter if kernel.activation in constants.GATED_ACTIVATIONS else inter
    tn1 = kernel.fc1.layout_tile_n
    if n1 % tn1 or hidden % kernel.fc2.tile_n:
        raise ValueError(f"FC1 N={n1} must divide by fc1_tile_n={tn1} and H={hidden} by fc2_tile_n={kernel.fc2.tile_n}")
    if top_k < 1:
        raise ValueError("top_k must be >= 1")
    if hidden % (constants.BF16_PER_16B * kernel.aux_vpt):
        raise ValueError(f"H={hidden} must be a multiple of 8 * aux_vpt={kernel.aux_vpt}")


def fake_arguments(kernel: Sm90MegaMoEBf16Kernel, hidden: int, inter: int, num_experts: int, top_k: int) -> list[Any]:
    """Fake tensors for ``cute.compile``: T and all workspace extents are symbolic."""
    bf16, i32, f32 = cutlass.BFloat16, cutlass.Int32, cutlass.Float32
    n1 = 2 * inter if kernel.activation in constants.GATED_ACTIVATIONS else inter
    t = cute.sym_int()
    m_cap = cute.sym_int()
    tn, tk = kernel.fc1.layout_tile_n, constants.TILE_K
    w13_shape = (num_experts, n1 // tn, hidden // tk, tn, tk) if kernel.fc1_tiled else (num_experts, n1, hidden)
    combine_counters = (
        host_utils.pair_combine_counters(num_experts, top_k, hidden, kernel.fc2.tile_n) if kernel.pair_combine else 0
    )

    def mat(dtype: Any, shape: tuple) -> Any:
        order = tuple(range(len(shape) - 1, -1, -1))  # row-major
        return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=16)

    return [
        mat(bf16, (t, hidden)),  # x
        mat(i32, (t, top_k)),  # topk_ids
        mat(f32, (t, top_k)),  # topk_weights
        mat(bf16, w13_shape),  # w13 (prepared; with fc1_tiled the 5-D tiled layout)
        mat(bf16, (num_experts, hidden, inter)),  # w2
        mat(bf16, (t, hidden)),  # out
        mat(i32, (cute.sym_int(),)),  # pair_row
        mat(i32, (cute.sym_int(),)),  # pair_rank
        mat(i32, (num_experts + 1 + combine_counters,)),  # expert_count
        mat(i32, (kernel.num_sms, num_experts)),  # cta_base
        mat(i32, (num_experts,)),  # expert_off
        mat(i32, (cute.sym_int(),)),  # m_block_expert
        mat(i32, (4,)),  # meta
        mat(bf16, (m_cap, hidden)),  # a_buf
        mat(bf16, (cute.sym_int(), inter)),  # h_buf
        make_fake_stream(use_tvm_ffi_env_stream=True),
    ]


def compile_moe_bf16(kernel: Sm90MegaMoEBf16Kernel, hidden: int, inter: int, num_experts: int, top_k: int) -> Any:
    """``cute.compile`` with TVM-FFI enabled (no cache: every call compiles)."""
    check_problem(kernel, hidden, inter, num_experts, top_k)
    args = fake_arguments(kernel, hidden, inter, num_experts, top_k)
    return cute.compile(kernel, *args, options="--enable-tvm-ffi")


def _ldflags() -> list[str]:
    cute_lib = subprocess.run(
        [sys.executable, "-m", "cutlass.cute.export.aot_config", "--ldflags"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    import tvm_ffi.libinfo as tvm_libinfo  # build-time only

    tvm_lib_dir = os.path.dirname(tvm_libinfo.find_libtvm_ffi())
    return [*cute_lib, "-lcute_dsl_runtime", f"-L{tvm_lib_dir}", "-ltvm_ffi"]


def export_moe_bf16(
    kernel: Sm90MegaMoEBf16Kernel,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    out_dir: str | os.PathLike,
    function_name: str = "moe_bf16",
) -> Path:
    """Compile, export the object file and link ``lib<function_name>.so`` in ``out_dir``."""
    return link_library(compile_moe_bf16(kernel, hidden, inter, num_experts, top_k), out_dir, function_name)


def link_library(compiled: Any, out_dir: str | os.PathLike, function_name: str) -> Path:
    """Export a ``cute.compile`` result (TVM-FFI enabled) as an object file and link it into
    ``out_dir/lib<function_name>.so`` against the CuTe DSL runtime and tvm_ffi (every export does this)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    obj = out / f"{function_name}.o"
    lib = out / f"lib{function_name}.so"
    compiled.export_to_c(str(obj), function_name=function_name, export_only_tvm_ffi_symbols=True)
    cxx = shutil.which("g++") or sysconfig.get_config_var("CXX") or "c++"
    subprocess.run([cxx, "-shared", "-o", str(lib), str(obj), *_ldflags()], check=True)
    obj.unlink()
    return lib
