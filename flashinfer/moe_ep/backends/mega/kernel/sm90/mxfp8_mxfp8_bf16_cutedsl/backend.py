"""The SM90 mxfp8 backend: the shared block-scaled backend (the format comes from the config)."""

from __future__ import annotations

from ..block_scaled import Sm90BlockScaledBackend
from .config import Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig


class Sm90Mxfp8CutedslBackend(Sm90BlockScaledBackend):
    config_cls = Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig


__all__ = ["Sm90Mxfp8CutedslBackend"]
