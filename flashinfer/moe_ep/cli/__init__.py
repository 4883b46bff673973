"""``python -m flashinfer.moe_ep <command>``: demo (the main job), doctor, build, bench, tune, update-drop."""

from __future__ import annotations

import argparse
import sys

from ..errors import MoEEpError


def build_parser() -> argparse.ArgumentParser:
    from . import bench, build, demo, doctor, drop, tune

    parser = argparse.ArgumentParser(prog="python -m flashinfer.moe_ep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (demo, doctor, build, bench, tune, drop):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MoEEpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "main"]
