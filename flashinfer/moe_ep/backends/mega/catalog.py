"""The built-in mega backends, by ``kernel_name``, named by import path (imported on first use).

The registry (``modes.mega.registry``), the CLI and ``doctor`` all read this one table. Order is
preference: ``--backend auto`` takes the first entry that can run on the device.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BackendEntry:
    kernel_name: str
    config: str  # "module:Class" of the MegaKernelConfig subclass
    backend: str  # "module:Class" of the MegaKernelBackend subclass
    weight_format: str
    summary: str

    def load_config_class(self) -> Any:
        return _load(self.config)

    def load_backend_class(self) -> Any:
        return _load(self.backend)


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


_PKG = "flashinfer.moe_ep.backends.mega"

CATALOG: tuple[BackendEntry, ...] = (
    BackendEntry(
        "sm90_bf16_bf16_bf16_cutedsl",
        f"{_PKG}.kernel.sm90.bf16_bf16_bf16_cutedsl.config:Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig",
        f"{_PKG}.kernel.sm90.bf16_bf16_bf16_cutedsl.backend:Sm90Bf16CutedslBackend",
        "bf16",
        "Hopper BF16 MegaMoE kernels in CuTe DSL (routing, gather, FC1+act, FC2, combine), any world size",
    ),
    BackendEntry(
        "sm90_mxfp8_mxfp8_bf16_cutedsl",
        f"{_PKG}.kernel.sm90.mxfp8_mxfp8_bf16_cutedsl.config:Sm90_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig",
        f"{_PKG}.kernel.sm90.mxfp8_mxfp8_bf16_cutedsl.backend:Sm90Mxfp8CutedslBackend",
        "mxfp8",
        "Hopper MXFP8 MegaMoE kernels in CuTe DSL (weights dequantized to BF16), any world size",
    ),
    BackendEntry(
        "sm90_nvfp4_nvfp4_bf16_cutedsl",
        f"{_PKG}.kernel.sm90.nvfp4_nvfp4_bf16_cutedsl.config:Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig",
        f"{_PKG}.kernel.sm90.nvfp4_nvfp4_bf16_cutedsl.backend:Sm90Nvfp4CutedslBackend",
        "nvfp4",
        "Hopper NVFP4 MegaMoE kernels in CuTe DSL (weights dequantized to BF16), any world size",
    ),
    BackendEntry(
        "reference",
        f"{_PKG}.reference.config:ReferenceMegaMoeConfig",
        f"{_PKG}.reference.backend:ReferenceMegaMoeBackend",
        "bf16, mxfp8, nvfp4",
        "pure torch, any device and world size (EP over torch.distributed all-to-all)",
    ),
)


def catalog_entry(kernel_name: str) -> BackendEntry | None:
    return next((e for e in CATALOG if e.kernel_name == kernel_name), None)


__all__ = ["CATALOG", "BackendEntry", "catalog_entry"]
