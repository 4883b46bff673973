from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ....config import MegaKernelConfig
from ....core.reference_quant import FORMAT_BLOCK
from ....core.validation import is_positive_finite
from ....errors import MoEEpConfigError

#: weight formats the reference backend runs (``core.reference`` / ``core.reference_quant`` semantics).
REFERENCE_WEIGHT_FORMATS = ("bf16", "mxfp8", "nvfp4")


@dataclass(frozen=True)
class ReferenceMegaMoeConfig(MegaKernelConfig):
    """Pure-torch backend computing the reference semantics (``docs/numerics.md``) on any device.

    At ``world_size > 1`` it dispatches and combines with ``torch.distributed.all_to_all_single`` over the
    EP process group (gloo on CPU, NCCL on GPU): a true EP oracle. ``knobs`` is unused.

    Keyword-only fields:

    - ``weight_format``: ``"bf16"`` (default: the BF16 layer, weights bf16 / fp16 / fp32 without scales),
      ``"mxfp8"`` or ``"nvfp4"`` (the quantized layer of ``core.reference_quant``: the ``MoEWeightPack``
      carries packed weights and block scales, NVFP4 also per-expert global scales; hidden_size and
      intermediate_size must be multiples of 32 (MXFP8) or 16 (NVFP4)).
    - ``input_global_scale``, ``fc2_input_global_scale`` (NVFP4 only): static global scales of the FC1
      and FC2 inputs; ``None`` = dynamic, from the whole group's tensor of the forward (an amax
      all-reduce at ``world_size > 1``).
    - ``combine_dtype`` (``MegaKernelConfig``): the reference applies the wire's rounding to every
      expert output at every world size (its all-to-all still moves the rounded rows as bf16), so
      world 1 and EP give the same result.
    """

    kernel_name: ClassVar[str] = "reference"
    weight_format: str = field(default="bf16", kw_only=True)  # type: ignore[misc]  (a ClassVar in the base)
    input_global_scale: float | None = field(default=None, kw_only=True)
    fc2_input_global_scale: float | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        fmt = self.weight_format
        if fmt not in REFERENCE_WEIGHT_FORMATS:
            raise MoEEpConfigError(
                f"ReferenceMegaMoeConfig.weight_format must be one of {', '.join(REFERENCE_WEIGHT_FORMATS)}, "
                f"got {fmt!r}"
            )
        for name in ("input_global_scale", "fc2_input_global_scale"):
            value = getattr(self, name)
            if value is None:
                continue
            if fmt != "nvfp4":
                raise MoEEpConfigError(f"ReferenceMegaMoeConfig.{name} is for weight_format='nvfp4' only (got {fmt!r})")
            if not is_positive_finite(value):
                raise MoEEpConfigError(f"ReferenceMegaMoeConfig.{name} must be a finite float > 0, got {value!r}")
        if fmt in FORMAT_BLOCK:
            block = FORMAT_BLOCK[fmt]
            for name in ("hidden_size", "intermediate_size"):
                if getattr(self, name) % block:
                    raise MoEEpConfigError(
                        f"weight_format={fmt!r} needs {name} to be a multiple of {block} (the block size), "
                        f"got {getattr(self, name)}"
                    )
