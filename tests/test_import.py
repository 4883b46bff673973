"""Importing the package must stay cheap and CPU-safe."""

import subprocess
import sys

CODE = r"""
import sys
import flashinfer.moe_ep as moe
import torch
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in ("cutlass", "nvshmem", "tvm_ffi")
               or m.startswith("flashinfer.moe_ep.kernel_src"))
print("HEAVY", heavy)
print("CUDA_INIT", torch.cuda.is_initialized())
moe.registered_mega_kernels()
"""


def test_import_initializes_no_cuda_and_imports_no_drop() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out, out
    assert "CUDA_INIT False" in out, out
