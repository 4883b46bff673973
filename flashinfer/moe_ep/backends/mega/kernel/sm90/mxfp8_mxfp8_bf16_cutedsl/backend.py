"""The SM90 mxfp8 backend: the shared block-scaled backend (the format comes from the config)."""

from __future__ import annotations

from ..block_scaled import Sm90BlockScaledBackend
from ..block_scaled_ep import Sm90BlockScaledEpBackend
from .config import Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig


class Sm90Mxfp8CutedslBackend(Sm90BlockScaledBackend):
    config_cls = Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig

    @classmethod
    def ep_backend(cls) -> type[Sm90BlockScaledBackend]:
        return Sm90Mxfp8CutedslEpBackend


class Sm90Mxfp8CutedslEpBackend(Sm90BlockScaledEpBackend, Sm90Mxfp8CutedslBackend):
    """world_size > 1: the in-kernel EP protocol around the mxfp8 GEMMs."""


__all__ = ["Sm90Mxfp8CutedslBackend", "Sm90Mxfp8CutedslEpBackend"]
