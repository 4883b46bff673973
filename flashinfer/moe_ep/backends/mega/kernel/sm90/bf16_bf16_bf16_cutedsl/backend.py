"""The SM90 BF16 backend: weight layouts, workspace, launch through the drop's BF16 frontend."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ......config import MoEEpTensors, MoEWeightPack
from ......errors import MoEEpConfigError
from ....base import MegaKernelBackend
from ..runtime import (
    SIZE_ALIGNMENT,
    acquire_pooled_workspace,
    load_kernel,
    pool_owner,
    release_pooled_workspace,
    sm90_requirements,
    warmup_forward,
)
from . import tuning
from .config import Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig


def _bucket_of(tokens: int) -> str:
    """The drop's token bucket of ``tokens`` (imported on first use: importing the backend never
    imports the drop)."""
    global _BUCKET_OF
    if _BUCKET_OF is None:
        from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import tuner

        _BUCKET_OF = tuner.bucket_of
    return _BUCKET_OF(tokens)


_BUCKET_OF: Any = None


def make_frontend(config: Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig, num_local_experts: int) -> Any:
    """The drop's BF16 frontend for ``config``'s explicit knobs, else the base defaults (``None`` and
    ``"auto"``); used by the build and bench commands. A layer uses ``tuning.layer_profiles``."""
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

    geometry = tuning.make_geometry(config, num_local_experts)
    explicit = config.knobs is not None and config.knobs != tuning.AUTO
    frontend = drop.Bf16Frontend(geometry, tuning._as_knobs(config, geometry, config.knobs) if explicit else None)
    try:
        frontend.check()
    except ValueError as exc:
        raise MoEEpConfigError(f"{config.kernel_name}: {exc}") from None
    return frontend


class Sm90Bf16CutedslBackend(MegaKernelBackend):
    config_cls = Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig
    hidden_alignment: ClassVar[int] = SIZE_ALIGNMENT
    intermediate_alignment: ClassVar[int] = SIZE_ALIGNMENT

    @classmethod
    def runtime_requirements(cls, device: torch.device) -> list[str]:
        return sm90_requirements(device)

    def __new__(cls, config: Any, bootstrap: Any, *args: Any, **kwargs: Any) -> Sm90Bf16CutedslBackend:
        if cls is Sm90Bf16CutedslBackend and getattr(bootstrap, "world_size", 1) > 1:
            from .ep_backend import Sm90Bf16EpBackend  # world_size > 1: the in-kernel EP protocol

            return super().__new__(Sm90Bf16EpBackend)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # One frontend per token bucket, chosen per forward from the host-side T (tuning.py).
        self.profiles = tuning.layer_profiles(
            self.config, self.num_local_experts, self.fleet.max_tokens_per_rank, self._tune_context()
        )
        self.frontend = self.profiles.primary  # its layout knobs are the weights' layout
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self.workspace: dict[str, torch.Tensor] = {}
        self._by_bucket: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}
        self._tune_weights: MoEWeightPack | None = None  # natural layouts, kept until knobs="auto" tunes

    def _tune_context(self) -> Any:
        return tuning.tune_context(self.device, self.world_size)

    def preprocess_weights(self, weights: MoEWeightPack) -> None:
        c = self.config
        self.check_unquantized_weights(weights, torch.bfloat16)
        self.w13, self.w2 = self.frontend.prepare_weights(weights.w13, weights.w2)
        if c.knobs == tuning.AUTO:
            self._tune_weights = weights

    def allocate_workspace(self) -> None:
        """The pooled workspace (``runtime.acquire_pooled_workspace``) of every token bucket's kernel."""
        frontends = self.profiles.distinct()
        self._workspace_key, ws_of = acquire_pooled_workspace(
            frontends, self.fleet.max_tokens_per_rank, self.device, pool_owner(self)
        )
        self._by_bucket = {name: (fe, ws_of[id(fe)]) for name, fe in self.profiles.frontends.items()}
        self.workspace = ws_of[id(self.frontend)]

    def _autotune(self) -> None:
        """knobs="auto": tune every bucket, record the winners, re-lay weights and workspace."""
        c, weights = self.config, self._tune_weights
        assert weights is not None, "preprocess_weights keeps the natural weights for knobs='auto'"
        cap = self.fleet.max_tokens_per_rank
        from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import tuner

        results = tuning.autotune_profiles(
            c,
            self.num_local_experts,
            [tuner.tune_tokens(b, cap) for b in self.profiles.buckets],
            weights.w13,
            weights.w2,
            self.device,
            context=self._tune_context(),
            rank=self.bootstrap.rank,
            world_size=self.world_size,
        )
        self.profiles = tuning.layer_profiles(
            c,
            self.num_local_experts,
            cap,
            self._tune_context(),
            chosen={name: r.winner for name, r in results.items()},
        )
        self.frontend = self.profiles.primary
        self.destroy()  # releases weights and workspace; both are rebuilt for the winners
        self.preprocess_weights(weights)
        self.allocate_workspace()
        self._tune_weights = None

    def warmup(self) -> None:
        if self._tune_weights is not None:
            self._autotune()
        for fe in self.profiles.distinct():
            load_kernel(fe)
        warmup_forward(self)

    def frontend_for(self, tokens: int) -> Any:
        """The drop frontend (kernel and knobs) that serves a forward of ``tokens`` rows: its token
        bucket's (``scripts/drop_ab.py --bucket-overrides`` starts from its knobs)."""
        return self._by_bucket[_bucket_of(tokens)][0]

    def compute(self, staged: MoEEpTensors, output: torch.Tensor) -> torch.Tensor:
        t = staged.hidden_states.shape[0]
        if t == 0:
            return output  # nothing to do at world size 1
        frontend, workspace = self._by_bucket[_bucket_of(t)]  # a host-side shape: no device sync
        load_kernel(frontend)
        return frontend.launch(
            staged.hidden_states, staged.topk_ids, staged.topk_weights, self.w13, self.w2, output, workspace
        )

    def destroy(self) -> None:
        self.w13 = self.w2 = None
        if self.workspace:
            release_pooled_workspace(self._workspace_key)
        self.workspace = {}
        self._by_bucket = {}


__all__ = ["Sm90Bf16CutedslBackend", "make_frontend"]
