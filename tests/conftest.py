"""Shared fixtures and the GPU skip logic (GPU tests are marked ``gpu`` and skip with a reason)."""

from __future__ import annotations

import os

import pytest
import torch

# The CPU build tests compile for Hopper, and cutlass reads its target arch once, at its first import:
# set it before any test module imports cutlass, so which tests run first does not decide it.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def hopper_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch (GPU tests run on the H200 machine: see SKILL.md)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"needs an SM90 (Hopper) GPU, found sm_{major}{minor}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = hopper_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen() -> torch.Generator:
    """A fresh generator per test, seeded from the test's own counter so inputs differ between tests."""
    return torch.Generator().manual_seed(torch.randint(0, 2**31 - 1, (1,)).item())
