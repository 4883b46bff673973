"""Adopting a new kernel drop: audit it, replace the kernel packages of ``src/`` verbatim, record it.

A candidate drop directory holds the kernel team's tree: kernel packages (directories with an
``__init__.py``), the ``src/__init__.py`` file, and scaffolding that is never copied (``ci/``,
``tester/``, ``tests/``, ``scripts/``, docs, READMEs). The candidate may be given as that directory or
as its parent holding ``src/``.
"""

from __future__ import annotations

import datetime as _dt
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ._paths import SRC_DIR
from .audit import AuditProblem, audit_src
from .vendor import VENDOR_FILE, VendorRecord, compute_manifest, read_vendor

SCAFFOLDING = frozenset({"ci", "tester", "tests", "test", "scripts", "docs", "examples", "benchmarks", "build"})
ROOT_FILES = ("__init__.py",)


@dataclass
class UpdateReport:
    candidate: Path
    packages: list[str]
    skipped: list[str]
    problems: list[AuditProblem] = field(default_factory=list)
    applied: bool = False
    record: VendorRecord | None = None

    def render(self) -> str:
        lines = [f"candidate: {self.candidate}", f"kernel packages: {', '.join(self.packages) or '(none)'}"]
        if self.skipped:
            lines.append(f"not copied (scaffolding / not a kernel package): {', '.join(self.skipped)}")
        if self.problems:
            lines.append(f"contract audit: {len(self.problems)} break(s) against the shim:")
            lines += [f"  - {p}" for p in self.problems]
        else:
            lines.append("contract audit: ok (every symbol and signature the shim uses is present)")
        if self.applied and self.record:
            lines.append(
                f"applied: src/ replaced, VENDOR.md records version {self.record.version} "
                f"({len(self.record.manifest)} files)"
            )
        return "\n".join(lines)


def resolve_candidate(path: Path) -> Path:
    path = Path(path).resolve()
    if (path / "src" / "__init__.py").is_file() and not (path / "__init__.py").is_file():
        return path / "src"
    if not path.is_dir():
        raise FileNotFoundError(f"no drop directory at {path}")
    return path


def kernel_packages(candidate: Path) -> tuple[list[str], list[str]]:
    """(kernel packages to copy, other entries left behind)."""
    take, skip = [], []
    for entry in sorted(candidate.iterdir()):
        if entry.name in ROOT_FILES or entry.name == "__pycache__":
            continue
        if entry.is_dir() and (entry / "__init__.py").is_file() and entry.name not in SCAFFOLDING:
            take.append(entry.name)
        else:
            skip.append(entry.name + ("/" if entry.is_dir() else ""))
    return take, skip


def _copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def stage_src(candidate: Path, packages: list[str], dest: Path) -> None:
    """Lay the new ``src/`` (kernel packages + root files only) into ``dest``."""
    dest.mkdir(parents=True)
    for name in ROOT_FILES:
        if (candidate / name).is_file():
            shutil.copy2(candidate / name, dest / name)
    for name in packages:
        _copy_tree(candidate / name, dest / name)


def update_drop(
    candidate_dir: Path,
    *,
    check_only: bool = False,
    version: str | None = None,
    force: bool = False,
    src_dir: Path = SRC_DIR,
    vendor_file: Path = VENDOR_FILE,
) -> UpdateReport:
    """Audit ``candidate_dir``; unless ``check_only`` (or the audit fails without ``force``), replace
    ``src_dir`` by its kernel packages and write ``vendor_file``. Nothing is touched on failure."""
    candidate = resolve_candidate(candidate_dir)
    packages, skipped = kernel_packages(candidate)
    report = UpdateReport(candidate, packages, skipped)
    with tempfile.TemporaryDirectory(prefix="moe-ep-drop-") as tmp:
        staged = Path(tmp) / "src"
        stage_src(candidate, packages, staged)  # audit exactly what would be installed
        report.problems = audit_src(staged)
        if check_only or (report.problems and not force):
            return report
        old = read_vendor(vendor_file) if vendor_file.is_file() else None
        record = VendorRecord(
            version=version or _next_version(old),
            date=_dt.date.today().isoformat(),
            dsl_version=old.dsl_version if old else "4.8.1",
            packages=packages,
            manifest=compute_manifest(staged),
        )
        backup = Path(tmp) / "previous-src"
        if src_dir.exists():
            shutil.move(str(src_dir), backup)
        try:
            shutil.move(str(staged), src_dir)
        except BaseException:
            if backup.exists():
                shutil.move(str(backup), src_dir)
            raise
        vendor_file.write_text(record.render())
        report.applied, report.record = True, record
    return report


def _next_version(old: VendorRecord | None) -> str:
    if old is None:
        return "v1"
    head, _, num = old.version.rpartition("v")
    return f"{head}v{int(num) + 1}" if num.isdigit() else old.version + "+1"


NEXT_STEPS = """next steps:
  1. python -m pytest -q tests/kernel_src tests/test_layering.py      (CPU: manifest, audit, layering, builds)
  2. CUTE_DSL_ARCH=sm_90a python -m flashinfer.moe_ep build --contract all   (compile every default variant)
  3. on the H200 (see SKILL.md): bash ../shared/gpu/stage, then run with carry [".gpu", ".kcache"]:
     source .gpu/env.sh && FLASHINFER_MOE_EP_KERNEL_CACHE=.kcache python -m pytest -q -m gpu
  4. python -m flashinfer.moe_ep bench on the H200; record the numbers in TUNING.md
  5. commit src/ and VENDOR.md together, as one "new drop" commit"""


__all__ = ["NEXT_STEPS", "SCAFFOLDING", "UpdateReport", "kernel_packages", "resolve_candidate", "update_drop"]
