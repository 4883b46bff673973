"""SM90 BF16 activations x BF16 weights -> BF16 output, CuTe DSL kernels (drop ``cutedsl_megamoe``)."""

from .config import Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig

__all__ = ["Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig"]
