from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ......config import MegaKernelConfig


@dataclass(frozen=True)
class Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(MegaKernelConfig):  # noqa: N801 (FlashInfer's naming scheme)
    """BF16 MegaMoE kernel for Hopper (sm_90a), CuTe DSL.

    ``knobs``: ``None`` (per token bucket: the knob cache, else the defaults), ``"auto"`` (autotune
    every bucket at ``warmup``), or a mapping of the kernel's compile-time knobs for every bucket
    (``tile_m``, ``fc1_tile_n``, ``fc2_tile_n``, ``fc1_stages``, ``fc2_stages``, ``num_sms``,
    ``cluster_m``); see TUNING.md, "Tuning surface". At world size > 1 (the expert-parallel kernel)
    a dict holds ``tile_m``, ``fc1_tile_n``, ``fc2_tile_n``, ``cluster_m`` and ``dispatch`` (``"pull"``
    or ``"push"``), over each bucket's defaults; its token buckets are over the global token count and
    ``"auto"`` tunes them collectively at ``warmup`` (``ep_tuning.py``, docs/ep.md). Needs hidden and
    intermediate sizes that are multiples of 64.
    """

    kernel_name: ClassVar[str] = "sm90_bf16_bf16_bf16_cutedsl"

    def __post_init__(self) -> None:
        super().__post_init__()
        from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

        from ..runtime import check_kernel_config

        known = [f.name for f in dataclasses.fields(drop.Bf16Knobs)]
        known += [k for k in drop.EP_KNOBS if k not in known]  # world size > 1
        check_kernel_config(self, known, modes=("auto",), knob_class=drop.Bf16Knobs)
