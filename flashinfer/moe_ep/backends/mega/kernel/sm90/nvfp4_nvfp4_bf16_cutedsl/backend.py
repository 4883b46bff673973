"""The SM90 nvfp4 backend: the shared block-scaled backend with its drop frontend."""

from __future__ import annotations

from ..block_scaled import Sm90BlockScaledBackend
from .config import Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig


class Sm90Nvfp4CutedslBackend(Sm90BlockScaledBackend):
    config_cls = Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig
    frontend_name = "Nvfp4Frontend"


__all__ = ["Sm90Nvfp4CutedslBackend"]
