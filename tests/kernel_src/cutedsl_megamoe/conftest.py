"""Fixtures of the drop-package tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def gloo_group():
    """A one-rank gloo process group (the default group is created for the test when none exists)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group([0], backend="gloo")
    finally:
        if created:
            dist.destroy_process_group()
