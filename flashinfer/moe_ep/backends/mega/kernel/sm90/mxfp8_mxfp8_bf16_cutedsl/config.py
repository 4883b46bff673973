from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..block_scaled import Sm90BlockScaledConfig


@dataclass(frozen=True)
class Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig(Sm90BlockScaledConfig):  # noqa: N801 (FlashInfer's naming scheme)
    """MXFP8 (E4M3 + UE8M0 per 32) activations and weights, BF16 output: MegaMoE kernel for Hopper
    (sm_90a), CuTe DSL.

    Weights dequantized exactly to BF16 in shared memory (Hopper has no block-scaled MMA), BF16 WGMMA;
    activations quantized by the kernel. See ``block_scaled.Sm90BlockScaledConfig`` for ``knobs``.
    """

    kernel_name: ClassVar[str] = "sm90_mxfp8_mxfp8_bf16_cutedsl"
    weight_format: ClassVar[str] = "mxfp8"
