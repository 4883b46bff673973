"""Backend choice for the CLI: by kernel name, or ``auto`` (the first catalog entry that can run here)."""

from __future__ import annotations

import torch

from ..backends.mega.catalog import CATALOG, BackendEntry, catalog_entry
from ..errors import MoEEpConfigError


def backend_status(entry: BackendEntry, device: torch.device) -> list[str]:
    """What ``entry`` lacks on ``device`` ([] = it can run)."""
    try:
        cls = entry.load_backend_class()
    except ImportError as exc:  # a backend module that cannot even import here
        return [f"cannot import its module ({exc})"]
    return cls.runtime_requirements(device)


def choose_backend(name: str, device: torch.device) -> tuple[BackendEntry, str]:
    """Returns (entry, note). ``auto`` prefers kernels; the note says why a fallback was taken."""
    if name != "auto":
        entry = catalog_entry(name)
        if entry is None:
            raise MoEEpConfigError(
                f"unknown backend {name!r}; known: auto, {', '.join(e.kernel_name for e in CATALOG)}"
            )
        return entry, ""
    skipped = []
    for entry in CATALOG:
        if entry.kernel_name == "reference":
            continue
        missing = backend_status(entry, device)
        if not missing:
            return entry, ""
        skipped.append(f"{entry.kernel_name}: {'; '.join(missing)}")
    note = "no kernel backend can run here, so this runs the torch reference backend"
    if skipped:
        note += " (" + " | ".join(skipped) + ")"
    return catalog_entry("reference"), note  # type: ignore[return-value]


__all__ = ["backend_status", "choose_backend"]
