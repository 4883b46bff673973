"""The single re-export point for what backends and tests take from the drop's ``src/``.

``SRC_SYMBOLS`` is the contract with the kernel team, in one table: every symbol the shim takes from
``src/``, where it lives, which shim files depend on it, whether importing it needs cutlass
(``heavy``), and for kernel classes the constructor keywords and ``__call__`` parameters the shim
passes. ``shim/audit.py`` checks a candidate drop against this table. Names resolve lazily through
module ``__getattr__``, so importing this module (and the drop package) never imports cutlass.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ._paths import src_module


class SrcSymbol(NamedTuple):
    module: str  # module under src/, dotted
    attr: str  # "" = the module itself
    heavy: bool  # importing it imports cutlass (needs the CuTe DSL compiler)
    used_by: tuple[str, ...]  # shim files that depend on it
    init_params: tuple[str, ...] | None = None  # keywords the shim passes to the constructor
    call_params: tuple[str, ...] | None = None  # positional parameters of __call__, in order


BF16_KERNEL_CALL = (
    "x", "topk_ids", "topk_weights", "w13", "w2", "out",
    "pair_row", "pair_rank", "expert_count", "cta_base", "expert_off", "m_block_expert", "meta", "a_buf", "h_buf",
    "stream",
)  # fmt: skip

#: the block-scaled kernels' arguments before ``out`` (world size 1 and EP)
QUANT_OPERANDS = (
    "x", "x_scale", "topk_ids", "topk_weights",
    "w13", "w13_scale", "w2", "w2_scale", "w13_gscale", "w2_gscale", "act_gscale",
)  # fmt: skip

QUANT_KERNEL_CALL = (
    *QUANT_OPERANDS,
    "out",
    "pair_row", "pair_rank", "expert_count", "cta_base", "expert_off", "m_block_expert", "meta", "a_buf", "h_buf",
    "x_rows", "split_ws", "split_count", "stream",
)  # fmt: skip

#: what every EP kernel takes after ``out`` (``ep_workspace.EP_ARGS`` from ``live_tokens`` on)
EP_STATE_CALL = (
    "live_tokens",
    "flags", "x_sym", "send_list", "expert_cnt", "expert_start", "row_base", "a_buf",
    "flags_tab", "x_tab", "send_tab", "cnt_tab", "start_tab", "row_base_tab", "y_tab",
    "cta_cnt", "pair_pos", "src_meta", "m_block_expert", "meta", "h_buf", "ep_state",
    "abort", "rank", "timeout_ns",
)  # fmt: skip

QUANT_EP_KERNEL_CALL = (*QUANT_OPERANDS, "out", *EP_STATE_CALL, "stream")

#: constructor keywords the shim passes to both block-scaled kernels, and those the EP kernels add
QUANT_KERNEL_INIT = (
    "fmt", "activation", "limit", "tile_m", "fc1_tile_n", "fc2_tile_n", "num_sms", "fc1_stages", "fc2_stages",
    "swap_ab", "swap_wg", "swap_atoms", "swap_stagger", "swap_narrow", "prequantized",
)  # fmt: skip
EP_KERNEL_INIT = ("world_size", "ranks_per_gpu", "dispatch", "combine_dtype")

SRC_SYMBOLS: dict[str, SrcSymbol] = {
    # constants and host utilities (torch / stdlib only)
    "constants": SrcSymbol("common.constants", "", False, ("shim/bf16.py",)),
    "BufferSpec": SrcSymbol("common.host_utils", "BufferSpec", False, ("shim/frontend.py",)),
    "moe_bf16_workspace_spec": SrcSymbol("common.host_utils", "moe_bf16_workspace_spec", False, ("shim/bf16.py",)),
    "moe_quant_workspace_spec": SrcSymbol("common.host_utils", "moe_quant_workspace_spec", False, ("shim/quant.py",)),
    "pair_combine_counters": SrcSymbol(
        "common.host_utils", "pair_combine_counters", False, ("shim/bf16.py", "shim/quant.py")
    ),
    "swap_tile_plan": SrcSymbol("common.host_utils", "swap_tile_plan", False, ("shim/quant.py",)),
    "gemv_shared_bytes": SrcSymbol("common.host_utils", "gemv_shared_bytes", False, ("shim/quant.py",)),
    "gemv_fused_shared_bytes": SrcSymbol("common.host_utils", "gemv_fused_shared_bytes", False, ("shim/quant.py",)),
    "SM90_SMEM_BYTES": SrcSymbol("common.host_utils", "SM90_SMEM_BYTES", False, ("shim/quant.py", "shim/bf16.py")),
    "decode_shared_bytes": SrcSymbol("common.host_utils", "decode_shared_bytes", False, ("shim/bf16.py",)),
    "e2m1_word_sources": SrcSymbol("common.host_utils", "e2m1_word_sources", False, ("tests",)),
    "interleave_gate_up": SrcSymbol("moe_bf16_glu.weights", "interleave_gate_up", False, ("shim/bf16.py",)),
    "deinterleave_gate_up": SrcSymbol("moe_bf16_glu.weights", "deinterleave_gate_up", False, ("tests",)),
    "tile_weights": SrcSymbol("moe_bf16_glu.weights", "tile_weights", False, ("shim/bf16.py",)),
    "untile_weights": SrcSymbol("moe_bf16_glu.weights", "untile_weights", False, ("tests",)),
    # symmetric buffers (torch only; nvshmem4py imported inside the NVSHMEM provider)
    "SymBufferSpec": SrcSymbol("src.symm_buffers", "SymBufferSpec", False, ("shim/comm.py",)),
    "SymBufferHost": SrcSymbol("src.symm_buffers", "SymBufferHost", False, ("shim/comm.py",)),
    "DeviceMemoryProvider": SrcSymbol("src.symm_buffers", "DeviceMemoryProvider", False, ("shim/comm.py",)),
    "NvshmemProvider": SrcSymbol("src.symm_buffers", "NvshmemProvider", False, ("shim/comm.py",)),
    "LoopbackGroup": SrcSymbol("src.symm_buffers", "LoopbackGroup", False, ("shim/comm.py",)),
    "arena_bytes": SrcSymbol("src.symm_buffers", "arena_bytes", False, ("shim/comm.py",)),
    # the drop's own torch reference
    "drop_reference_moe_bf16": SrcSymbol("moe_bf16_glu.reference", "moe_bf16_reference", False, ("tests",)),
    # device helpers of the block-scaled formats (their bit-level constants are checked on the CPU)
    "block_quant": SrcSymbol("src.block_quant", "", True, ("tests",)),
    # kernels and their AOT export (import cutlass)
    "Sm90MegaMoEBf16Kernel": SrcSymbol(
        "moe_bf16_glu.kernel",
        "Sm90MegaMoEBf16Kernel",
        True,
        ("shim/bf16.py",),
        init_params=(
            "activation",
            "limit",
            "tile_m",
            "fc1_tile_n",
            "fc2_tile_n",
            "num_sms",
            "fc1_stages",
            "fc2_stages",
            "cluster_m",
            "decode_fused",
            "decode_warps",
            "decode_stages",
            "decode_k_warps",
            "pair_blocks",
            "pair_combine",
            "mma_overlap",
        ),
        call_params=BF16_KERNEL_CALL,
    ),
    "export_moe_bf16": SrcSymbol("moe_bf16_glu.export", "export_moe_bf16", True, ("shim/bf16.py",)),
    # block-scaled kernels (MXFP8, NVFP4)
    "pack_quantized_weights": SrcSymbol("moe_quant_glu.weights", "pack_quantized_weights", False, ("shim/quant.py",)),
    "unpack_quantized_matrix": SrcSymbol("moe_quant_glu.weights", "unpack_quantized_matrix", False, ("tests",)),
    "Sm90MegaMoEQuantKernel": SrcSymbol(
        "moe_quant_glu.kernel",
        "Sm90MegaMoEQuantKernel",
        True,
        ("shim/quant.py", "tests"),
        init_params=(
            *QUANT_KERNEL_INIT,
            "gather_in_fc1",
            "swap_split_k",
            "fc2_early_weights",
            "fc1_early_weights",
            "gather_early_rows",
            "gemv",
            "gemv_k_warps",
            "gemv_stages",
            "pair_blocks",
            "pair_combine",
            "swap_tma_store",
            "gemv_l2_prefetch",
            "gemv_fc1_k_warps",
            "gemv_early_ring",
            "gemv_pair_cluster",
            "gemv_row_tma",
            "gemv_fused",
        ),
        call_params=QUANT_KERNEL_CALL,
    ),
    "export_moe_quant": SrcSymbol("moe_quant_glu.export", "export_moe_quant", True, ("shim/quant.py",)),
    # expert parallelism (the EP frontend, the loopback build script and the EP tests)
    "ep_workspace": SrcSymbol(
        "moe_bf16_glu.ep_workspace", "", False, ("shim/bf16_ep.py", "scripts/build_ep_loopback.py", "tests")
    ),
    "Sm90MegaMoEBf16EpKernel": SrcSymbol(
        "moe_bf16_glu.ep_kernel",
        "Sm90MegaMoEBf16EpKernel",
        True,
        ("shim/bf16_ep.py", "scripts/build_ep_loopback.py"),
        init_params=(
            "activation",
            "limit",
            "tile_m",
            "fc1_tile_n",
            "fc2_tile_n",
            "num_sms",
            "cluster_m",
            *EP_KERNEL_INIT,
        ),
    ),
    "export_moe_bf16_ep": SrcSymbol(
        "moe_bf16_glu.ep_export", "export_moe_bf16_ep", True, ("scripts/build_ep_loopback.py",)
    ),
    "Sm90MegaMoEQuantEpKernel": SrcSymbol(
        "moe_quant_glu.ep_kernel",
        "Sm90MegaMoEQuantEpKernel",
        True,
        ("shim/quant_ep.py",),
        init_params=(*QUANT_KERNEL_INIT, *EP_KERNEL_INIT),
        call_params=QUANT_EP_KERNEL_CALL,
    ),
    "export_moe_quant_ep": SrcSymbol("moe_quant_glu.ep_export", "export_moe_quant_ep", True, ("shim/quant_ep.py",)),
}


def __getattr__(name: str) -> Any:
    try:
        sym = SRC_SYMBOLS[name]
    except KeyError:
        raise AttributeError(f"kernel_helpers has no {name!r}") from None
    module = src_module(sym.module)
    value = getattr(module, sym.attr) if sym.attr else module
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *SRC_SYMBOLS])


__all__ = [
    "BF16_KERNEL_CALL",
    "EP_KERNEL_INIT",
    "EP_STATE_CALL",
    "QUANT_EP_KERNEL_CALL",
    "QUANT_KERNEL_CALL",
    "QUANT_KERNEL_INIT",
    "QUANT_OPERANDS",
    "SRC_SYMBOLS",
    "SrcSymbol",
]
