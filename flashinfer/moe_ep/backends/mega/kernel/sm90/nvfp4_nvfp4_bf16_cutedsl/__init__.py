"""SM90 NVFP4 (E2M1 + E4M3 per 16 + fp32 global scales) activations and weights, BF16 output: CuTe DSL
kernels (drop ``cutedsl_megamoe``)."""

from .config import Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig

__all__ = ["Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig"]
