"""``doctor``: what this machine has, which backends can run here, and why not."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from ..backends.mega.catalog import CATALOG
from .backends import backend_status

#: distributions whose versions matter, by what they provide.
PACKAGES = (
    ("CuTe DSL", ("nvidia-cutlass-dsl",)),
    ("TVM-FFI", ("apache-tvm-ffi",)),
    ("nvshmem4py", ("nvshmem4py-cu13", "nvshmem4py-cu12", "nvshmem4py")),
)
UPSTREAM_DISTS = ("flashinfer-python", "flashinfer")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="report the environment and which backends can run here")
    p.add_argument("--device", default=None, help="device to judge backends on (default: cuda if present)")
    p.set_defaults(func=run)


def _version(names: tuple[str, ...]) -> str | None:
    for n in names:
        try:
            return f"{n} {md.version(n)}"
        except md.PackageNotFoundError:
            continue
    return None


def namespace_conflicts() -> list[str]:
    """Problems with the shared ``flashinfer`` import name (upstream flashinfer-python installed too)."""
    problems = []
    ours = Path(__file__).resolve().parents[1]  # .../flashinfer/moe_ep
    for dist in UPSTREAM_DISTS:
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            continue
        problems.append(
            f"the distribution {dist} {version} is installed and also provides the import name 'flashinfer'; "
            "Python may resolve flashinfer.moe_ep to it instead of this package. Fix: install flashinfer-moe-ep "
            f"in its own virtual environment, or `python -m pip uninstall {dist}`"
        )
    spec = importlib.util.find_spec("flashinfer")
    if spec is not None and spec.origin not in (None, "namespace"):
        problems.append(
            f"'flashinfer' resolves to a regular package at {spec.origin} (it should be a namespace package); "
            "a flashinfer/__init__.py from another install shadows this one"
        )
    moe = importlib.util.find_spec("flashinfer.moe_ep")
    if moe is not None and moe.origin and Path(moe.origin).resolve().parent != ours:
        problems.append(f"flashinfer.moe_ep resolves to {moe.origin}, not to this install ({ours})")
    return problems


def run(args: argparse.Namespace) -> int:
    print(f"python      {sys.version.split()[0]} on {platform.platform()}")
    print(f"torch       {torch.__version__} (CUDA build {torch.version.cuda or 'none'})")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            print(f"gpu {i}       {torch.cuda.get_device_name(i)} (sm_{cap[0]}{cap[1]})")
    else:
        print("gpu         none visible to torch")
    for label, names in PACKAGES:
        print(f"{label:<11} {_version(names) or 'not installed'}")
    dist = torch.distributed
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    print(f"distributed {', '.join(backends) if dist.is_available() and backends else 'unavailable'}")

    conflicts = namespace_conflicts()
    print(
        "\nimport name 'flashinfer':", "ok (namespace package, no conflicting install)" if not conflicts else "CONFLICT"
    )
    for c in conflicts:
        print(f"  - {c}")

    device = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"\nbackends on {device}:")
    for entry in CATALOG:
        missing = backend_status(entry, device)
        verdict = "can run" if not missing else "cannot run: " + "; ".join(missing)
        print(f"  {entry.kernel_name:<34} {verdict}")
    return 1 if conflicts else 0


__all__ = ["add_parser", "namespace_conflicts", "run"]
