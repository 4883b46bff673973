"""The on-disk AOT kernel cache: TVM-FFI shared libraries keyed by everything that changes the code.

Layout: ``<root>/<kernel>-<digest>/`` holding ``lib<function>.so`` and ``key.json`` (the full key).
``root`` is ``$FLASHINFER_MOE_EP_KERNEL_CACHE`` or ``~/.cache/flashinfer/moe_ep/kernels``. An entry is
built in a private temporary directory under ``root`` and published with one atomic ``rename``;
concurrent builders of one key each build, the first rename wins and the others discard theirs, so a
reader never sees a half-written entry. Loading needs only ``tvm_ffi`` (no cutlass).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CACHE_ENV = "FLASHINFER_MOE_EP_KERNEL_CACHE"


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "flashinfer" / "moe_ep" / "kernels"
    return root


@dataclass(frozen=True)
class KernelKey:
    """Identity of one compiled variant. ``geometry`` and ``knobs`` are flat str -> scalar mappings;
    ``drop_digest`` is the digest of the drop's source files (``vendor.source_digest``)."""

    kernel: str
    drop_version: str
    dsl_version: str
    arch: str
    geometry: Mapping[str, Any] = field(default_factory=dict)
    knobs: Mapping[str, Any] = field(default_factory=dict)
    drop_digest: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "drop_version": self.drop_version,
            "drop_digest": self.drop_digest,
            "dsl_version": self.dsl_version,
            "arch": self.arch,
            "geometry": dict(sorted(self.geometry.items())),
            "knobs": dict(sorted(self.knobs.items())),
        }

    def digest(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    @property
    def function_name(self) -> str:
        """Exported symbol: unique per key, so several libraries can be loaded in one process."""
        return f"{self.kernel}_{self.digest()[:12]}"

    @property
    def dirname(self) -> str:
        return f"{self.kernel}-{self.digest()}"


def entry_dir(key: KernelKey, root: Path | None = None) -> Path:
    return (root or cache_root()) / key.dirname


def lib_path(key: KernelKey, root: Path | None = None) -> Path:
    return entry_dir(key, root) / f"lib{key.function_name}.so"


def lookup(key: KernelKey, root: Path | None = None) -> Path | None:
    """The library of ``key`` if a complete entry exists (its key.json must match exactly)."""
    lib = lib_path(key, root)
    meta = lib.parent / "key.json"
    if not (lib.is_file() and meta.is_file()):
        return None
    try:
        if json.loads(meta.read_text()) != key.as_dict():
            return None
    except (OSError, ValueError):
        return None
    return lib


def store(key: KernelKey, build: Callable[[Path, str], Path], root: Path | None = None) -> Path:
    """Build ``key`` with ``build(tmp_dir, function_name) -> lib`` and publish it atomically.

    Returns the published library (ours, or a concurrent builder's that won the rename).
    """
    root = root or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = entry_dir(key, root)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{key.dirname}-", dir=root))
    try:
        built = build(tmp, key.function_name)
        want = tmp / f"lib{key.function_name}.so"
        if built != want:
            shutil.move(str(built), want)
        (tmp / "key.json").write_text(json.dumps(key.as_dict(), indent=1, sort_keys=True))
        try:
            os.rename(tmp, final)
        except OSError:
            if lookup(key, root) is None:  # the entry there is not a complete one of this key
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    lib = lookup(key, root)
    if lib is None:
        raise RuntimeError(f"kernel cache entry {final} is incomplete after publishing")
    return lib


def entries(root: Path | None = None) -> list[dict[str, Any]]:
    """Every complete entry's key (for listing and packing)."""
    root = root or cache_root()
    out = []
    for meta in sorted(root.glob("*/key.json")):
        try:
            out.append(json.loads(meta.read_text()))
        except (OSError, ValueError):
            continue
    return out


#: the parts of a key that name one variant across drops (not the drop's version or source digest)
VARIANT_FIELDS = ("kernel", "dsl_version", "arch", "geometry", "knobs")


def variant_identity(key: Mapping[str, Any]) -> str:
    """The key without its drop: two drops' builds of one variant share it."""
    return json.dumps({k: key[k] for k in VARIANT_FIELDS}, sort_keys=True)


def index_by_variant(root: Path) -> dict[str, tuple[Path, str]]:
    """variant identity -> (library, exported function) of every complete entry of the cache ``root``."""
    out = {}
    for key_file in sorted(Path(root).glob("*/key.json")):
        key = KernelKey(**json.loads(key_file.read_text()))
        lib = lib_path(key, root)
        if lib.is_file():
            out[variant_identity(key.as_dict())] = (lib, key.function_name)
    return out


_loaded: dict[str, Any] = {}
_lock = threading.Lock()


def load_function(lib: Path, function_name: str) -> Callable[..., Any]:
    """Load ``lib`` with TVM-FFI once per process and return its exported function."""
    import tvm_ffi  # the runtime only: no cutlass

    path = str(Path(lib).resolve())  # an absolute path, or dlopen searches the library path
    with _lock:
        mod = _loaded.get(path)
        if mod is None:
            mod = tvm_ffi.load_module(path)
            _loaded[path] = mod
    return getattr(mod, function_name)


__all__ = [
    "CACHE_ENV",
    "KernelKey",
    "cache_root",
    "entries",
    "entry_dir",
    "index_by_variant",
    "lib_path",
    "load_function",
    "lookup",
    "store",
    "variant_identity",
    "VARIANT_FIELDS",
]
