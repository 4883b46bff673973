from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..block_scaled import Sm90Nvfp4ConfigFields


@dataclass(frozen=True)
class Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig(Sm90Nvfp4ConfigFields):  # noqa: N801 (FlashInfer's naming scheme)
    """NVFP4 (E2M1 + E4M3 per 16 + fp32 global scales) activations and weights, BF16 output: MegaMoE
    kernel for Hopper (sm_90a), CuTe DSL.

    Weights dequantized exactly to BF16 in shared memory (Hopper has no block-scaled MMA), BF16 WGMMA;
    activations quantized by the kernel. See ``block_scaled.Sm90BlockScaledConfig`` for ``knobs``.
    """

    kernel_name: ClassVar[str] = "sm90_nvfp4_nvfp4_bf16_cutedsl"
    weight_format: ClassVar[str] = "nvfp4"
