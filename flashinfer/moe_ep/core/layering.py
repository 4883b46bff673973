"""The layering checker: parses imports (AST) and reports every edge that breaks the package layering.

Rules (``rule`` names as reported):

- ``src-self-contained``: a drop's ``src/`` imports nothing from ``flashinfer`` and nothing outside
  its own ``src/`` (relative imports included).
- ``src-only-from-shim``: a drop's ``src/`` is imported only by that drop's ``shim/`` (or by itself).
- ``shim-private``: a drop's ``shim/`` modules are imported only inside that drop.
- ``drop-only-from-backends``: a drop is imported only by ``backends/`` (and tests), only through its
  package ``__init__`` (``from <drop> import name`` where ``name`` is not a submodule).
- ``core-is-bottom``: ``core/`` imports none of ``layer``, ``modes``, ``backends``, ``cli``, ``kernel_src``,
  nor the package ``__init__``.
- ``backends-below-layer``: ``backends/`` import none of ``layer``, ``modes``, ``cli`` nor the package
  ``__init__``.

Every ``import``/``from ... import`` counts, at any depth (function bodies too), as do
``importlib.import_module("literal")`` and ``__import__("literal")`` calls.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "flashinfer.moe_ep"


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    importer: str
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported} [{self.rule}]"


@dataclass(frozen=True)
class _Place:
    """Where a module sits: ``area`` in {src, shim, drop, kernel_src, backends, core, modes, cli, api,
    tests, external}; ``drop`` is the drop name for src/shim/drop."""

    area: str
    drop: str = ""


def _module_name(path: Path, root: Path, package: str) -> tuple[str, bool]:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join([package, *parts]) if parts else package, is_pkg


def _place(module: str, package: str) -> _Place:
    if module != package and not module.startswith(package + "."):
        return _Place("external")
    rest = module[len(package) + 1 :].split(".") if module != package else []
    if not rest:
        return _Place("api")
    head = rest[0]
    if head == "kernel_src":
        if len(rest) == 1:
            return _Place("kernel_src")
        drop = rest[1]
        if len(rest) == 2:
            return _Place("drop", drop)
        return _Place(rest[2] if rest[2] in ("src", "shim") else "drop_internal", drop)
    if head in ("core", "modes", "backends", "cli"):
        return _Place(head)
    return _Place("api")  # __init__, layer, config, errors, __main__ ...


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, is_pkg: bool) -> None:
        self.module, self.is_pkg = module, is_pkg
        self.edges: list[tuple[int, str, tuple[str, ...], bool]] = []  # (line, module, names, relative)

    def _resolve(self, level: int, name: str | None) -> str:
        if level == 0:
            return name or ""
        base = self.module.split(".")
        if not self.is_pkg:
            base = base[:-1]
        base = base[: len(base) - (level - 1)] if level > 1 else base
        return ".".join([*base, name] if name else base)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.edges.append((node.lineno, alias.name, (), False))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        target = self._resolve(node.level, node.module)
        self.edges.append((node.lineno, target, tuple(a.name for a in node.names), node.level > 0))

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            value = node.args[0].value
            if isinstance(value, str) and not value.startswith("."):
                self.edges.append((node.lineno, value, (), False))
        self.generic_visit(node)


def _is_submodule(module: str, name: str, root: Path, package: str) -> bool:
    if not (module == package or module.startswith(package + ".")):
        return False
    rel = module[len(package) + 1 :].replace(".", "/") if module != package else ""
    d = root / rel if rel else root
    return (d / f"{name}.py").is_file() or (d / name / "__init__.py").is_file()


def _rule(importer: _Place, target: _Place, target_module: str, relative: bool) -> str | None:
    """The rule an import edge breaks, or None."""
    a, t = importer, target
    if a.area == "src":
        inside = t.area == "src" and t.drop == a.drop and relative
        if not inside and (t.area != "external" or target_module.split(".")[0] == "flashinfer"):
            return "src-self-contained"
        return None
    if t.area == "src" and not (a.area == "shim" and a.drop == t.drop):
        return "src-only-from-shim"
    if t.area in ("shim", "drop_internal") and a.drop != t.drop:
        return "shim-private"
    if t.area in ("drop", "kernel_src") and not (a.drop and a.drop == t.drop):
        if a.area not in ("backends", "tests"):
            return "drop-only-from-backends"
    top_level = target_module in (PACKAGE, PACKAGE + ".layer")
    if a.area == "core" and (t.area not in ("core", "api", "external") or top_level):
        return "core-is-bottom"
    if a.area == "backends" and (t.area in ("modes", "cli") or top_level):
        return "backends-below-layer"
    return None


def check_tree(root: Path, package: str = PACKAGE, tests_root: Path | None = None) -> list[Violation]:
    """Check every module under ``root`` (the directory of ``package``) and, optionally, ``tests_root``."""
    root = Path(root)
    files: list[tuple[Path, str, bool, _Place]] = []
    for path in sorted(root.rglob("*.py")):
        module, is_pkg = _module_name(path, root, package)
        files.append((path, module, is_pkg, _place(module, package)))
    if tests_root is not None:
        for path in sorted(Path(tests_root).rglob("*.py")):
            files.append((path, "tests." + path.stem, False, _Place("tests")))

    out: list[Violation] = []
    for path, module, is_pkg, place in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        col = _Collector(module, is_pkg)
        col.visit(tree)
        for line, target, names, relative in col.edges:
            subs = [n for n in names if _is_submodule(target, n, root, package)]
            targets = [f"{target}.{n}" for n in subs]
            if len(subs) < len(names) or not names:
                targets.append(target)
            for tmod in targets:
                rule = _rule(place, _place(tmod, package), tmod, relative)
                if rule:
                    out.append(Violation(str(path), line, module, tmod, rule))
    return out


def main() -> int:
    here = Path(__file__).resolve().parents[1]
    violations = check_tree(here)
    for v in violations:
        print(v)
    print(f"layering: {len(violations)} violation(s) in {here}")
    return 1 if violations else 0


__all__ = ["PACKAGE", "Violation", "check_tree", "main"]
