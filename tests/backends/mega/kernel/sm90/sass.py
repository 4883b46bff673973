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
