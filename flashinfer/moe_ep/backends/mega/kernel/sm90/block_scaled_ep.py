"""The SM90 MXFP8 and NVFP4 backends at ``world_size > 1``: the drop's in-kernel EP protocol (the BF16
EP kernel's route, dispatch and combine, docs/ep.md) around the block-scaled GEMMs
(``Sm90MegaMoEQuantEpKernel``).

Each rank quantizes its own tokens once (or dequantizes the pre-quantized codes) into its symmetric
row buffer; the dispatch moves those exact BF16 values to the experts' owners, which run the
world-size-1 block-scaled GEMMs on them (FC1, requantization to the FC2 input format, FC2); the
combine reads bf16 y from the owners. The result is the semantics of
``core.reference_quant.moe_reference_quantized`` at every world size (with the ``combine_dtype`` wire's
rounding where it is mxfp8).

Token buckets: the world-size-1 ``BUCKETS`` at the GLOBAL token count ``world_size * T`` over the
global experts (``block_scaled.ep_token_bucket``), picked per forward from this rank's rows; every
bucket's kernel shares the rank's one EP state. Knobs: ``None`` (the bucket defaults) or a dict of tile
knobs (every bucket) and ``dispatch`` (``"pull"``, the default, or ``"push"``: the layer's, every bucket
uses it, since ranks of one forward may sit in different buckets). No autotune and no knob cache yet.

Transport errors, recovery, CUDA graphs and workspace pooling: as the BF16 EP backend
(``ep_runtime.EpRankRuntime``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .....config import MoEEpTensors
from .block_scaled import (
    BUCKETS,
    EpPlacement,
    Sm90BlockScaledBackend,
    bucket_frontends,
    ep_token_bucket,
)
from .ep_runtime import EpRankRuntime
from .runtime import load_kernel


class Sm90BlockScaledEpBackend(EpRankRuntime, Sm90BlockScaledBackend):
    """World size > 1 (NVSHMEM, or loopback ranks on one GPU). Weights: this rank's experts, as the
    world-size-1 backend takes them (preprocessing, weight checks: ``Sm90BlockScaledBackend``). Each
    format's backend has its EP subclass (``ep_backend``), which construction at ``world_size > 1``
    returns."""

    expert_parallel: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super(Sm90BlockScaledBackend, self).__init__(*args, **kwargs)  # the base class: no world-1 buckets
        b, c = self.bootstrap, self.config
        self.mode = "loopback" if b.symmetric_memory == "loopback" else "nvshmem"
        # the layer's dispatch; its value is checked with the knobs (QuantEpFrontend.check)
        self.placement = EpPlacement(b.world_size, self.ranks_per_gpu, (c.knobs or {}).get("dispatch", "pull"))
        self.frontends = bucket_frontends(c, self.num_local_experts, self.placement)
        self.frontend = self.frontends[BUCKETS[-1].name]  # the weight layout (every bucket packs alike)
        self.weights: Any = None
        self.act_gscale: torch.Tensor | None = None

    def distinct_frontends(self) -> list[Any]:
        return list(dict.fromkeys(self.frontends.values()))

    def warmup(self) -> None:
        """Loads every bucket's kernel (a forward is collective, so it cannot run one rank alone here)."""
        for fe in self.distinct_frontends():
            load_kernel(fe)

    def compute(self, staged: MoEEpTensors, output: torch.Tensor) -> torch.Tensor:
        c = self.config
        # the bucket of the rows given (a host shape; under a graph the captured rows, whatever num_tokens)
        rows = staged.hidden_states.shape[0]
        bucket = ep_token_bucket(rows, self.world_size, c.top_k, c.num_experts, c.weight_format, self.frontends)
        frontend = self.frontends[bucket]
        assert self.act_gscale is not None, "preprocess_weights sets the activation global scales"
        x, x_scale = staged.hidden_states, staged.scales
        if x_scale is None:  # bf16 input: the scale argument is not read
            x_scale = self.no_scales
        else:  # codes and scales as the kernel reads them (byte views, no copy)
            x, x_scale = x.view(torch.uint8), x_scale.view(torch.uint8)
        operands = frontend.operands(x, x_scale, staged.topk_ids, staged.topk_weights, self.weights, self.act_gscale)
        return self.launch_forward(frontend, operands, staged, output)

    def destroy(self) -> None:
        self.release_state()
        self.weights = None


__all__ = ["Sm90BlockScaledEpBackend"]
