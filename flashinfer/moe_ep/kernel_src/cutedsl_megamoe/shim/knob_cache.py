"""The knob cache: the tuned knobs of each (device, problem, drop, DSL, token bucket), as one JSON file.

Where: ``$FLASHINFER_MOE_EP_KNOB_CACHE`` (a file path, or ``off`` to disable reads and writes), else
``~/.cache/flashinfer/moe_ep/knobs.json``.

Key (``KnobKey``): kernel family, device name, dtype, world size, geometry (hidden, intermediate,
experts per rank, top-k, activation, activation limit), activation, combine dtype, drop version and
DSL version (both from the drop's ``VENDOR.md``), token bucket.

Lookup rule: an entry is used only on an exact match of every key field (a new drop, a new DSL, another
device, world size or bucket is a miss; there is no nearest-neighbour fallback). On a miss, an
unreadable file or ``off``, the caller takes the per-bucket defaults (``tuner.default_knobs``). A hit
whose knobs are no longer valid (``tuner.is_valid``) is ignored by the caller the same way. Reading
never compiles and never talks to other ranks.

Writes: read-modify-write under an advisory lock (``<file>.lock``, POSIX ``flock``; skipped where
unavailable), written to a temporary file in the same directory and published with ``os.replace``, so a
reader always sees a complete JSON file and concurrent writers do not lose each other's entries.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .frontend import Geometry
from .vendor import read_vendor

KNOB_CACHE_ENV = "FLASHINFER_MOE_EP_KNOB_CACHE"
FORMAT = 1


def cache_path() -> Path | None:
    """The knob cache file, or None when ``$FLASHINFER_MOE_EP_KNOB_CACHE`` is ``off``."""
    env = os.environ.get(KNOB_CACHE_ENV, "").strip()
    if env.lower() == "off":
        return None
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flashinfer" / "moe_ep" / "knobs.json"


@dataclass(frozen=True)
class TuneContext:
    """What the knob key takes from where the layer runs (the rest comes from the geometry)."""

    device_name: str  # torch.cuda.get_device_name(), e.g. "NVIDIA H200"
    world_size: int = 1
    dtype: str = "bfloat16"  # activations and weights
    combine_dtype: str = "bfloat16"  # what the top-k combine accumulates into / writes


@dataclass(frozen=True)
class KnobKey:
    kernel: str
    device_name: str
    dtype: str
    world_size: int
    geometry: Mapping[str, Any]
    activation: str
    combine_dtype: str
    drop_version: str
    dsl_version: str
    bucket: str

    @classmethod
    def make(cls, kernel: str, geometry: Geometry, bucket: str, context: TuneContext) -> KnobKey:
        """The key of ``geometry`` in ``bucket`` here, with the drop and DSL versions of ``VENDOR.md``."""
        record = read_vendor()
        return cls(
            kernel=kernel,
            device_name=context.device_name,
            dtype=context.dtype,
            world_size=context.world_size,
            geometry=asdict(geometry),
            activation=geometry.activation,
            combine_dtype=context.combine_dtype,
            drop_version=record.version,
            dsl_version=record.dsl_version,
            bucket=bucket,
        )

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["geometry"] = dict(sorted(self.geometry.items()))
        return d

    def digest(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


@dataclass
class KnobEntry:
    key: dict[str, Any]
    knobs: dict[str, Any]
    source: str = "autotune"  # who recorded it ("autotune", "tune-cli", "manual")
    ms: float | None = None  # the winner's max-over-ranks median, as measured
    tokens: int | None = None  # T it was measured at
    recorded: float = field(default_factory=time.time)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"format": FORMAT, "entries": {}}
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        return {"format": FORMAT, "entries": {}}
    return data


def _entry(raw: Any) -> KnobEntry | None:
    """A stored entry, or None when it is not well-formed (hand edits, older formats)."""
    if not (isinstance(raw, dict) and isinstance(raw.get("key"), dict) and isinstance(raw.get("knobs"), dict)):
        return None
    return KnobEntry(**{k: raw[k] for k in ("key", "knobs", "source", "ms", "tokens", "recorded") if k in raw})


def lookup(key: KnobKey, path: Path | None = None) -> KnobEntry | None:
    """The entry of ``key`` on an exact match, else None (also when the cache is ``off``)."""
    path = path if path is not None else cache_path()
    if path is None:
        return None
    entry = _entry(_read(path)["entries"].get(key.digest()))
    return entry if entry is not None and entry.key == key.as_dict() else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: os.replace still keeps the file whole; a concurrent entry may be lost
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def record(
    key: KnobKey,
    knobs: Mapping[str, Any],
    path: Path | None = None,
    *,
    source: str = "autotune",
    ms: float | None = None,
    tokens: int | None = None,
) -> Path | None:
    """Write ``knobs`` for ``key`` atomically (other entries kept); returns the file, None when ``off``."""
    path = path if path is not None else cache_path()
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = KnobEntry(key.as_dict(), dict(knobs), source, ms, tokens)
    with _locked(path):
        data = _read(path)
        data["format"] = FORMAT
        data["entries"][key.digest()] = asdict(entry)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def entries(path: Path | None = None) -> list[KnobEntry]:
    """Every well-formed entry (for listing)."""
    path = path if path is not None else cache_path()
    if path is None:
        return []
    found = (_entry(raw) for raw in _read(path)["entries"].values())
    return [e for e in found if e is not None]


__all__ = [
    "FORMAT",
    "KNOB_CACHE_ENV",
    "KnobEntry",
    "KnobKey",
    "TuneContext",
    "cache_path",
    "entries",
    "lookup",
    "record",
]
