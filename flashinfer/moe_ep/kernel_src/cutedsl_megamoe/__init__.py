"""Kernel drop ``cutedsl_megamoe``: MegaMoE kernels for Hopper (sm_90a) in CuTe DSL.

This package ``__init__`` is the only entry for backends. Importing it is CPU-safe: it imports no
cutlass (kernels are compiled or loaded only when a frontend asks for them).
"""

from __future__ import annotations

from .shim import autotune, comm, frontend, kernel_cache, kernel_helpers, kernel_resources, knob_cache, tuner, vendor
from .shim._paths import SRC_DIR
from .shim.audit import DSL_REGION_NAMES, audit_src, dsl_hazards
from .shim.bf16 import Bf16Frontend, Bf16Knobs, default_bf16_knobs
from .shim.bf16_ep import (
    EP_BUCKET_DEFAULTS,
    EP_KNOB_FAMILY,
    EP_KNOBS,
    Bf16EpFrontend,
    Bf16EpKnobs,
    EpFrontendMixin,
    EpRankState,
    default_bf16_ep_knobs,
    ep_candidates,
    ep_knob_dict,
    merge_specs,
    resync_states,
)
from .shim.drop_update import NEXT_STEPS, update_drop
from .shim.frontend import (
    ARCH,
    Geometry,
    KernelUnavailableError,
    Workspace,
    allocate_shared_workspace,
    dsl_available,
    prepare_compile_env,
    tvm_ffi_available,
)
from .shim.mxfp8 import Mxfp8EpFrontend, Mxfp8Frontend
from .shim.nvfp4 import Nvfp4EpFrontend, Nvfp4Frontend
from .shim.quant import PAIR_CLUSTER_MAX, PackedQuantWeights, QuantFrontend, QuantKnobs, default_quant_knobs
from .shim.quant_ep import QuantEpFrontend, QuantEpKnobs
from .shim.vendor import check_manifest, read_vendor, source_digest

__all__ = [
    "ARCH",
    "Bf16EpFrontend",
    "Bf16EpKnobs",
    "EP_KNOB_FAMILY",
    "EP_BUCKET_DEFAULTS",
    "EP_KNOBS",
    "Bf16Frontend",
    "Bf16Knobs",
    "Geometry",
    "Mxfp8EpFrontend",
    "Mxfp8Frontend",
    "NEXT_STEPS",
    "Nvfp4EpFrontend",
    "Nvfp4Frontend",
    "PAIR_CLUSTER_MAX",
    "PackedQuantWeights",
    "QuantEpFrontend",
    "QuantEpKnobs",
    "QuantFrontend",
    "QuantKnobs",
    "SRC_DIR",
    "Workspace",
    "allocate_shared_workspace",
    "audit_src",
    "dsl_hazards",
    "DSL_REGION_NAMES",
    "autotune",
    "KernelUnavailableError",
    "check_manifest",
    "comm",
    "EpFrontendMixin",
    "EpRankState",
    "default_bf16_ep_knobs",
    "ep_candidates",
    "ep_knob_dict",
    "merge_specs",
    "resync_states",
    "default_bf16_knobs",
    "default_quant_knobs",
    "dsl_available",
    "frontend",
    "kernel_cache",
    "kernel_resources",
    "kernel_helpers",
    "knob_cache",
    "prepare_compile_env",
    "read_vendor",
    "source_digest",
    "tuner",
    "tvm_ffi_available",
    "update_drop",
    "vendor",
]
