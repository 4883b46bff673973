"""Makes the drop's ``src/`` importable, under this drop's own package name.

``src/`` is a package whose modules import each other relatively, so nothing is put on ``sys.path``
and no generic top-level name (``common``, ``src``) is ever created: two drops (or two copies of one)
import side by side, each getting its own modules, also for modules imported lazily at call time.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

DROP_DIR = Path(__file__).resolve().parents[1]
SRC_DIR = DROP_DIR / "src"
#: e.g. ``flashinfer.moe_ep.kernel_src.cutedsl_megamoe.src``
SRC_PACKAGE = __name__.rsplit(".", 2)[0] + ".src"


def src_module(name: str) -> ModuleType:
    """Import ``src/<name>`` (dotted, e.g. ``"moe_bf16_glu.weights"``) as part of this drop."""
    return importlib.import_module(f"{SRC_PACKAGE}.{name}")


__all__ = ["DROP_DIR", "SRC_DIR", "SRC_PACKAGE", "src_module"]
