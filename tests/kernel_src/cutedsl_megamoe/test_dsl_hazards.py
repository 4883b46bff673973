"""The CuTe DSL behaviour that ``shim.audit.dsl_hazards`` guards against, checked on the installed DSL (CPU:
the kernel is traced to MLIR, not run). If this test fails, the DSL no longer shadows the name and the
audit's check (``DSL_REGION_NAMES``) can go."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

pytestmark = pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL (nvidia-cutlass-dsl)")

# x = 5 if n > 3 else 9, stored by lane 0: written with a variable named ``name`` and with another name
_KERNEL = """
import cutlass, cutlass.cute as cute, torch
from cutlass import Int32
from cutlass.cute.runtime import from_dlpack

@cute.kernel
def kernel(t: cute.Tensor, n: Int32):
    lane = cute.arch.lane_idx()
    {name} = n > 3
    if lane == 0:
        t[0] = cutlass.select_({name}, Int32(5), Int32(9))

@cute.jit
def launch(t: cute.Tensor, n: Int32):
    kernel(t, n).launch(grid=(1, 1, 1), block=(32, 1, 1))

cute.compile(launch, from_dlpack(torch.zeros(4, dtype=torch.int32)), Int32(5))
"""


def _select_reads_the_if_condition(name: str, tmp_path: Path) -> bool:
    """Trace the kernel with ``name`` and say whether its select reads the ``if``'s condition."""
    script = tmp_path / f"kernel_{name}.py"  # the DSL reads the function's source from its file
    script.write_text(textwrap.dedent(_KERNEL.format(name=name)))
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_PRINT_IR": "1"}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    cond = re.search(r"scf\.if (%\w+)", run.stdout)
    select = re.search(r"arith\.select (%\w+),", run.stdout)
    assert cond and select, run.stdout[-2000:]
    return select.group(1) == cond.group(1)


@pytest.mark.parametrize("name", drop.DSL_REGION_NAMES)
def test_the_dsl_still_reads_the_if_condition_for_this_name(name: str, tmp_path: Path) -> None:
    assert _select_reads_the_if_condition(name, tmp_path)  # the hazard: lane == 0 instead of n > 3
    assert not _select_reads_the_if_condition("keep", tmp_path)  # any other name is the variable
