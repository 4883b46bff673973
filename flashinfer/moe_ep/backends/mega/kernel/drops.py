"""The kernel drops this package vendors, for maintenance commands (update, audit, manifest check).

Backends reach a drop only through its package ``__init__``; this module does the same, lazily.
"""

from __future__ import annotations

import importlib
from types import ModuleType

DROPS = ("cutedsl_megamoe",)


def load_drop(name: str) -> ModuleType:
    if name not in DROPS:
        raise KeyError(f"unknown kernel drop {name!r}; known: {', '.join(DROPS)}")
    if name == "cutedsl_megamoe":
        from flashinfer.moe_ep.kernel_src import cutedsl_megamoe

        return cutedsl_megamoe
    return importlib.import_module(f"flashinfer.moe_ep.kernel_src.{name}")  # pragma: no cover


__all__ = ["DROPS", "load_drop"]
