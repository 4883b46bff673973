"""Registers, spills and static shared memory of every kernel inside an exported kernel library.

An exported library (``lib<function>.so``, see ``kernel_cache``) embeds the device code as CUDA ELF
images (cubins). ``kernel_resources`` cuts them out of the host library and reads their resource table
with ``cuobjdump -res-usage`` (from a CUDA toolkit on ``PATH``, or the ``nvidia-cuda-cuobjdump`` wheel,
which the test extras install). It runs on a CPU-only machine, so a register spill (local memory: the
kernels' comments measured one at 5x slower) is caught where the kernels are built, not on the GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import re
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: ELF ``e_machine`` of NVIDIA CUDA device code
EM_CUDA = 190
#: Stack frame plus local memory per thread that still counts as no spill: a few saved registers (the
#: combine kernel keeps 8 bytes, two values, at its 128-register cap). Real spills are far above it
#: (the swap-AB GEMM with four warpgroups of 2 atoms: 32 bytes at 64-token tiles, 1.3 KB at 128, and 17x
#: slower; TUNING.md, session 22).
SPILL_TOLERANCE_BYTES = 16


@dataclass(frozen=True)
class KernelResources:
    """One kernel's resources: registers per thread, stack frame and local memory bytes per thread,
    static shared memory bytes per CTA. ptxas puts spilled registers in the stack frame (``STL`` /
    ``LDL`` through the stack pointer), so both count (``spill_bytes``)."""

    name: str
    registers: int
    stack: int
    local: int
    shared: int

    @property
    def spill_bytes(self) -> int:
        """Stack frame plus local memory per thread: spilled registers (or a local array)."""
        return self.stack + self.local

    @property
    def spills(self) -> bool:
        """More than ``SPILL_TOLERANCE_BYTES`` of stack frame and local memory per thread."""
        return self.spill_bytes > SPILL_TOLERANCE_BYTES

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


@contextlib.contextmanager
def _cubin_files(lib: str | os.PathLike, cuobjdump: str | None) -> Iterator[tuple[str, list[Path]]]:
    """(cuobjdump, the device images of ``lib`` as cubin files) while the context lasts. Raises
    FileNotFoundError without ``cuobjdump`` and ValueError when the library embeds no device code."""
    tool = cuobjdump or find_cuobjdump()
    if tool is None:
        raise FileNotFoundError("cuobjdump not found: install a CUDA toolkit or `pip install nvidia-cuda-cuobjdump`")
    images = device_images(Path(lib).read_bytes())
    if not images:
        raise ValueError(f"{lib}: no CUDA device code found")
    with tempfile.TemporaryDirectory() as tmp:
        cubins = []
        for i, image in enumerate(images):
            cubins.append(Path(tmp) / f"image{i}.cubin")
            cubins[-1].write_bytes(image)
        yield tool, cubins


_RESOURCE_LINE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def kernel_resources(lib: str | os.PathLike, cuobjdump: str | None = None) -> list[KernelResources]:
    """Every kernel of the exported library ``lib``. Raises FileNotFoundError without ``cuobjdump``
    and ValueError when the library embeds no device code."""
    out: list[KernelResources] = []
    with _cubin_files(lib, cuobjdump) as (tool, cubins):
        for cubin in cubins:
            text = subprocess.run([tool, "-res-usage", str(cubin)], check=True, capture_output=True, text=True).stdout
            lines = text.splitlines()
            for head, body in itertools.pairwise(lines):
                m = _RESOURCE_LINE.search(body)
                if head.strip().startswith("Function ") and m:
                    regs, stack, shared, local = (int(v) for v in m.groups())
                    name = head.strip().removeprefix("Function ").rstrip(":")
                    out.append(KernelResources(name, regs, stack, local, shared))
    return sorted(out, key=lambda r: _ordinal(r.name))


_SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def kernel_sass(lib: str | os.PathLike, cuobjdump: str | None = None) -> dict[str, list[str]]:
    """Every kernel of the exported library ``lib`` as its SASS instructions (no addresses, no encodings),
    keyed by ``short_name`` in launch order. ``cuobjdump -sass`` needs ``nvdisasm`` next to it or on
    ``PATH`` (a CUDA toolkit or the ``nvidia-cuda-nvdisasm`` wheel); FileNotFoundError without."""
    kernels: dict[str, list[str]] = {}
    with _cubin_files(lib, cuobjdump) as (tool, cubins):
        env = dict(os.environ, PATH=os.pathsep.join([str(Path(tool).parent), os.environ.get("PATH", "")]))
        for cubin in cubins:
            run = subprocess.run([tool, "-sass", str(cubin)], check=True, capture_output=True, text=True, env=env)
            text = run.stdout
            current: list[str] | None = None
            for line in text.splitlines():
                if line.strip().startswith("Function : "):
                    current = kernels.setdefault(line.strip().removeprefix("Function : "), [])
                elif current is not None and (m := _SASS_INSTRUCTION.search(line)):
                    current.append(m.group(1))
    if not kernels:
        raise FileNotFoundError(f"{tool} -sass printed no code: it needs nvdisasm (`pip install nvidia-cuda-nvdisasm`)")
    out: dict[str, list[str]] = {}
    for name in sorted(kernels, key=_ordinal):
        short = KernelResources(name, 0, 0, 0, 0).short_name
        label, n = short, 2
        while label in out:  # two kernels of one short name: number the later ones
            label, n = f"{short}({n})", n + 1
        out[label] = kernels[name]
    return out


@dataclass(frozen=True)
class SassComparison:
    """One kernel of two libraries: ``changed`` instructions differ (0: identical machine code)."""

    name: str
    count_a: int  # instructions in library a (0: not there)
    count_b: int
    changed: int

    @property
    def verdict(self) -> str:
        if not self.count_a or not self.count_b:
            return "only in " + ("b" if not self.count_a else "a")
        return "identical" if not self.changed else f"differs in {self.changed} instruction(s)"


def compare_sass(
    lib_a: str | os.PathLike, lib_b: str | os.PathLike, cuobjdump: str | None = None
) -> list[SassComparison]:
    """The kernels of two libraries side by side, matched by ``short_name`` (for example two drops'
    builds of one variant: a pure refactor leaves every kernel ``identical``)."""
    a, b = kernel_sass(lib_a, cuobjdump), kernel_sass(lib_b, cuobjdump)
    out = []
    for name in list(a) + [n for n in b if n not in a]:
        x, y = a.get(name, []), b.get(name, [])
        changed = sum(i != j for i, j in zip(x, y, strict=False)) + abs(len(x) - len(y))
        out.append(SassComparison(name, len(x), len(y), changed))
    return out


def _ordinal(name: str) -> int:
    """CuTe DSL numbers a host function's kernels in launch order (the mangled name's last field)."""
    m = re.search(r"_(\d+)$", name)
    return int(m.group(1)) if m else -1


def describe(resources: list[KernelResources]) -> str:
    """One line per kernel: registers, stack frame + local memory (spills flagged), static shared memory."""
    rows = []
    for r in resources:
        spill = "  SPILLS" if r.spills else ""
        rows.append(
            f"  {r.short_name:32s} {r.registers:4d} regs  stack+local {r.spill_bytes:5d} B  smem {r.shared:6d} B{spill}"
        )
    return "\n".join(rows)


__all__ = [
    "KernelResources",
    "SassComparison",
    "compare_sass",
    "describe",
    "device_images",
    "find_cuobjdump",
    "kernel_resources",
    "kernel_sass",
]
