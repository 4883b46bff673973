"""Registry of mega backends, keyed by each config's ``kernel_name``.

Built-in backends are registered by import path and imported only when first used, so importing
``flashinfer.moe_ep`` never imports a backend's heavy dependencies (kernel drops, CuTe DSL).
"""

from __future__ import annotations

import importlib

import torch

from ...backends.mega.base import MegaKernelBackend
from ...backends.mega.catalog import CATALOG
from ...config import BootstrapConfig, FleetParams, MegaKernelConfig
from ...errors import MoEEpBackendUnavailableError, MoEEpConfigError

_REGISTRY: dict[str, type[MegaKernelBackend] | str] = {e.kernel_name: e.backend for e in CATALOG}


def register_mega_kernel(kernel_name: str, backend: type[MegaKernelBackend] | str, *, replace: bool = False) -> None:
    """Register ``backend`` (a class, or ``"module:Class"`` imported on first use) under ``kernel_name``."""
    if not isinstance(kernel_name, str) or not kernel_name:
        raise MoEEpConfigError(f"kernel_name must be a non-empty string, got {kernel_name!r}")
    if kernel_name in _REGISTRY and not replace:
        raise MoEEpConfigError(f"a mega kernel named {kernel_name!r} is already registered (pass replace=True)")
    if isinstance(backend, str):
        module, sep, attr = backend.partition(":")
        if not (sep and all(p.isidentifier() for p in module.split(".")) and attr.isidentifier()):
            raise MoEEpConfigError(f"backend must be 'package.module:Class', got {backend!r}")
    elif not (isinstance(backend, type) and issubclass(backend, MegaKernelBackend)):
        raise MoEEpConfigError(f"backend must be a MegaKernelBackend subclass or 'module:Class', got {backend!r}")
    _REGISTRY[kernel_name] = backend


def registered_mega_kernels() -> list[str]:
    return sorted(_REGISTRY)


def get_mega_backend_class(kernel_name: str) -> type[MegaKernelBackend]:
    try:
        entry = _REGISTRY[kernel_name]
    except KeyError:
        raise MoEEpConfigError(
            f"no mega kernel named {kernel_name!r}; registered: {', '.join(registered_mega_kernels())}"
        ) from None
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module), attr)
        except ImportError as exc:  # its module (or a dependency of it) cannot import here
            raise MoEEpBackendUnavailableError(
                f"mega kernel {kernel_name!r} ({entry!r}) cannot be imported here: {exc}"
            ) from exc
        except AttributeError:
            raise MoEEpConfigError(f"mega kernel {kernel_name!r}: module {module!r} has no {attr!r}") from None
        if not (isinstance(entry, type) and issubclass(entry, MegaKernelBackend)):
            raise MoEEpConfigError(
                f"mega kernel {kernel_name!r}: {_REGISTRY[kernel_name]!r} is not a MegaKernelBackend subclass"
            )
        _REGISTRY[kernel_name] = entry
    return entry


def create_mega_kernel(
    config: MegaKernelConfig, bootstrap: BootstrapConfig, fleet: FleetParams, device: torch.device
) -> MegaKernelBackend:
    """Instantiate the backend registered for ``config.kernel_name``."""
    if not isinstance(config, MegaKernelConfig):
        raise MoEEpConfigError(f"expected a backend config (MegaKernelConfig), got {type(config).__name__}")
    return get_mega_backend_class(config.kernel_name)(config, bootstrap, fleet, device)


__all__ = ["create_mega_kernel", "get_mega_backend_class", "register_mega_kernel", "registered_mega_kernels"]
