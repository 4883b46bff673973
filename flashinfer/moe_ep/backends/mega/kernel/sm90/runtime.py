"""What every SM90 CuTe DSL backend needs at run time (checked without importing a drop)."""

from __future__ import annotations

import importlib.util

import torch


def sm90_requirements(device: torch.device) -> list[str]:
    missing = []
    if device.type != "cuda":
        missing.append(f"a CUDA device (got {device.type})")
    elif not torch.cuda.is_available():
        missing.append("a visible CUDA GPU")
    else:
        cap = torch.cuda.get_device_capability(device)
        if cap != (9, 0):
            missing.append(f"an SM90 (Hopper) GPU, found sm_{cap[0]}{cap[1]}")
    if importlib.util.find_spec("tvm_ffi") is None:
        missing.append("TVM-FFI (pip install apache-tvm-ffi) to load the kernels")
    return missing


__all__ = ["sm90_requirements"]
