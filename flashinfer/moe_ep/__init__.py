"""flashinfer.moe_ep: a fused expert-parallel Mixture-of-Experts layer for LLM serving engines.

One call dispatches tokens to the ranks that own their experts, runs the expert MLPs (FC1 gate/up +
activation, FC2) and combines the weighted top-k results back on the source rank.

Layering (one direction; enforced by ``core.layering`` and ``tests/test_layering.py``, on the AST)::

    layer / modes / cli  ->  backends  ->  kernel_src.<drop> (its package __init__ only)  ->  shim/  ->  src/
            \\__________________\\________ core, config, errors (imported by all of the above) ___/

- only a drop's ``shim/`` imports that drop's ``src/``; ``src/`` imports nothing from ``flashinfer``;
- only ``backends/`` import a drop, and only through its package ``__init__``;
- ``core/``, ``modes/``, ``cli/`` and the public API never import ``kernel_src``;
- ``core/`` imports none of ``layer``, ``modes``, ``backends``, ``kernel_src``.

Importing this package initializes no CUDA context and imports no cutlass, nvshmem or kernel drop.
"""

from __future__ import annotations

from .backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl import Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig
from .backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl.ep_backend import make_loopback_group
from .backends.mega.kernel.sm90.mxfp8_mxfp8_bf16_cutedsl import Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig
from .backends.mega.kernel.sm90.nvfp4_nvfp4_bf16_cutedsl import Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig
from .backends.mega.reference import ReferenceMegaMoeConfig
from .config import BootstrapConfig, FleetParams, MegaConfig, MegaKernelConfig, MoEEpTensors, MoEWeightPack
from .core.contracts import CONTRACTS, ModelContract, get_contract
from .errors import (
    MoEEpBackendUnavailableError,
    MoEEpConfigError,
    MoEEpError,
    MoEEpInputError,
    MoEEpTransportError,
)
from .layer import MoEEpLayer, MoEEpMegaLayer
from .modes.mega import create_mega_kernel, register_mega_kernel, registered_mega_kernels

__version__ = "0.1.0"

__all__ = [
    "CONTRACTS",
    "BootstrapConfig",
    "FleetParams",
    "MegaConfig",
    "MegaKernelConfig",
    "ModelContract",
    "MoEEpBackendUnavailableError",
    "MoEEpConfigError",
    "MoEEpError",
    "MoEEpInputError",
    "MoEEpLayer",
    "MoEEpMegaLayer",
    "MoEEpTensors",
    "MoEEpTransportError",
    "MoEWeightPack",
    "ReferenceMegaMoeConfig",
    "Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig",
    "Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig",
    "Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig",
    "create_mega_kernel",
    "get_contract",
    "make_loopback_group",
    "register_mega_kernel",
    "registered_mega_kernels",
]
