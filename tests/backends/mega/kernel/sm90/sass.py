"""SASS readings shared by the kernel build tests."""

from __future__ import annotations

import re


def pdl_order(sass: list[str], load: str = "UTMALDG") -> tuple[int, bool]:
    """(loads, TMA unless ``load`` names another opcode pattern, placed before the kernel's wait for the
    kernel before it; whether it lets its dependents launch before that wait): ``ACQBULK`` is
    ``griddepcontrol.wait``, ``PREEXIT`` ``launch_dependents``."""
    wait = next(i for i, line in enumerate(sass) if re.search(r"\bACQBULK\b", line))
    trigger = next(i for i, line in enumerate(sass) if re.search(r"\bPREEXIT\b", line))
    return sum(1 for line in sass[:wait] if re.search(load, line)), trigger < wait


def wgmma_batches(sass: list[str]) -> dict[str, int]:
    """How a kernel's WGMMA batches are closed and waited for: ``empty``, the batches ptxas adds at the join
    after a branch that holds WGMMAs but not their ``commit_group`` (``HGMMA.64x8x16.F16 RZ ...``: the
    ``wait_group(1)`` after one waits for the batch just issued); ``in_flight`` / ``drained``, the waits that
    leave one batch pending / none (``WARPGROUP.DEPBAR.LE gsb0, 0x1`` / ``0x0``); ``hgmma``, the real WGMMAs."""
    return {
        "empty": sum(1 for line in sass if re.search(r"\bHGMMA\.\S+\s+RZ,", line)),
        "in_flight": sum(1 for line in sass if re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1\b", line)),
        "drained": sum(1 for line in sass if re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b", line)),
        "hgmma": sum(1 for line in sass if re.search(r"\bHGMMA\.\S+\s+R\d", line)),
    }
