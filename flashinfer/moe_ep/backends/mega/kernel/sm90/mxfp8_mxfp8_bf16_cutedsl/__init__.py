"""SM90 MXFP8 (E4M3 + UE8M0 per 32) activations and weights, BF16 output: CuTe DSL kernels
(drop ``cutedsl_megamoe``)."""

from .config import Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig

__all__ = ["Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig"]
