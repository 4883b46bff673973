"""NVFP4 frontend (E2M1 + E4M3 per 16 + fp32 global scales): the block-scaled frontend core with its format.

The activation global scales are static (calibrated, as checkpoints ship them): the kernel takes them
as a device tensor, so one library serves every scale.
"""

from __future__ import annotations

from .quant import QuantFrontend
from .quant_ep import QuantEpFrontend


class Nvfp4Frontend(QuantFrontend):
    kernel_family = "moe_nvfp4_glu"
    fmt = "nvfp4"
    build_backend = "sm90_nvfp4_nvfp4_bf16_cutedsl"


class Nvfp4EpFrontend(QuantEpFrontend):
    kernel_family = "moe_nvfp4_ep"
    fmt = "nvfp4"
    build_backend = "sm90_nvfp4_nvfp4_bf16_cutedsl"


__all__ = ["Nvfp4EpFrontend", "Nvfp4Frontend"]
