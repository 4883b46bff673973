"""The frontend core shared by every dtype: config -> compile/export -> cache -> load -> launch.

A dtype frontend (``bf16.py``, later ``mxfp8.py``, ``nvfp4.py``) says only what differs: how to
construct its kernel from knobs, how to export it, its workspace, its weight layout and its argument
order. Everything else (cache keys, building on a CPU-only machine, loading without cutlass, workspace
allocation, errors that name the fix) lives here once.
"""

from __future__ import annotations

import abc
import functools
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from . import kernel_cache
from .kernel_cache import KernelKey
from .vendor import read_vendor, source_digest

ARCH = "sm_90a"
_DTYPES = {"int32": torch.int32, "bfloat16": torch.bfloat16, "float32": torch.float32, "uint8": torch.uint8}


class KernelUnavailableError(RuntimeError):
    """No cached library for a key and no CuTe DSL compiler to build one (the message says how)."""


@dataclass(frozen=True)
class Geometry:
    """The static problem a library is compiled for (T stays symbolic)."""

    hidden: int
    intermediate: int
    num_experts: int  # experts on this rank
    top_k: int
    activation: str
    activation_limit: float | None
    # hidden_states as the kernel takes them: "bf16", or pre-quantized in a block-scaled format
    # ("mxfp8", "nvfp4": codes and block scales; the block-scaled kernels only)
    input_format: str = "bf16"
    # the EP combine wire ("bf16", or "mxfp8": y sent as MXFP8 codes and scales; EP kernels only)
    combine_dtype: str = "bf16"

    @property
    def gated(self) -> bool:
        """A GLU activation (gate and up rows in FC1)."""
        from . import kernel_helpers as kh  # constants only (no cutlass)

        return self.activation in kh.constants.GATED_ACTIVATIONS

    @property
    def fc1_rows(self) -> int:
        """Rows of one expert's FC1 weight matrix (FC1's N): 2 * I gated, else I."""
        return 2 * self.intermediate if self.gated else self.intermediate


def dsl_available() -> bool:
    return importlib.util.find_spec("cutlass") is not None


def tvm_ffi_available() -> bool:
    return importlib.util.find_spec("tvm_ffi") is not None


def prepare_compile_env(arch: str = ARCH) -> None:
    """Let cutlass target ``arch`` without a GPU. Must run before cutlass is first imported."""
    if "cutlass" not in sys.modules:
        os.environ.setdefault("CUTE_DSL_ARCH", arch)


class KernelFrontend(abc.ABC):
    kernel_family: ClassVar[str]

    def __init__(self, geometry: Geometry, knobs: Any, *, arch: str = ARCH) -> None:
        self.geometry = geometry
        self.knobs = knobs
        self.arch = arch
        self._fn: Callable[..., Any] | None = None
        self._coresident_on: torch.device | None = None  # check_grid_coresident: the device whose SMs suffice

    # -- what a dtype frontend provides -------------------------------------------------------------
    @abc.abstractmethod
    def check(self) -> None:
        """Raise ValueError when geometry and knobs cannot be served (no cutlass needed)."""

    @abc.abstractmethod
    def _export(self, out_dir: Path, function_name: str) -> Path:
        """Compile and export the library into ``out_dir`` (imports cutlass)."""

    @abc.abstractmethod
    def workspace_spec(self, max_tokens: int) -> list[Any]:
        """``BufferSpec``s (name, shape, dtype name) in call order."""

    # -- shared -------------------------------------------------------------------------------------
    def with_knobs(self, **changes: Any) -> KernelFrontend:
        """A frontend of the same kernel family and geometry with ``changes`` over these knobs (a knob A/B
        of one bucket: ``build --bucket-overrides``, ``scripts/drop_ab.py --bucket-overrides``). Raises
        ValueError (``check``) where the knobs cannot serve the geometry, or TypeError for an unknown knob."""
        fe = type(self)(self.geometry, replace(self.knobs, **changes), arch=self.arch)
        fe.check()
        return fe

    def glu_kwargs(self) -> dict[str, Any]:
        """The constructor keywords every GLU MoE kernel of the drop takes from the geometry and the
        knobs (BF16 and block-scaled, world size 1 and EP); each frontend adds its own."""
        g, k = self.geometry, self.knobs
        return {
            "activation": g.activation,
            "limit": g.activation_limit,
            "tile_m": k.tile_m,
            "fc1_tile_n": k.fc1_tile_n,
            "fc2_tile_n": k.fc2_tile_n,
            "num_sms": k.num_sms,
        }

    @functools.cached_property
    def key(self) -> KernelKey:
        """The cache key (computed once: geometry and knobs are frozen; VENDOR.md and the drop's files are
        read once here)."""
        record = read_vendor()
        knobs = asdict(self.knobs) if hasattr(self.knobs, "__dataclass_fields__") else dict(self.knobs)
        return KernelKey(
            kernel=self.kernel_family,
            drop_version=record.version,
            dsl_version=record.dsl_version,
            arch=self.arch,
            geometry=asdict(self.geometry),
            knobs=knobs,
            drop_digest=source_digest(),
        )

    def build(self, root: Path | None = None, *, force: bool = False) -> Path:
        """Compile and export into the cache (no GPU needed); returns the library path."""
        self.check()
        key = self.key
        if not force and (lib := kernel_cache.lookup(key, root)) is not None:
            return lib
        if not dsl_available():
            raise KernelUnavailableError(
                "building a kernel needs the CuTe DSL compiler: pip install 'flashinfer-moe-ep[kernels]'"
            )
        prepare_compile_env(self.arch)
        return kernel_cache.store(key, self._export, root)

    def is_loaded(self) -> bool:
        return self._fn is not None

    def load(self, root: Path | None = None, *, allow_compile: bool = True) -> Callable[..., Any]:
        """The launch function: from the cache, else compiled now when CuTe DSL is importable."""
        if self._fn is not None:
            return self._fn
        self.check()
        key = self.key
        lib = kernel_cache.lookup(key, root)
        if lib is None:
            if not (allow_compile and dsl_available()):
                raise KernelUnavailableError(
                    f"no cached kernel {key.dirname} in {root or kernel_cache.cache_root()} and no CuTe DSL "
                    "compiler here. Build it on any machine (a GPU is not needed) with\n"
                    f"  {self.build_command()}\nand copy that cache directory here (or point "
                    f"{kernel_cache.CACHE_ENV} at it)."
                )
            lib = self.build(root)
        if not tvm_ffi_available():
            raise KernelUnavailableError("loading a kernel needs TVM-FFI: pip install apache-tvm-ffi")
        self._fn = kernel_cache.load_function(lib, key.function_name)
        return self._fn

    #: the ``build --backend`` value of this frontend's kernels (None: the default, BF16)
    build_backend: ClassVar[str | None] = None

    def build_command(self) -> str:
        """The ``build`` command that compiles this frontend's kernels (for the error of a cache miss)."""
        g = self.geometry
        backend = f"--backend {self.build_backend} " if self.build_backend else ""
        world = self.build_world_size()
        cmd = (
            f"CUTE_DSL_ARCH={self.arch} python -m flashinfer.moe_ep build --arch {self.arch} {backend}"
            f"--hidden {g.hidden} --intermediate {g.intermediate} --experts {g.num_experts // world} "
            f"--top-k {g.top_k} --activation {g.activation}"
        )
        if g.activation_limit is not None:
            cmd += f" --activation-limit {g.activation_limit}"
        if world > 1:
            cmd += f" --world-size {world}"
        if g.input_format != "bf16":
            cmd += " --prequantized-input"
        if g.combine_dtype != "bf16":
            cmd += f" --combine-dtype {g.combine_dtype}"
        return cmd + f" --knobs '{json.dumps(self.build_knobs(), sort_keys=True)}'"

    def build_world_size(self) -> int:
        """The ``build --world-size`` of this frontend's kernels (1: world size 1)."""
        return 1

    def build_knobs(self) -> dict[str, Any]:
        """The ``build --knobs`` (a config's knobs) that give exactly this frontend's kernel."""
        return asdict(self.knobs)

    def allocate_workspace(self, max_tokens: int, device: torch.device) -> Workspace:
        return allocate_shared_workspace([self], max_tokens, device)[0]

    @property
    def launch_token_limit(self) -> tuple[int, str, str] | None:
        """(the most tokens one launch of this knob set takes, the knob that sets it, its rule), or None (any
        T). ``launch`` and the layers' token buckets check T against it. Here: ``pair_blocks``' limit where the
        family has that knob."""
        if getattr(self.knobs, "pair_blocks", False):
            return self.pair_blocks_max_tokens, "pair_blocks", "T * top_k <= num_experts"
        return None

    @property
    def pair_blocks_max_tokens(self) -> int:
        """The most tokens a ``pair_blocks`` launch takes (``T * top_k <= num_experts``: the workspace's rows;
        both families' one-token chain, M block b = pair b of ``topk_ids``)."""
        return self.geometry.num_experts // self.geometry.top_k

    def check_pair_blocks(self) -> None:
        """``pair_blocks`` (where set) serves one token at least, and ``pair_combine`` needs it."""
        k = self.knobs
        if getattr(k, "pair_combine", False) and not k.pair_blocks:
            raise ValueError("pair_combine needs pair_blocks=True")
        if getattr(k, "pair_blocks", False) and self.pair_blocks_max_tokens < 1:
            g = self.geometry
            raise ValueError(f"pair_blocks takes T * top_k <= num_experts; top_k={g.top_k} > {g.num_experts}")

    def check_launch_tokens(self, tokens: int) -> None:
        """Raise ValueError before a launch of ``tokens`` tokens beyond ``launch_token_limit``."""
        limit = self.launch_token_limit
        if limit is not None and tokens > limit[0]:
            most, knob, rule = limit
            raise ValueError(
                f"{knob} serves at most {most} tokens per launch ({rule}), got T={tokens}: use a knob set "
                "without it for this token count"
            )

    def check_grid_coresident(self, x: torch.Tensor, knob: str) -> None:
        """A kernel whose CTAs meet at a grid barrier (``knob``: BF16's ``decode_fused``, the block-scaled
        ``gemv_fused``) needs all ``num_sms`` of them resident at once, one an SM: raise ValueError before a launch
        on a device with fewer SMs, where it would hang (checked once per device)."""
        if not x.is_cuda or self._coresident_on == x.device:
            return
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        if self.knobs.num_sms > sms:
            raise ValueError(
                f"{knob} needs its {self.knobs.num_sms} CTAs co-resident, but {x.device} has {sms} SMs: "
                f"set num_sms <= {sms}"
            )
        self._coresident_on = x.device

    @staticmethod
    def check_workspace_tokens(tokens: int, workspace: dict[str, torch.Tensor]) -> None:
        """Raise ValueError before any launch when ``workspace`` was sized for fewer than ``tokens``
        tokens (its buffers would be overrun). A plain dict carries no size and is not checked."""
        most = getattr(workspace, "max_tokens", None)
        if most is not None:
            check_token_capacity(tokens, most, "this workspace (allocate_workspace / allocate_shared_workspace)")


def check_token_capacity(tokens: int, most: int, what: str) -> None:
    """Raise ValueError before a launch of ``tokens`` tokens on buffers (``what``) sized for ``most``."""
    if tokens > most:
        raise ValueError(
            f"{what} was allocated for at most {most} tokens, got T={tokens}: allocate it for the largest T launched"
        )


def check_glu_geometry(
    geometry: Geometry,
    fc1_tile_n: int,
    fc2_tile_n: int,
    local_experts: int,
    kernel: str,
    input_formats: tuple[str, ...] = ("bf16",),
    combine_wires: tuple[str, ...] = ("bf16",),
) -> None:
    """The rules every GLU MoE kernel of the drop shares (BF16, EP, block-scaled): an input format it
    takes, a combine wire it has (world-size-1 kernels have none: bf16 y), a known activation, at most
    ``MAX_EXPERTS`` experts per rank, H and I multiples of the K tile, N tiles that divide FC1's rows
    and H. Raises ValueError naming ``kernel``."""
    from . import kernel_helpers as kh  # constants only (no cutlass)

    g, c = geometry, kh.constants
    if g.input_format not in input_formats:
        raise ValueError(
            f"the {kernel} kernel takes hidden_states as {' or '.join(input_formats)}, not {g.input_format!r}"
        )
    if g.combine_dtype not in combine_wires:
        if combine_wires == ("bf16",):
            raise ValueError(
                f"combine_dtype={g.combine_dtype!r} is the EP combine wire: the world-size-1 {kernel} kernel has "
                "none (use 'bf16'; the reference backend applies the wire rounding at every world size)"
            )
        wires = ", ".join(combine_wires)
        raise ValueError(f"the {kernel} kernel's combine wire is one of {wires}, not {g.combine_dtype!r}")
    if g.activation not in c.ACTIVATIONS:
        raise ValueError(f"activation {g.activation!r} is not served by the {kernel} kernel")
    if local_experts > c.MAX_EXPERTS:
        raise ValueError(f"the {kernel} kernel serves at most {c.MAX_EXPERTS} experts per rank, got {local_experts}")
    if g.hidden % c.TILE_K or g.intermediate % c.TILE_K:
        raise ValueError(f"the {kernel} kernel needs hidden and intermediate sizes that are multiples of {c.TILE_K}")
    fc1_n = g.fc1_rows
    if fc1_n % fc1_tile_n or g.hidden % fc2_tile_n:
        raise ValueError(
            f"FC1 N={fc1_n} must be a multiple of fc1_tile_n={fc1_tile_n} and "
            f"hidden={g.hidden} of fc2_tile_n={fc2_tile_n}"
        )


class Workspace(dict):
    """A frontend's workspace buffers by name (call order), with the most tokens they were sized for
    (``max_tokens``), which every launch checks."""

    def __init__(self, buffers: dict[str, torch.Tensor], max_tokens: int) -> None:
        super().__init__(buffers)
        self.max_tokens = max_tokens


def allocate_shared_workspace(
    frontends: list[KernelFrontend], max_tokens: int, device: torch.device
) -> list[Workspace]:
    """One set of buffers serving every frontend in ``frontends`` (a layer's token buckets), never two
    at once: per buffer name, the largest size any of them needs; each frontend gets views of exactly
    its own shapes at the start of each buffer. Zero-filled, so buffers that must start at zero do
    (the kernels leave those at zero again after every call)."""
    specs = [f.workspace_spec(max_tokens) for f in frontends]
    sizes: dict[str, tuple[int, str]] = {}
    for spec in (s for ss in specs for s in ss):
        n = _numel(spec.shape)
        have, dtype = sizes.get(spec.name, (0, spec.dtype))
        if dtype != spec.dtype:
            raise ValueError(f"workspace buffer {spec.name!r} is {dtype} in one variant and {spec.dtype} in another")
        sizes[spec.name] = (max(have, n), dtype)
    flat = {name: torch.zeros(max(n, 1), dtype=_DTYPES[dt], device=device) for name, (n, dt) in sizes.items()}
    return [Workspace({s.name: flat[s.name][: _numel(s.shape)].view(s.shape) for s in ss}, max_tokens) for ss in specs]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = [
    "ARCH",
    "Geometry",
    "KernelFrontend",
    "KernelUnavailableError",
    "Workspace",
    "allocate_shared_workspace",
    "check_glu_geometry",
    "check_token_capacity",
    "dsl_available",
    "prepare_compile_env",
]
