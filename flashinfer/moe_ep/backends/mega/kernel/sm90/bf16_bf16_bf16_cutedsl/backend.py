"""The SM90 BF16 backend: weight layouts, workspace, launch through the drop's BF16 frontend."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ......config import MoEEpTensors, MoEWeightPack
from ......core.validation import check_expert_weights
from ......errors import MoEEpBackendUnavailableError, MoEEpConfigError, MoEEpInputError
from ....base import MegaKernelBackend
from ..runtime import sm90_requirements
from .config import Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig


def make_frontend(config: Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig, num_local_experts: int) -> Any:
    """The drop's BF16 frontend for ``config`` (also used by the build and bench commands)."""
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

    geometry = drop.Geometry(
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        num_experts=num_local_experts,
        top_k=config.top_k,
        activation=config.activation,
        activation_limit=config.activation_spec.effective_limit,
    )
    knobs = config.knobs
    if isinstance(knobs, dict):
        try:
            knobs = drop.Bf16Knobs(**{**drop.default_bf16_knobs(geometry).__dict__, **knobs})
        except TypeError as exc:
            raise MoEEpConfigError(f"bad knobs for {config.kernel_name}: {exc}") from None
    frontend = drop.Bf16Frontend(geometry, knobs)
    try:
        frontend.check()
    except ValueError as exc:
        raise MoEEpConfigError(f"{config.kernel_name}: {exc}") from None
    return frontend


class Sm90Bf16CutedslBackend(MegaKernelBackend):
    config_cls = Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig
    hidden_alignment: ClassVar[int] = 64
    intermediate_alignment: ClassVar[int] = 64

    @classmethod
    def runtime_requirements(cls, device: torch.device) -> list[str]:
        return sm90_requirements(device)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.world_size != 1:
            raise MoEEpConfigError(
                f"{self.config.kernel_name} runs at world_size 1 for now (got {self.world_size}); "
                "use the reference backend for EP"
            )
        self.frontend = make_frontend(self.config, self.num_local_experts)
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self.workspace: dict[str, torch.Tensor] = {}

    def preprocess_weights(self, weights: MoEWeightPack) -> None:
        c = self.config
        if weights.w13_scale is not None or weights.w2_scale is not None:
            raise MoEEpInputError(f"{c.kernel_name} takes bf16 weights; got weight scales")
        check_expert_weights(
            weights.w13,
            weights.w2,
            num_local_experts=self.num_local_experts,
            fc1_rows=c.fc1_rows,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            dtype=torch.bfloat16,
            device=self.device,
        )
        self.w13, self.w2 = self.frontend.prepare_weights(weights.w13, weights.w2)

    def allocate_workspace(self) -> None:
        """One workspace per (kernel variant, capacity, device), shared by every layer that matches."""
        from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm

        cap = self.fleet.max_tokens_per_rank
        self._workspace_key = (self.frontend.key.digest(), cap, str(self.device))

        def make() -> dict[str, torch.Tensor]:
            with torch.cuda.device(self.device):
                return self.frontend.allocate_workspace(cap, self.device)

        self.workspace = comm.WORKSPACES.acquire(self._workspace_key, make)

    def _load(self) -> None:
        from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import KernelUnavailableError

        try:
            self.frontend.load()
        except KernelUnavailableError as exc:
            raise MoEEpBackendUnavailableError(str(exc)) from None

    def warmup(self) -> None:
        self._load()
        c = self.config
        t = min(8, self.fleet.max_tokens_per_rank)
        x = torch.randn(t, c.hidden_size, device=self.device).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(c.num_experts, device=self.device)[: c.top_k] for _ in range(t)]).int()
        w = torch.rand(t, c.top_k, device=self.device)
        out = torch.empty(t, c.hidden_size, dtype=torch.bfloat16, device=self.device)
        self.compute(MoEEpTensors(x, ids, w), out)
        torch.cuda.synchronize(self.device)

    def compute(self, staged: MoEEpTensors, output: torch.Tensor) -> torch.Tensor:
        if staged.hidden_states.shape[0] == 0:
            return output  # nothing to do at world size 1
        self._load()
        return self.frontend.launch(
            staged.hidden_states, staged.topk_ids, staged.topk_weights, self.w13, self.w2, output, self.workspace
        )

    def destroy(self) -> None:
        from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm

        self.w13 = self.w2 = None
        if self.workspace:
            comm.WORKSPACES.release(self._workspace_key)
        self.workspace = {}


__all__ = ["Sm90Bf16CutedslBackend", "make_frontend"]
