"""Registers, spills and static shared memory of every kernel inside an exported kernel library.

An exported library (``lib<function>.so``, see ``kernel_cache``) embeds the device code as CUDA ELF
images (cubins). ``kernel_resources`` cuts them out of the host library and reads their resource table
with ``cuobjdump -res-usage`` (from a CUDA toolkit on ``PATH``, or the ``nvidia-cuda-cuobjdump`` wheel,
which the test extras install). It runs on a CPU-only machine, so a register spill (local memory: the
kernels' comments measured one at 5x slower) is caught where the kernels are built, not on the GPU.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: ELF ``e_machine`` of NVIDIA CUDA device code
EM_CUDA = 190


@dataclass(frozen=True)
class KernelResources:
    """One kernel's resources: registers per thread, stack and local memory bytes per thread (local
    memory > 0 means spilled registers or a local array), static shared memory bytes per CTA."""

    name: str
    registers: int
    stack: int
    local: int
    shared: int

    @property
    def short_name(self) -> str:
        """The kernel without CuTe DSL's mangling: the kernel class of a method (``GroupedGemmSm90#2``, the
        ordinal telling its instances apart) or the function name (``route_kernel``)."""
        ordinal = _ordinal(self.name)
        suffix = f"#{ordinal}" if ordinal >= 0 else ""
        cls = re.search(r"([A-Z][A-Za-z0-9]*Sm90[A-Za-z0-9]*)_object_at", self.name)
        if cls:
            return cls.group(1) + suffix
        fn = re.match(r"kernel_cutlass_(.*?)_(?:tensor|object|\d)", self.name)
        return (fn.group(1) if fn else self.name[:48]) + suffix


def find_cuobjdump() -> str | None:
    """``cuobjdump`` on ``PATH``, else the one of the ``nvidia-cuda-cuobjdump`` wheel; None without either."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    roots = (spec.submodule_search_locations or []) if spec else []
    for root in roots:
        for sub in ("cu13", "cu12", "cuda_cuobjdump"):
            path = Path(root) / sub / "bin" / "cuobjdump"
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return None


def device_images(blob: bytes) -> list[bytes]:
    """The CUDA ELF images embedded in a host library's bytes, each cut to its own length."""
    images = []
    start = blob.find(b"\x7fELF", 1)
    while start > 0:
        machine = struct.unpack_from("<H", blob, start + 0x12)[0] if start + 0x40 <= len(blob) else 0
        if machine == EM_CUDA and blob[start + 4] == 2:  # ELFCLASS64
            phoff, shoff = struct.unpack_from("<QQ", blob, start + 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", blob, start + 0x36)
            end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
            for i in range(shnum):
                header = start + shoff + i * shentsize
                kind = struct.unpack_from("<I", blob, header + 4)[0]
                offset, size = struct.unpack_from("<QQ", blob, header + 0x18)
                if kind != 8:  # SHT_NOBITS occupies no file bytes
                    end = max(end, offset + size)
            images.append(blob[start : start + end])
            start = blob.find(b"\x7fELF", start + end)
        else:
            start = blob.find(b"\x7fELF", start + 1)
    return images


_RESOURCE_LINE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def kernel_resources(lib: str | os.PathLike, cuobjdump: str | None = None) -> list[KernelResources]:
    """Every kernel of the exported library ``lib``. Raises FileNotFoundError without ``cuobjdump``
    and ValueError when the library embeds no device code."""
    tool = cuobjdump or find_cuobjdump()
    if tool is None:
        raise FileNotFoundError("cuobjdump not found: install a CUDA toolkit or `pip install nvidia-cuda-cuobjdump`")
    images = device_images(Path(lib).read_bytes())
    if not images:
        raise ValueError(f"{lib}: no CUDA device code found")
    out: list[KernelResources] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, image in enumerate(images):
            cubin = Path(tmp) / f"image{i}.cubin"
            cubin.write_bytes(image)
            text = subprocess.run([tool, "-res-usage", str(cubin)], check=True, capture_output=True, text=True).stdout
            lines = text.splitlines()
            for head, body in itertools.pairwise(lines):
                m = _RESOURCE_LINE.search(body)
                if head.strip().startswith("Function ") and m:
                    regs, stack, shared, local = (int(v) for v in m.groups())
                    name = head.strip().removeprefix("Function ").rstrip(":")
                    out.append(KernelResources(name, regs, stack, local, shared))
    return sorted(out, key=lambda r: _ordinal(r.name))


def _ordinal(name: str) -> int:
    """CuTe DSL numbers a host function's kernels in launch order (the mangled name's last field)."""
    m = re.search(r"_(\d+)$", name)
    return int(m.group(1)) if m else -1


def describe(resources: list[KernelResources]) -> str:
    """One line per kernel: registers, local memory (spills flagged), static shared memory."""
    rows = []
    for r in resources:
        spill = "  SPILLS" if r.local else ""
        rows.append(f"  {r.short_name:32s} {r.registers:4d} regs  local {r.local:5d} B  smem {r.shared:6d} B{spill}")
    return "\n".join(rows)


__all__ = ["KernelResources", "describe", "device_images", "find_cuobjdump", "kernel_resources"]
