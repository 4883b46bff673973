"""MXFP8 frontend (E4M3 + UE8M0 per 32): the block-scaled frontend core with its format."""

from __future__ import annotations

from .quant import QuantFrontend
from .quant_ep import QuantEpFrontend


class Mxfp8Frontend(QuantFrontend):
    kernel_family = "moe_mxfp8_glu"
    fmt = "mxfp8"
    build_backend = "sm90_mxfp8_mxfp8_bf16_cutedsl"


class Mxfp8EpFrontend(QuantEpFrontend):
    kernel_family = "moe_mxfp8_ep"
    fmt = "mxfp8"
    build_backend = "sm90_mxfp8_mxfp8_bf16_cutedsl"


__all__ = ["Mxfp8EpFrontend", "Mxfp8Frontend"]
