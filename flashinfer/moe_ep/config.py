"""Public configuration and tensor containers (names follow FlashInfer's moe_ep)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .core.activations import ActivationSpec, fc1_rows
from .core.reference import COMBINE_DTYPES
from .core.validation import is_positive_finite
from .errors import MoEEpConfigError


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, value: Any) -> None:
    if not _is_int(value) or value <= 0:
        raise MoEEpConfigError(f"{name} must be a positive int, got {value!r}")


@dataclass
class BootstrapConfig:
    """Where this rank lives in the expert-parallel group.

    ``process_group``: the EP group (torch.distributed); ``None`` means the default group when
    ``world_size > 1``. ``device``: this rank's device (default: the current CUDA device, else CPU).
    ``transport_timeout_s``: deadline of every cross-rank wait: the kernels' spin-waits, and the
    reference backend's torch.distributed collectives (a rank waits there while the others compute: raise
    it for CPU runs whose ranks compute longer than that between two exchanges).
    ``symmetric_memory``: where kernel backends put cross-rank buffers at ``world_size > 1``: ``auto``
    (= ``nvshmem``: one process per GPU, after ``bootstrap_moe_ep_runtime``) or ``loopback``
    (``world_size`` logical ranks inside one process on one GPU, sharing ``loopback_group`` from
    ``make_loopback_group``: for testing the cross-rank protocol on a single GPU; not a performance
    mode). The reference backend ignores both (it uses torch.distributed).
    """

    world_size: int = 1
    rank: int = 0
    device: torch.device | str | int | None = None
    process_group: Any = None
    local_rank: int | None = None
    transport_timeout_s: float = 30.0
    symmetric_memory: str = "auto"
    loopback_group: Any = None

    def __post_init__(self) -> None:
        if self.symmetric_memory not in ("auto", "nvshmem", "loopback"):
            raise MoEEpConfigError(
                f"BootstrapConfig.symmetric_memory must be auto, nvshmem or loopback, got {self.symmetric_memory!r}"
            )
        if self.symmetric_memory == "loopback" and self.loopback_group is None:
            raise MoEEpConfigError(
                "symmetric_memory='loopback' needs loopback_group=make_loopback_group(world, device)"
            )
        _positive_int("BootstrapConfig.world_size", self.world_size)
        if not _is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise MoEEpConfigError(
                f"BootstrapConfig.rank must be in [0, {self.world_size}) (an int), got {self.rank!r}"
            )
        if self.local_rank is not None and not (_is_int(self.local_rank) and self.local_rank >= 0):
            raise MoEEpConfigError(f"BootstrapConfig.local_rank must be None or an int >= 0, got {self.local_rank!r}")
        if not is_positive_finite(self.transport_timeout_s):
            raise MoEEpConfigError(
                f"BootstrapConfig.transport_timeout_s must be a finite number of seconds > 0, "
                f"got {self.transport_timeout_s!r}"
            )
        if self.process_group is not None and not all(
            callable(getattr(self.process_group, m, None)) for m in ("size", "rank")
        ):
            raise MoEEpConfigError(
                "BootstrapConfig.process_group must be a torch.distributed ProcessGroup or None, got "
                f"{self.process_group!r}"
            )
        self._requested_device()  # raises MoEEpConfigError for a device torch cannot name

    def _requested_device(self) -> torch.device | None:
        """``device`` as a torch.device (None: not given); only CPU and CUDA devices are served."""
        d = self.device
        if d is None:
            return None
        if _is_int(d):
            if d < 0:
                raise MoEEpConfigError(f"BootstrapConfig.device must be a CUDA index >= 0, got {d}")
            return torch.device("cuda", d)
        if not isinstance(d, (str, torch.device)):
            raise MoEEpConfigError(f"BootstrapConfig.device must be a torch.device, a str or an int, got {d!r}")
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise MoEEpConfigError(f"BootstrapConfig.device {d!r} is not a device torch knows: {exc}") from None
        if dev.type not in ("cpu", "cuda"):
            raise MoEEpConfigError(f"BootstrapConfig.device must be a CPU or CUDA device, got {dev}")
        return dev

    def resolved_device(self) -> torch.device:
        """This rank's device, with its index for CUDA ("cuda" means the current device). Raises
        MoEEpConfigError for a CUDA device this machine does not have."""
        dev = self._requested_device()
        if dev is None:
            if torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise MoEEpConfigError(
                    f"BootstrapConfig.device={self.device!r} asks for CUDA, but torch sees no CUDA device here "
                    f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use device='cpu' for the "
                    "reference backend"
                )
            if dev.index is None:
                return torch.device("cuda", torch.cuda.current_device())
            if dev.index >= torch.cuda.device_count():
                raise MoEEpConfigError(
                    f"BootstrapConfig.device={self.device!r}: this machine has {torch.cuda.device_count()} CUDA devices"
                )
        return dev


@dataclass(frozen=True)
class FleetParams:
    """Geometry shared by every rank: global expert count, per-rank token capacity, hidden size."""

    num_experts: int
    max_tokens_per_rank: int
    token_hidden_size: int

    def __post_init__(self) -> None:
        _positive_int("FleetParams.num_experts", self.num_experts)
        _positive_int("FleetParams.max_tokens_per_rank", self.max_tokens_per_rank)
        _positive_int("FleetParams.token_hidden_size", self.token_hidden_size)


@dataclass(frozen=True)
class MegaKernelConfig:
    """Base of every mega backend config. Subclasses set ``kernel_name`` (the registry key).

    ``knobs``: backend-specific compile/launch knobs (``None`` = defaults); see each backend.
    ``share_workspace``: kernel backends let layers of one geometry (same kernels, capacity, device, EP
    group and rank) share one refcounted workspace, so a 60-layer model pays for one (at world size
    > 1 that includes the symmetric heap). Sharing is safe for layers that run one after another on
    one stream; set False for a layer that may run concurrently with another of its geometry.
    ``combine_dtype``: the format of the expert outputs on their way back to the token's rank (the EP
    combine wire): ``"bf16"`` (default, exact) or ``"mxfp8"`` (E4M3 with a UE8M0 scale per 32 along H,
    1 + 1/32 bytes per element instead of 2; ``core.reference.combine_wire``). The reference backend
    applies its rounding at every world size; the SM90 kernels have the wire at ``world_size > 1``
    and refuse ``"mxfp8"`` at world size 1 (no wire there).
    """

    kernel_name: ClassVar[str] = ""
    #: weight format the backend consumes (``bf16``, ``mxfp8``, ``nvfp4``).
    weight_format: ClassVar[str] = "bf16"

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    activation: str = "swiglu"
    activation_limit: float | None = None
    knobs: Any = None
    share_workspace: bool = field(default=True, kw_only=True)
    combine_dtype: str = field(default="bf16", kw_only=True)

    def __post_init__(self) -> None:
        for f in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
            _positive_int(f"{type(self).__name__}.{f}", getattr(self, f))
        if self.combine_dtype not in COMBINE_DTYPES:
            raise MoEEpConfigError(
                f"{type(self).__name__}.combine_dtype must be one of {', '.join(COMBINE_DTYPES)}, "
                f"got {self.combine_dtype!r}"
            )
        if self.combine_dtype == "mxfp8" and self.hidden_size % 32:
            raise MoEEpConfigError(
                f"combine_dtype='mxfp8' needs hidden_size to be a multiple of 32, got {self.hidden_size}"
            )
        if self.top_k > self.num_experts:
            raise MoEEpConfigError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if not isinstance(self.share_workspace, bool):
            raise MoEEpConfigError(f"share_workspace must be a bool, got {self.share_workspace!r}")
        ActivationSpec(self.activation, self.activation_limit)  # validates

    @property
    def activation_spec(self) -> ActivationSpec:
        return ActivationSpec(self.activation, self.activation_limit)

    @property
    def input_format(self) -> str:
        """How ``MoEEpTensors.hidden_states`` arrive: ``"bf16"``, or pre-quantized in a block-scaled
        format (codes in ``hidden_states``, block scales in ``scales``) where the config says so."""
        return "bf16"

    @property
    def fc1_rows(self) -> int:
        return fc1_rows(self.activation, self.intermediate_size)

    def replace(self, **changes: Any) -> MegaKernelConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class MegaConfig:
    """Selects the fused "mega" mode with one backend config (``megakernel``)."""

    megakernel: MegaKernelConfig

    def __post_init__(self) -> None:
        if not isinstance(self.megakernel, MegaKernelConfig):
            raise MoEEpConfigError(
                f"MegaConfig.megakernel must be a backend config (a MegaKernelConfig), got {type(self.megakernel)!r}"
            )


@dataclass
class MoEWeightPack:
    """This rank's expert weights.

    ``w13`` [E_local, 2I, H]: gate rows then up rows (``[E_local, I, H]`` for non-gated relu2);
    ``w2`` [E_local, H, I]. Quantized formats also carry ``*_scale`` (and ``*_global_scale`` for NVFP4).
    """

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_global_scale: torch.Tensor | None = None
    w2_global_scale: torch.Tensor | None = None


@dataclass
class MoEEpTensors:
    """One forward's inputs on this rank: ``hidden_states`` [T, H] bf16, ``topk_ids`` [T, k] int32
    (global expert ids), ``topk_weights`` [T, k] fp32. ``scales``: None, or for a layer whose config takes
    pre-quantized activations (``MegaKernelConfig.input_format`` not ``"bf16"``: the SM90 block-scaled
    configs with ``prequantized_input=True``) their block scales, ``hidden_states`` then holding the codes
    (layouts: ``core.validation.PREQUANTIZED_LAYOUTS``).

    ``num_tokens``: optional live token count, an int32 tensor of one element on the layer's device.
    Only the first ``num_tokens`` rows are live: the other input rows are never read and the matching
    output rows are left untouched. Backends that read it on the device (``MegaKernelBackend.
    device_live_tokens``: the SM90 kernel backends, BF16, MXFP8 and NVFP4, at world size > 1) let a
    CUDA graph captured with T-row buffers replay with any live count in [0, T]; the others read it on
    the host (a device synchronization; refused during graph capture)."""

    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    scales: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    num_tokens: torch.Tensor | None = None


__all__ = [
    "BootstrapConfig",
    "FleetParams",
    "MegaConfig",
    "MegaKernelConfig",
    "MoEEpTensors",
    "MoEWeightPack",
]
