"""One exception family for the whole package.

Every error raised on purpose by ``flashinfer.moe_ep`` derives from :class:`MoEEpError`, so an engine
can catch the family, and the subclass says whose fault it is.
"""

from __future__ import annotations


class MoEEpError(RuntimeError):
    """Base of every error raised on purpose by flashinfer.moe_ep."""


class MoEEpConfigError(MoEEpError, ValueError):
    """A configuration (geometry, backend config, knobs, bootstrap) is invalid or unsupported."""


class MoEEpInputError(MoEEpError, ValueError):
    """A forward input or a weight tensor is invalid (shape, dtype, device, layout, range, finiteness)."""


class MoEEpBackendUnavailableError(MoEEpError):
    """The chosen backend cannot run here (wrong GPU, missing CuTe DSL / TVM-FFI / NVSHMEM, missing kernel)."""


class MoEEpTransportError(MoEEpError):
    """A cross-rank wait timed out or the transport failed; the message names the stage and the ranks."""


__all__ = [
    "MoEEpBackendUnavailableError",
    "MoEEpConfigError",
    "MoEEpError",
    "MoEEpInputError",
    "MoEEpTransportError",
]
