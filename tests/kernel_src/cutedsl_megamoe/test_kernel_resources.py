"""``shim.kernel_resources``: device images cut out of a host library, kernel names, the resource
table of a freshly built library (registers, no spills) read on the CPU with cuobjdump, and the SASS
of two libraries compared kernel by kernel."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop
from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_resources as kr


def _elf(machine: int, payload: bytes) -> bytes:
    """A minimal ELF64: header, one section header, then ``payload`` as the section's bytes."""
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    header[4], header[5] = 2, 1  # 64-bit, little endian
    struct.pack_into("<H", header, 0x12, machine)
    struct.pack_into("<QQ", header, 0x20, 0, 64)  # no program headers; section headers at 64
    struct.pack_into("<HHHH", header, 0x36, 56, 0, 64, 1)
    section = bytearray(64)
    struct.pack_into("<I", section, 4, 1)  # PROGBITS
    struct.pack_into("<QQ", section, 0x18, 128, len(payload))
    return bytes(header + section + payload)


def test_device_images_cuts_each_cuda_elf_to_its_length() -> None:
    cubin_a, cubin_b = _elf(kr.EM_CUDA, b"A" * 40), _elf(kr.EM_CUDA, b"B" * 8)
    host = _elf(62, b"host code")  # x86-64: the library itself, not device code
    blob = host + b"\0" * 24 + cubin_a + b"junk" + _elf(62, b"another host elf") + cubin_b + b"tail"
    assert kr.device_images(blob) == [cubin_a, cubin_b]
    assert kr.device_images(host + b"no device code here") == []


def test_short_names_drop_the_dsl_mangling() -> None:
    def res(name: str) -> kr.KernelResources:
        return kr.KernelResources(name, 1, 0, 0, 0)

    gemm = (
        "kernel_cutlass_kernel_flashinfermoe_epkernel_srccutedsl_megamoesrcmoe_bf16_glugrouped_gemmGroupedGemmSm90"
        "_object_at__CopyAtom_ThrID10_TVLayoutSrc1409601_Valuetypebf16_t_3"
    )
    assert res(gemm).short_name == "GroupedGemmSm90#3"
    route = "kernel_cutlass_route_kernel_tensorptri32gmemalign16o881_tensorptri32gmemalign16o1_0"
    assert res(route).short_name == "route_kernel#0"


def test_missing_cuobjdump_names_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kr, "find_cuobjdump", lambda: None)
    with pytest.raises(FileNotFoundError, match="pip install nvidia-cuda-cuobjdump"):
        kr.kernel_resources(tmp_path / "lib.so")


_GEMM = "kernel_cutlass_kernel_moe_bf16_glugrouped_gemmGroupedGemmSm90_object_at__CopyAtom_ThrID10_{}"


def _sass(*kernels: tuple[str, list[str]]) -> bytes:
    """``cuobjdump -sass`` text for the given (name, instructions) kernels, encodings included."""
    lines = ["", "\tcode for sm_90a", "\t.target\tsm_90a", ""]
    for name, code in kernels:
        lines += [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"']
        for i, ins in enumerate(code):
            lines += [f"        /*{16 * i:04x}*/                   {ins} ;      /* 0x0000000000007919 */",
                      "                                          /* 0x000e2e0000002100 */"]  # fmt: skip
    return "\n".join(lines).encode()


def _fake_cuobjdump(tmp_path: Path) -> str:
    """A stand-in for ``cuobjdump -sass FILE``: prints the payload of the synthetic image (at byte 128)."""
    tool = tmp_path / "cuobjdump"
    tool.write_text('#!/bin/sh\ntail -c +129 "$2"\n')
    tool.chmod(0o755)
    return str(tool)


def test_sass_comparison_matches_kernels_by_name_and_counts_changes(tmp_path: Path) -> None:
    route = "kernel_cutlass_route_kernel_tensorptri32gmemalign16o881_0"
    old = [(route, ["S2R R2, SR_TID.X", "EXIT"]), (_GEMM.format(1), ["HGMMA.64x256x16", "EXIT"]),
           (_GEMM.format(2), ["HGMMA.64x128x16", "BRA 0x10", "EXIT"])]  # fmt: skip
    # The new drop renamed the routing kernel's parameters (the mangled name changes, not the short
    # name), changed one instruction of the second GEMM and added a combine kernel.
    new = [(route.replace("881", "882"), ["S2R R2, SR_TID.X", "EXIT"]),
           (_GEMM.format(1), ["HGMMA.64x256x16", "EXIT"]),
           (_GEMM.format(2), ["HGMMA.64x128x16", "BRA 0x20", "EXIT"]),
           ("kernel_cutlass_combine_kernel_tensorptrbf16gmem_3", ["EXIT"])]  # fmt: skip
    lib_a, lib_b = tmp_path / "a.so", tmp_path / "b.so"
    lib_a.write_bytes(_elf(62, b"host") + _elf(kr.EM_CUDA, _sass(*old)))
    lib_b.write_bytes(_elf(62, b"host") + _elf(kr.EM_CUDA, _sass(*new)))
    tool = _fake_cuobjdump(tmp_path)
    assert kr.kernel_sass(lib_a, tool) == {
        "route_kernel#0": ["S2R R2, SR_TID.X", "EXIT"],
        "GroupedGemmSm90#1": ["HGMMA.64x256x16", "EXIT"],
        "GroupedGemmSm90#2": ["HGMMA.64x128x16", "BRA 0x10", "EXIT"],
    }
    verdicts = {c.name: c.verdict for c in kr.compare_sass(lib_a, lib_b, tool)}
    assert verdicts == {
        "route_kernel#0": "identical",
        "GroupedGemmSm90#1": "identical",
        "GroupedGemmSm90#2": "differs in 1 instruction(s)",
        "combine_kernel#3": "only in b",
    }


def test_sass_without_a_disassembler_names_the_install(tmp_path: Path) -> None:
    lib = tmp_path / "a.so"
    # what cuobjdump -sass prints when it finds no nvdisasm: the target, no code
    lib.write_bytes(_elf(62, b"host") + _elf(kr.EM_CUDA, b"\n\tcode for sm_90a\n"))
    with pytest.raises(FileNotFoundError, match="nvidia-cuda-nvdisasm"):
        kr.kernel_sass(lib, _fake_cuobjdump(tmp_path))


@pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")
@pytest.mark.skipif(kr.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
def test_resources_of_a_built_library(tmp_path: Path) -> None:
    """``build --resources`` on the tiny contract (its own process: cutlass takes the target arch at
    import): the decode chain's kernels in launch order, registers within the hardware limit, no spill
    (stack frame and local memory within ``SPILL_TOLERANCE_BYTES``)."""
    cmd = [sys.executable, "-m", "flashinfer.moe_ep", "build", "--contract", "tiny", "--cache", str(tmp_path)]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    run = subprocess.run([*cmd, "--resources"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "resources: no kernel spills" in run.stdout and "GroupedGemmSm90#2" in run.stdout
    libs = sorted(tmp_path.glob("moe_bf16_glu-*/*.so"))
    by_lib = {lib: kr.kernel_resources(lib) for lib in libs}
    chains = {lib: [r.short_name.split("#")[0] for r in res] for lib, res in by_lib.items()}
    # a bucket with pair_blocks has no routing kernel; the others route first
    for lib, names in chains.items():
        pairs = json.loads((lib.parent / "key.json").read_text())["knobs"]["pair_blocks"]
        assert names[0] == ("GroupedGemmSm90" if pairs else "route_kernel"), (lib, names)
    lib = next(lib for lib, names in chains.items() if names[0] == "route_kernel")
    resources, names = by_lib[lib], chains[lib]
    assert names.count("GroupedGemmSm90") == 2 and names[-1] == "combine_kernel"
    assert all(0 < r.registers <= 255 and not r.spills for res in by_lib.values() for r in res)
    # The SASS of two libraries: a library against itself is identical kernel by kernel; the decode and
    # the prefill buckets' libraries (other tiles) are not.
    same = kr.compare_sass(lib, lib)
    assert len(same) == len(resources) and all(c.verdict == "identical" and c.count_a > 10 for c in same)
    other = next(x for x in libs if x != lib and chains[x][0] == "route_kernel")
    assert any(c.verdict != "identical" for c in kr.compare_sass(lib, other))
