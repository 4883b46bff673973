"""Kernel drop ``cutedsl_megamoe``: MegaMoE kernels for Hopper (sm_90a) in CuTe DSL.

This package ``__init__`` is the only entry for backends. Importing it is CPU-safe: it imports no
cutlass (kernels are compiled or loaded only when a frontend asks for them).
"""

from __future__ import annotations

from .shim import comm, kernel_cache, kernel_helpers
from .shim._paths import SRC_DIR
from .shim.audit import audit_src
from .shim.bf16 import Bf16Frontend, Bf16Knobs, default_bf16_knobs
from .shim.drop_update import NEXT_STEPS, update_drop
from .shim.frontend import ARCH, Geometry, KernelUnavailableError, dsl_available, prepare_compile_env, tvm_ffi_available
from .shim.vendor import check_manifest, read_vendor

__all__ = [
    "ARCH",
    "Bf16Frontend",
    "Bf16Knobs",
    "Geometry",
    "NEXT_STEPS",
    "SRC_DIR",
    "audit_src",
    "KernelUnavailableError",
    "check_manifest",
    "comm",
    "default_bf16_knobs",
    "dsl_available",
    "kernel_cache",
    "kernel_helpers",
    "prepare_compile_env",
    "read_vendor",
    "tvm_ffi_available",
    "update_drop",
]
