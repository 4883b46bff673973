"""The block-scaled expert-parallel frontend (MXFP8 and NVFP4 share it): ``Sm90MegaMoEQuantEpKernel``
through the shared frontend core, with the EP buffers and rank state of the BF16 EP frontend
(``bf16_ep.EpFrontendMixin``, ``bf16_ep.EpRankState``) and the weight packing of the world-size-1
block-scaled frontend (``quant.QuantFrontend.prepare_weights``, this rank's experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import kernel_helpers as kh
from .bf16_ep import EpFrontendMixin
from .quant import PackedQuantWeights, QuantFrontend, QuantKnobs


@dataclass(frozen=True)
class QuantEpKnobs(QuantKnobs):
    """``QuantKnobs`` plus the EP ones: ``world_size``, ``ranks_per_gpu`` (R for loopback, else 1),
    ``dispatch`` (``"pull"`` or ``"push"``; every rank of a layer must use the same one). No GEMM
    clusters (``cluster_m`` is 1)."""

    world_size: int = 1
    ranks_per_gpu: int = 1
    dispatch: str = "pull"

    @property
    def cluster_m(self) -> int:
        return 1

    @property
    def grid(self) -> int:
        return max(1, self.num_sms // self.ranks_per_gpu)


class QuantEpFrontend(EpFrontendMixin, QuantFrontend):
    """``geometry.num_experts`` is GLOBAL; ``prepare_weights`` takes this rank's experts (the local
    slice of the checkpoint tensors)."""

    def __init__(self, geometry: Any, knobs: QuantEpKnobs, **kw: Any) -> None:
        super().__init__(geometry, knobs, **kw)

    def check(self) -> None:
        self.check_ep()
        super().check()
        if self.knobs.gather_in_fc1:
            raise ValueError("gather_in_fc1 is a world-size-1 knob (the EP dispatch moves prepared rows already)")
        if self.knobs.swap_split_k != 1:
            raise ValueError("swap_split_k is a world-size-1 knob (the EP kernel has no split-K workspace)")
        if self.knobs.fc2_early_weights or self.knobs.fc1_early_weights or self.knobs.gather_early_rows:
            raise ValueError(
                "fc1_early_weights, fc2_early_weights and gather_early_rows are world-size-1 knobs (the EP "
                "kernels follow their own protocol)"
            )
        if self.knobs.gemv:
            raise ValueError("gemv is a world-size-1 knob (the EP kernels keep the swap-AB GEMMs)")
        if self.knobs.swap_tma_store:
            raise ValueError("swap_tma_store is a world-size-1 knob (not built into the EP kernels)")

    def _export(self, out_dir: Path, function_name: str) -> Path:
        g, k = self.geometry, self.knobs
        ep = {"world_size": k.world_size, "ranks_per_gpu": k.ranks_per_gpu, "dispatch": k.dispatch}
        kernel = kh.Sm90MegaMoEQuantEpKernel(**self.kernel_kwargs(), **ep, combine_dtype=g.combine_dtype)
        return kh.export_moe_quant_ep(kernel, g.hidden, g.intermediate, g.num_experts, g.top_k, out_dir, function_name)

    @staticmethod
    def operands(
        x: torch.Tensor,
        x_scale: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        weights: PackedQuantWeights,
        act_gscale: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """The kernel's arguments before ``out`` (for ``EpRankState.launch``): as
        ``QuantFrontend.launch`` takes them (``x`` bf16, or codes with their scales in ``x_scale``)."""
        w = weights
        return (x, x_scale, topk_ids, topk_weights, w.w13, w.w13_scale, w.w2, w.w2_scale, w.w13_gscale,
                w.w2_gscale, act_gscale)  # fmt: skip

    def launch(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise TypeError("an EP kernel launches through its rank state: EpRankState.launch(fn, operands, ...)")


__all__ = ["QuantEpFrontend", "QuantEpKnobs"]
