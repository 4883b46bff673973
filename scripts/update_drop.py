#!/usr/bin/env python3
"""Adopt a new kernel drop: ``python scripts/update_drop.py <drop-dir> [--check] [--version V]``.

Same as ``python -m flashinfer.moe_ep update-drop``; see SKILL.md for the whole workflow.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashinfer.moe_ep.cli import main

if __name__ == "__main__":
    sys.exit(main(["update-drop", *sys.argv[1:]]))
