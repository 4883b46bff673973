"""The contract between the mega layer and a backend.

The layer calls, in this order: ``runtime_requirements`` (class level: what is missing here),
``__init__`` (config checks), ``preprocess_weights`` (once, into the backend's layouts),
``allocate_workspace`` (once), then per forward ``stage_inputs`` and ``compute``; ``warmup`` before
serving and ``destroy`` at the end. A backend raises only ``MoEEpError`` subclasses, and must leave
itself usable after rejecting a call.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

from ...config import BootstrapConfig, FleetParams, MegaKernelConfig, MoEEpTensors, MoEWeightPack
from ...core.reference_quant import QuantizedExpertWeights, quantize_expert_weights
from ...core.validation import check_expert_weights
from ...errors import MoEEpBackendUnavailableError, MoEEpConfigError, MoEEpInputError

#: the scale fields of a ``MoEWeightPack`` (all None: unquantized weights)
_SCALE_FIELDS = ("w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale")


class MegaKernelBackend(abc.ABC):
    """Base class of every mega backend. Subclasses set ``config_cls``."""

    config_cls: ClassVar[type[MegaKernelConfig]]
    #: hidden / intermediate sizes must be multiples of these (kernel tile and vector constraints).
    hidden_alignment: ClassVar[int] = 1
    intermediate_alignment: ClassVar[int] = 1
    #: True: ``compute`` passes ``MoEEpTensors.num_tokens`` to the device (graph-replayable live counts);
    #: False: the layer reads it on the host and hands ``compute`` the live rows only.
    device_live_tokens: ClassVar[bool] = False

    def __init__(
        self,
        config: MegaKernelConfig,
        bootstrap: BootstrapConfig,
        fleet: FleetParams,
        device: torch.device,
    ) -> None:
        if not isinstance(config, self.config_cls):
            raise MoEEpConfigError(
                f"{type(self).__name__} needs a {self.config_cls.__name__}, got {type(config).__name__}"
            )
        self.config = config
        self.bootstrap = bootstrap
        self.fleet = fleet
        self.device = device
        self.check_geometry()  # first: a geometry error is reported on any machine
        missing = self.runtime_requirements(device)
        if missing:
            raise MoEEpBackendUnavailableError(
                f"backend {config.kernel_name!r} cannot run on {device}: "
                + "; ".join(missing)
                + " (`python -m flashinfer.moe_ep doctor` lists what runs here; ReferenceMegaMoeConfig runs anywhere)"
            )

    # -- class-level ------------------------------------------------------------------------------
    @classmethod
    def runtime_requirements(cls, device: torch.device) -> list[str]:
        """Human-readable list of what this backend needs and ``device``/this machine lacks ([] = ok)."""
        return []

    # -- construction -----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.bootstrap.world_size

    @property
    def num_local_experts(self) -> int:
        return self.config.num_experts // self.bootstrap.world_size

    def check_geometry(self) -> None:
        c, f = self.config, self.fleet
        if c.hidden_size != f.token_hidden_size:
            raise MoEEpConfigError(
                f"backend hidden_size={c.hidden_size} differs from FleetParams.token_hidden_size={f.token_hidden_size}"
            )
        if c.num_experts != f.num_experts:
            raise MoEEpConfigError(
                f"backend num_experts={c.num_experts} differs from FleetParams.num_experts={f.num_experts}"
            )
        if c.num_experts % self.bootstrap.world_size:
            raise MoEEpConfigError(
                f"num_experts={c.num_experts} is not divisible by world_size={self.bootstrap.world_size}"
            )
        for name, value, align in (
            ("hidden_size", c.hidden_size, self.hidden_alignment),
            ("intermediate_size", c.intermediate_size, self.intermediate_alignment),
        ):
            if value % align:
                raise MoEEpConfigError(
                    f"backend {c.kernel_name!r} needs {name} to be a multiple of {align}, got {value}"
                )

    @abc.abstractmethod
    def preprocess_weights(self, weights: MoEWeightPack) -> None:
        """Validate this rank's weights and convert them into the backend's layouts (once)."""

    def check_unquantized_weights(self, weights: MoEWeightPack, dtype: torch.dtype | tuple[torch.dtype, ...]) -> None:
        """For backends taking plain (unscaled) weights: no scales; shapes, dtype, device, finiteness."""
        c = self.config
        given = [n for n in _SCALE_FIELDS if getattr(weights, n) is not None]
        if given:
            raise MoEEpInputError(
                f"backend {c.kernel_name!r} takes unquantized weights; got {', '.join('weights.' + n for n in given)} "
                "(quantized packs: a config with weight_format='mxfp8' / 'nvfp4', or the MXFP8 / NVFP4 backends)"
            )
        check_expert_weights(
            weights.w13,
            weights.w2,
            num_local_experts=self.num_local_experts,
            fc1_rows=c.fc1_rows,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            dtype=dtype,
            device=self.device,
        )

    def check_quantized_weights(self, weights: MoEWeightPack, fmt: str) -> QuantizedExpertWeights:
        """For backends taking MXFP8 / NVFP4 packs: the scales are there (NVFP4: the global scales too),
        then shapes, dtypes and device of every tensor (``QuantizedExpertWeights.check``).

        A pack of unquantized weights (bf16 / fp16 / fp32, no scale at all) is quantized here, once, with
        ``core.reference_quant.quantize_expert_weights`` (NVFP4: one global scale per expert and matrix)."""
        c = self.config
        floats = (torch.bfloat16, torch.float16, torch.float32)
        unquantized = all(getattr(weights, n) is None for n in _SCALE_FIELDS) and all(
            isinstance(w, torch.Tensor) and w.dtype in floats for w in (weights.w13, weights.w2)
        )
        if unquantized:
            self.check_unquantized_weights(weights, floats)  # the user's shapes, before they are quantized
            q = quantize_expert_weights(weights.w13, weights.w2, fmt)
        else:
            missing = [n for n in ("w13_scale", "w2_scale") if getattr(weights, n) is None]
            if fmt == "nvfp4":
                missing += [n for n in ("w13_global_scale", "w2_global_scale") if getattr(weights, n) is None]
            if missing:
                raise MoEEpInputError(
                    f"{c.kernel_name} with {fmt} weights needs their scales; missing: "
                    f"{', '.join('weights.' + n for n in missing)} (or pass unquantized weights without scales: "
                    "they are quantized at preprocessing)"
                )
            q = QuantizedExpertWeights(
                fmt,
                weights.w13,
                weights.w13_scale,  # type: ignore[arg-type]
                weights.w2,
                weights.w2_scale,  # type: ignore[arg-type]
                weights.w13_global_scale,
                weights.w2_global_scale,
            )
        q.check(
            num_local_experts=self.num_local_experts,
            fc1_rows=c.fc1_rows,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            device=self.device,
        )
        return q

    def allocate_workspace(self) -> None:
        """Allocate buffers sized from ``FleetParams.max_tokens_per_rank`` (once)."""

    # -- per forward ------------------------------------------------------------------------------
    def stage_inputs(self, tensors: MoEEpTensors) -> Any:
        """Turn validated inputs into what ``compute`` launches on (copies into symmetric buffers, ...)."""
        return tensors

    @abc.abstractmethod
    def compute(self, staged: Any, output: torch.Tensor) -> torch.Tensor:
        """Run the layer into ``output`` [T, H] bf16 and return it."""

    def check_transport(self) -> None:
        """Wait for the last forward; raise ``MoEEpTransportError`` if a cross-rank wait expired in it."""

    def recover_transport(self) -> None:
        """Collective, after a ``MoEEpTransportError``: bring every rank's cross-rank state back in step."""

    # -- lifetime ---------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile/load kernels and run once so the first served forward pays nothing extra."""

    def destroy(self) -> None:
        """Release workspaces and kernels. Idempotent."""


__all__ = ["MegaKernelBackend"]
