"""``update-drop``: adopt a new kernel drop (audit, verbatim replace, manifest) or only audit it (--check)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..backends.mega.kernel.drops import DROPS, load_drop
from ..core.layering import check_tree


def add_parser(sub: Any) -> None:
    p = sub.add_parser("update-drop", help="audit a candidate kernel drop and (unless --check) adopt it")
    p.add_argument("candidate", type=Path, help="the kernel team's drop directory (or its parent holding src/)")
    p.add_argument("--drop", default=DROPS[0], choices=DROPS)
    p.add_argument("--check", action="store_true", help="audit only; touch nothing")
    p.add_argument("--version", default=None, help="version to record (default: the next vN)")
    p.add_argument("--force", action="store_true", help="adopt even when the audit finds breaks")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    drop = load_drop(args.drop)
    report = drop.update_drop(args.candidate, check_only=args.check, version=args.version, force=args.force)
    print(report.render())
    status = 1 if report.problems else 0
    if report.applied:
        package_root = Path(drop.__file__).resolve().parents[2]
        violations = check_tree(package_root)
        print(f"layering: {len(violations)} violation(s)")
        for v in violations:
            print(f"  - {v}")
        changed = drop.check_manifest()
        print("manifest: " + ("ok" if not changed else "MISMATCH: " + "; ".join(changed)))
        print(drop.NEXT_STEPS)
        status = status or (1 if violations or changed else 0)
    elif not args.check and report.problems:
        print("not applied: fix the shim for the breaks above (or pass --force to adopt and fix after)")
    return status


__all__ = ["add_parser", "run"]
