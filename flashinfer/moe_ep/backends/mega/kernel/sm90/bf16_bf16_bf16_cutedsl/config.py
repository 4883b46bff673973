from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ......config import MegaKernelConfig


@dataclass(frozen=True)
class Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(MegaKernelConfig):  # noqa: N801 (FlashInfer's naming scheme)
    """BF16 MegaMoE kernel for Hopper (sm_90a), CuTe DSL.

    ``knobs``: ``None`` (per token bucket: the knob cache, else the defaults), ``"auto"`` (autotune
    every bucket at ``warmup``), or a mapping of the kernel's compile-time knobs for every bucket
    (``tile_m``, ``fc1_tile_n``, ``fc2_tile_n``, ``fc1_stages``, ``fc2_stages``, ``num_sms``); see
    TUNING.md, "Tuning surface".
    Needs hidden and intermediate sizes that are multiples of 64. World size 1 for now.
    """

    kernel_name: ClassVar[str] = "sm90_bf16_bf16_bf16_cutedsl"
