"""The SM90 nvfp4 backend: the shared block-scaled backend (the format comes from the config)."""

from __future__ import annotations

from ..block_scaled import Sm90BlockScaledBackend
from .config import Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig


class Sm90Nvfp4CutedslBackend(Sm90BlockScaledBackend):
    config_cls = Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig


__all__ = ["Sm90Nvfp4CutedslBackend"]
