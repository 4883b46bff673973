"""``VENDOR.md``: the record of the drop in ``src/`` (version, date, DSL version, packages, manifest).

The manifest is the sha256 of every file under ``src/`` (caches excluded). ``check_manifest`` reports
every file added, removed or changed since the recorded drop, so any edit of ``src/`` must come as a
recorded new drop (``scripts/update_drop.py``).
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from ._paths import DROP_DIR, SRC_DIR

VENDOR_FILE = DROP_DIR / "VENDOR.md"
_SKIP_PARTS = {"__pycache__", ".pytest_cache"}
_FIELD = re.compile(r"^- (?P<key>[a-z_ ]+): (?P<value>.+)$")
_MANIFEST_LINE = re.compile(r"^(?P<sha>[0-9a-f]{64})  (?P<path>\S.*)$")


@dataclass
class VendorRecord:
    version: str
    date: str
    dsl_version: str
    packages: list[str]
    manifest: dict[str, str] = field(default_factory=dict)

    def render(self) -> str:
        lines = [
            "# Kernel drop record: cutedsl_megamoe",
            "",
            "Written by `scripts/update_drop.py`; do not edit by hand. Any change to `src/` is a new drop:",
            "the manifest test fails on a file that differs from this record.",
            "",
            f"- version: {self.version}",
            f"- date: {self.date}",
            f"- dsl_version: {self.dsl_version}",
            f"- packages: {', '.join(self.packages)}",
            "",
            "## Manifest (sha256, path under src/)",
            "```",
            *(f"{sha}  {path}" for path, sha in sorted(self.manifest.items())),
            "```",
            "",
        ]
        return "\n".join(lines)


def compute_manifest(src_dir: Path = SRC_DIR) -> dict[str, str]:
    out = {}
    for p in sorted(src_dir.rglob("*")):
        if not p.is_file() or _SKIP_PARTS.intersection(p.relative_to(src_dir).parts) or p.suffix == ".pyc":
            continue
        out[p.relative_to(src_dir).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@functools.lru_cache(maxsize=4)
def source_digest(src_dir: Path = SRC_DIR) -> str:
    """Digest of the drop's files as they are on disk (computed once per process). Kernel cache keys
    carry it next to the recorded version, so an edit of ``src/`` never reuses a library compiled from
    the old code, even before the edit is recorded as a new drop."""
    blob = "\n".join(f"{sha}  {path}" for path, sha in sorted(compute_manifest(src_dir).items()))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_vendor(path: Path = VENDOR_FILE) -> VendorRecord:
    fields: dict[str, str] = {}
    manifest: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if m := _FIELD.match(line):
            fields[m["key"].strip()] = m["value"].strip()
        elif m := _MANIFEST_LINE.match(line):
            manifest[m["path"]] = m["sha"]
    missing = {"version", "date", "dsl_version", "packages"} - set(fields)
    if missing:
        raise ValueError(f"{path} lacks the field(s) {', '.join(sorted(missing))}")
    packages = [p.strip() for p in fields["packages"].split(",") if p.strip()]
    return VendorRecord(fields["version"], fields["date"], fields["dsl_version"], packages, manifest)


def check_manifest(src_dir: Path = SRC_DIR, record: VendorRecord | None = None) -> list[str]:
    """Differences between ``src_dir`` and the recorded manifest, one line each ([] = identical)."""
    record = record or read_vendor()
    actual = compute_manifest(src_dir)
    problems = []
    for path in sorted(set(record.manifest) | set(actual)):
        want, got = record.manifest.get(path), actual.get(path)
        if want is None:
            problems.append(f"added (not in the recorded drop): src/{path}")
        elif got is None:
            problems.append(f"removed (in the recorded drop): src/{path}")
        elif want != got:
            problems.append(f"changed since the recorded drop: src/{path}")
    return problems


__all__ = ["VENDOR_FILE", "VendorRecord", "check_manifest", "compute_manifest", "read_vendor"]
