from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ....config import MegaKernelConfig


@dataclass(frozen=True)
class ReferenceMegaMoeConfig(MegaKernelConfig):
    """Pure-torch backend computing the reference semantics (``docs/numerics.md``) on any device.

    At ``world_size > 1`` it dispatches and combines with ``torch.distributed.all_to_all_single`` over the
    EP process group (gloo on CPU, NCCL on GPU): a true EP oracle. ``knobs`` is unused.
    """

    kernel_name: ClassVar[str] = "reference"
