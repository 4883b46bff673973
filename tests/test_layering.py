"""The layering checker on the real tree (no violations) and on fixtures (each violation reported)."""

from __future__ import annotations

from pathlib import Path

from flashinfer.moe_ep.core.layering import check_tree

REPO = Path(__file__).resolve().parents[1]

# file -> source; the comment on each line names the rule it must trip (or "ok").
FIXTURE = {
    "__init__.py": "",
    "layer.py": "from .kernel_src import d1  # drop-only-from-backends\n",
    "config.py": "",
    "core/__init__.py": "",
    "core/bad.py": (
        "from ..layer import X  # core-is-bottom\n"
        "def f():\n"
        "    from ..backends import ok  # core-is-bottom\n"
        "from ..config import C  # ok\n"
    ),
    "modes/__init__.py": "",
    "modes/m.py": "from flashinfer.moe_ep.kernel_src.d1 import helper  # drop-only-from-backends\n",
    "cli/__init__.py": "",
    "cli/c.py": (
        "import importlib\nimportlib.import_module('flashinfer.moe_ep.kernel_src.d1')  # drop-only-from-backends\n"
    ),
    "backends/__init__.py": "",
    "backends/ok.py": (
        "from flashinfer.moe_ep.kernel_src.d1 import kernel_helpers  # ok\n"
        "def f():\n"
        "    import flashinfer.moe_ep.kernel_src.d1  # ok\n"
        "from ..config import C  # ok\n"
    ),
    "backends/deep.py": (
        "from flashinfer.moe_ep.kernel_src.d1.shim import bf16  # shim-private\n"
        "import flashinfer.moe_ep.kernel_src.d1.src.k  # src-only-from-shim\n"
        "from flashinfer.moe_ep.kernel_src.d1 import shim  # shim-private\n"
    ),
    "backends/up.py": (
        "from ..layer import MoEEpLayer  # backends-below-layer\nfrom ..modes import m  # backends-below-layer\n"
    ),
    "kernel_src/__init__.py": "",
    "kernel_src/d1/__init__.py": "from .shim import kernel_helpers  # ok\n",
    "kernel_src/d1/shim/__init__.py": "",
    "kernel_src/d1/shim/kernel_helpers.py": "from ..src import k  # ok\n",
    "kernel_src/d1/shim/bf16.py": "from ..src.k import Kernel  # ok\n",
    "kernel_src/d1/src/__init__.py": "",
    "kernel_src/d1/src/k.py": (
        "from flashinfer.moe_ep import errors  # src-self-contained\n"
        "from ..shim import bf16  # src-self-contained\n"
        "import torch  # ok\n"
    ),
    "kernel_src/d1/src/ok.py": "from . import k  # ok\nfrom .k import Kernel  # ok\n",
    "kernel_src/d1/src/abs.py": "import flashinfer.moe_ep.kernel_src.d1.src.k  # src-self-contained\n",
    "kernel_src/d2/__init__.py": "",
    "kernel_src/d2/shim/__init__.py": "",
    "kernel_src/d2/shim/x.py": (
        "from ...d1.src import k  # src-only-from-shim\nfrom ...d1 import kernel_helpers  # drop-only-from-backends\n"
    ),
}
TEST_FIXTURE = {"test_a.py": "from flashinfer.moe_ep.kernel_src.d1.src import k  # src-only-from-shim\n"}


def _expected(files: dict[str, str], prefix: str) -> set[tuple[str, int, str]]:
    out = set()
    for name, src in files.items():
        for i, line in enumerate(src.splitlines(), 1):
            rule = line.rsplit("# ", 1)[-1] if "# " in line else "ok"
            if rule != "ok":
                out.add((f"{prefix}{name}", i, rule))
    return out


def _write(root: Path, files: dict[str, str]) -> None:
    for name, src in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)


def test_real_tree_has_no_violations() -> None:
    violations = check_tree(REPO / "flashinfer" / "moe_ep", tests_root=REPO / "tests")
    assert violations == [], "\n".join(map(str, violations))


def test_every_kind_of_violation_is_reported(tmp_path: Path) -> None:
    pkg = tmp_path / "flashinfer" / "moe_ep"
    tests = tmp_path / "tests"
    _write(pkg, FIXTURE)
    _write(tests, TEST_FIXTURE)
    got = {(str(Path(v.path).relative_to(tmp_path)), v.line, v.rule) for v in check_tree(pkg, tests_root=tests)}
    want = _expected(FIXTURE, "flashinfer/moe_ep/") | _expected(TEST_FIXTURE, "tests/")
    assert got == want
    # Every rule the checker knows is exercised by the fixture.
    assert {r for _, _, r in want} == {
        "src-self-contained",
        "src-only-from-shim",
        "shim-private",
        "drop-only-from-backends",
        "core-is-bottom",
        "backends-below-layer",
    }
