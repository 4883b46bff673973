"""The SM90 nvfp4 backend: the shared block-scaled backend (the format comes from the config)."""

from __future__ import annotations

from ..block_scaled import Sm90BlockScaledBackend
from ..block_scaled_ep import Sm90BlockScaledEpBackend
from .config import Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig


class Sm90Nvfp4CutedslBackend(Sm90BlockScaledBackend):
    config_cls = Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig

    @classmethod
    def ep_backend(cls) -> type[Sm90BlockScaledBackend]:
        return Sm90Nvfp4CutedslEpBackend


class Sm90Nvfp4CutedslEpBackend(Sm90BlockScaledEpBackend, Sm90Nvfp4CutedslBackend):
    """world_size > 1: the in-kernel EP protocol around the nvfp4 GEMMs."""


__all__ = ["Sm90Nvfp4CutedslBackend", "Sm90Nvfp4CutedslEpBackend"]
