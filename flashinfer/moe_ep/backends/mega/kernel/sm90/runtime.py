"""What every SM90 CuTe DSL backend shares: run-time requirements (checked without importing a drop),
the drop geometry of a config, workspaces from the refcounted pool, loading a kernel and the warm-up
forward."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from .....config import MoEEpTensors
from .....core.quant import quantize_activations
from .....errors import MoEEpBackendUnavailableError, MoEEpConfigError

#: hidden and intermediate sizes of every SM90 kernel: multiples of the K tile (checked by the configs at
#: construction and, as every backend's alignment, by ``MegaKernelBackend.check_geometry``)
SIZE_ALIGNMENT = 64


def check_kernel_config(
    config: Any, known_knobs: list[str], modes: tuple[str, ...] = (), knob_class: type | None = None
) -> None:
    """What an SM90 kernel config can be told wrong at construction, on any machine: hidden and
    intermediate sizes (multiples of 64) and ``knobs`` (None, one of ``modes``, a ``knob_class``
    instance, or a dict of known knob names). Knob values are checked where the geometry meets the rank
    count: building the layer (or ``python -m flashinfer.moe_ep build`` for a contract)."""
    name = type(config).__name__
    for field_name in ("hidden_size", "intermediate_size"):
        size = getattr(config, field_name)
        if size % SIZE_ALIGNMENT:
            raise MoEEpConfigError(f"{name}.{field_name} must be a multiple of {SIZE_ALIGNMENT}, got {size}")
    knobs = config.knobs
    if knobs is None or (isinstance(knobs, str) and knobs in modes):
        return
    if knob_class is not None and isinstance(knobs, knob_class):
        return
    if not isinstance(knobs, dict):
        allowed = ", ".join(["None", *(repr(m) for m in modes), "a dict of knobs"])
        raise MoEEpConfigError(f"{name}.knobs must be {allowed}; got {knobs!r}")
    unknown = sorted(str(k) for k in set(knobs) - set(known_knobs))
    if unknown:
        raise MoEEpConfigError(f"{name}.knobs: unknown {', '.join(unknown)}; known: {', '.join(known_knobs)}")


def sm90_requirements(device: torch.device) -> list[str]:
    missing = []
    if device.type != "cuda":
        missing.append(f"a CUDA device (got {device.type})")
    elif not torch.cuda.is_available():
        missing.append("a visible CUDA GPU")
    else:
        cap = torch.cuda.get_device_capability(device)
        if cap != (9, 0):
            missing.append(f"an SM90 (Hopper) GPU, found sm_{cap[0]}{cap[1]}")
    if importlib.util.find_spec("tvm_ffi") is None:
        missing.append("TVM-FFI (pip install apache-tvm-ffi) to load the kernels")
    return missing


def make_geometry(config: Any, num_local_experts: int) -> Any:
    """The drop's ``Geometry`` of a backend config (the experts this rank's kernel serves)."""
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

    return drop.Geometry(
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        num_experts=num_local_experts,
        top_k=config.top_k,
        activation=config.activation,
        activation_limit=config.activation_spec.effective_limit,
        input_format=config.input_format,
        combine_dtype=config.combine_dtype,
    )


def pool_owner(backend: Any) -> int | None:
    """The pool-key part that keeps a layer's workspace private: None when it may be shared
    (``MegaKernelConfig.share_workspace``), else the backend's identity."""
    return None if backend.config.share_workspace else id(backend)


def acquire_pooled_workspace(
    frontends: list[Any], capacity: int, device: torch.device, owner: int | None = None
) -> tuple[Any, dict[int, Any]]:
    """One workspace per (kernel variants, capacity, device, ``owner``), shared by every layer that
    matches (the drop's refcounted pool) and, inside a layer, by all ``frontends`` (its token buckets;
    each gets views of its own shapes). Returns the pool key (release it in ``destroy``) and
    ``id(frontend)`` -> its buffers."""
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import allocate_shared_workspace, comm

    digests = tuple(fe.key.digest() for fe in frontends)
    key = (digests, capacity, str(device), owner)

    def make() -> dict[str, dict[str, torch.Tensor]]:
        with torch.cuda.device(device):
            views = allocate_shared_workspace(frontends, capacity, device)
        return dict(zip(digests, views, strict=True))

    shared = comm.WORKSPACES.acquire(key, make)
    return key, {id(fe): shared[d] for fe, d in zip(frontends, digests, strict=True)}


def release_pooled_workspace(key: Any) -> None:
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm

    comm.WORKSPACES.release(key)


def load_kernel(frontend: Any) -> Any:
    """Load ``frontend``'s kernel library (kernel cache, else compile) and return its function; a
    missing kernel is the backend being unavailable, with the drop's message (it names the build
    command)."""
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import KernelUnavailableError

    try:
        return frontend.load()
    except KernelUnavailableError as exc:
        raise MoEEpBackendUnavailableError(str(exc)) from None


def warmup_forward(backend: Any) -> None:
    """One small forward on random inputs (every lazily created CUDA resource exists afterwards, so
    a CUDA graph can be captured next), then a device synchronize."""
    c, device = backend.config, backend.device
    t = min(8, backend.fleet.max_tokens_per_rank)
    x = torch.randn(t, c.hidden_size, device=device).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(c.num_experts, device=device)[: c.top_k] for _ in range(t)]).int()
    w = torch.rand(t, c.top_k, device=device)
    out = torch.empty(t, c.hidden_size, dtype=torch.bfloat16, device=device)
    codes, scales = prequantized_inputs(c, x)
    backend.compute(MoEEpTensors(codes, ids, w, scales=scales), out)
    torch.cuda.synchronize(device)


def prequantized_inputs(config: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden_states, scales) of bf16 ``x`` as a layer of ``config`` takes them: ``(x, None)`` for bf16
    input, else the codes and block scales of ``core.quant.quantize_activations``."""
    if config.input_format == "bf16":
        return x, None
    return quantize_activations(x, config.input_format, getattr(config, "input_global_scale", None))


__all__ = [
    "SIZE_ALIGNMENT",
    "acquire_pooled_workspace",
    "check_kernel_config",
    "pool_owner",
    "load_kernel",
    "make_geometry",
    "prequantized_inputs",
    "release_pooled_workspace",
    "sm90_requirements",
    "warmup_forward",
]
