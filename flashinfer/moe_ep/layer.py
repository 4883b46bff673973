"""The public layer: ``MoEEpLayer(...)`` builds a :class:`MoEEpMegaLayer` driving one mega backend."""

from __future__ import annotations

import dataclasses

import torch

from .backends.mega.base import MegaKernelBackend
from .config import BootstrapConfig, FleetParams, MegaConfig, MoEEpTensors, MoEWeightPack
from .core.validation import check_forward_inputs, check_live_tokens, check_topk_values
from .errors import MoEEpConfigError, MoEEpError, MoEEpInputError
from .modes.mega.registry import create_mega_kernel


class MoEEpMegaLayer:
    """An expert-parallel MoE layer in mega mode: one backend does dispatch, expert MLPs and combine.

    ``forward`` is collective at ``world_size > 1``: every rank of the EP group calls it (a rank with
    zero tokens too). ``check_values`` makes each forward verify topk id ranges / duplicates and weight
    finiteness, which synchronizes the device; it is skipped automatically during CUDA-graph capture.
    """

    def __init__(
        self,
        bootstrap: BootstrapConfig,
        fleet_params: FleetParams,
        weights: MoEWeightPack,
        backend: MegaConfig,
        *,
        check_values: bool = True,
    ) -> None:
        for name, value, cls in (
            ("bootstrap", bootstrap, BootstrapConfig),
            ("fleet_params", fleet_params, FleetParams),
            ("weights", weights, MoEWeightPack),
            ("backend", backend, MegaConfig),
        ):
            if not isinstance(value, cls):
                raise MoEEpConfigError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
        if not isinstance(check_values, bool):
            raise MoEEpConfigError(f"check_values must be a bool, got {check_values!r}")
        self.bootstrap = bootstrap
        self.fleet_params = fleet_params
        self.config = backend.megakernel
        self.device = bootstrap.resolved_device()
        self.check_values = check_values
        self._backend: MegaKernelBackend | None = create_mega_kernel(self.config, bootstrap, fleet_params, self.device)
        try:
            self._backend.preprocess_weights(weights)
            self._backend.allocate_workspace()
        except BaseException:
            self._backend.destroy()
            self._backend = None
            raise

    @property
    def backend(self) -> MegaKernelBackend:
        if self._backend is None:
            raise MoEEpError("this MoEEpMegaLayer was destroyed (destroy() releases it for good): build a new layer")
        return self._backend

    @property
    def kernel_name(self) -> str:
        return self.config.kernel_name

    def forward(self, tensors: MoEEpTensors, *, output: torch.Tensor | None = None) -> torch.Tensor:
        """Run the layer on this rank's tokens; returns ``[T, H]`` bf16 (``output`` if given).

        With ``tensors.num_tokens`` only the first ``num_tokens`` rows are live (see ``MoEEpTensors``);
        the other rows of the returned tensor are left as they were."""
        backend = self.backend
        if not isinstance(tensors, MoEEpTensors):
            raise MoEEpInputError(f"forward takes a MoEEpTensors, got {type(tensors).__name__}")
        c = self.config
        live_given = tensors.num_tokens is not None
        t = check_forward_inputs(
            tensors.hidden_states,
            tensors.topk_ids,
            tensors.topk_weights,
            hidden_size=c.hidden_size,
            top_k=c.top_k,
            num_experts=c.num_experts,
            max_tokens=self.fleet_params.max_tokens_per_rank,
            device=self.device,
            output=output,
            check_values=self.check_values and not live_given,
            input_format=c.input_format,
            scales=tensors.scales,
        )
        if output is None:
            output = torch.empty(t, c.hidden_size, dtype=torch.bfloat16, device=self.device)
        target = output
        if live_given:
            tensors, rows = self._live_rows(tensors, t)
            if rows is not None:  # host fallback: the backend runs on the live rows only
                target = output[:rows]
        backend.compute(backend.stage_inputs(tensors), target)
        return output

    def _live_rows(self, tensors: MoEEpTensors, t: int) -> tuple[MoEEpTensors, int | None]:
        """Validate ``tensors.num_tokens``. A backend that reads it on the device gets it as is (returns
        rows None); otherwise it is read here (a sync) and the inputs are cut to the live rows."""
        on_device = self.backend.device_live_tokens
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing and not on_device:
            raise MoEEpConfigError(
                f"{self.kernel_name} reads MoEEpTensors.num_tokens on the host, which a CUDA graph cannot "
                "replay; capture one graph per token count (or pass num_tokens=None)"
            )
        read = not on_device or (self.check_values and not capturing)
        live = check_live_tokens(tensors.num_tokens, t, self.device, read_value=read)
        if self.check_values and live:
            check_topk_values(tensors.topk_ids[:live], tensors.topk_weights[:live], self.config.num_experts)
        if on_device:
            return tensors, None
        assert live is not None
        cut = dataclasses.replace(
            tensors,
            hidden_states=tensors.hidden_states[:live],
            scales=None if tensors.scales is None else tensors.scales[:live],
            topk_ids=tensors.topk_ids[:live],
            topk_weights=tensors.topk_weights[:live],
            num_tokens=None,
        )
        return cut, live

    __call__ = forward

    def check_transport(self) -> None:
        """Wait for this rank's last forward and raise ``MoEEpTransportError`` (stage, peer, forward) if a
        cross-rank wait in it expired. ``forward`` also raises for an earlier forward that is known to
        have failed, without waiting."""
        self.backend.check_transport()

    def recover_transport(self) -> None:
        """Collective (every rank of the EP group calls it) after a ``MoEEpTransportError``: waits for
        this rank's work and resynchronizes the ranks' protocol state; the next forward runs normally."""
        self.backend.recover_transport()

    def warmup(self) -> None:
        """Compile or load kernels and run them once (call before serving and before graph capture)."""
        self.backend.warmup()

    def destroy(self) -> None:
        """Release the backend's workspaces and kernels. Idempotent; the layer is unusable after it."""
        if self._backend is not None:
            self._backend.destroy()
            self._backend = None


def MoEEpLayer(  # noqa: N802  (a factory named like the class it stands for, as in FlashInfer)
    bootstrap: BootstrapConfig,
    fleet_params: FleetParams,
    weights: MoEWeightPack,
    backend: MegaConfig,
    **kwargs: object,
) -> MoEEpMegaLayer:
    """Build the EP MoE layer for ``backend``. Only the mega mode exists: returns a :class:`MoEEpMegaLayer`."""
    if not isinstance(backend, MegaConfig):
        raise MoEEpConfigError(f"backend must be a MegaConfig(megakernel=...), got {type(backend).__name__}")
    return MoEEpMegaLayer(bootstrap, fleet_params, weights, backend, **kwargs)  # type: ignore[arg-type]


__all__ = ["MoEEpLayer", "MoEEpMegaLayer"]
