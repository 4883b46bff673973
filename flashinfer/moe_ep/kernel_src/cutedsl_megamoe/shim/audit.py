"""Contract audit: import a candidate ``src/`` in isolation (CPU only) and check it against the shim's
table (``kernel_helpers.SRC_SYMBOLS``). Every missing module or symbol and every changed signature is
reported together with the shim files that depend on it; so is every source line that the CuTe DSL would
silently compile into something else (``dsl_hazards``)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .frontend import prepare_compile_env
from .kernel_helpers import SRC_SYMBOLS, SrcSymbol


@dataclass(frozen=True)
class AuditProblem:
    symbol: str
    problem: str
    used_by: tuple[str, ...]
    #: ``contract``: against ``SRC_SYMBOLS``; ``dsl``: a ``dsl_hazards`` line (``symbol`` is file:line)
    kind: str = "contract"

    def __str__(self) -> str:
        if self.kind == "dsl":
            return f"src/{self.symbol}: {self.problem}"
        return (
            f"{self.symbol}: {self.problem} "
            f"(declared in shim/kernel_helpers.py SRC_SYMBOLS[{self.symbol!r}]; used by {', '.join(self.used_by)})"
        )


@contextmanager
def isolated_src(src_dir: Path) -> Iterator[str]:
    """Import ``src_dir`` as a package under a fresh private name; remove every module of it afterwards."""
    alias = f"_moe_ep_candidate_{uuid.uuid4().hex[:12]}"
    init = Path(src_dir) / "__init__.py"
    if not init.is_file():
        raise FileNotFoundError(f"{src_dir} is not a package (no __init__.py)")
    spec = importlib.util.spec_from_file_location(alias, init, submodule_search_locations=[str(src_dir)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    try:
        spec.loader.exec_module(module)
        yield alias
    finally:
        for name in [m for m in sys.modules if m == alias or m.startswith(alias + ".")]:
            del sys.modules[name]


def _params(fn: object, skip_self: bool = True) -> list[inspect.Parameter] | None:
    target = inspect.unwrap(fn) if callable(fn) else fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if skip_self and params and params[0].name == "self":
        params = params[1:]
    return params


def _check_class(name: str, sym: SrcSymbol, obj: object) -> list[AuditProblem]:
    out = []
    if sym.init_params is not None:
        params = _params(obj.__init__)  # type: ignore[misc]
        if params is None:
            out.append(AuditProblem(name, "constructor signature cannot be read", sym.used_by))
        else:
            names = {p.name for p in params}
            has_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
            for p in sym.init_params:
                if p not in names and not has_kwargs:
                    out.append(
                        AuditProblem(name, f"constructor lost the parameter {p!r} that the shim passes", sym.used_by)
                    )
            for p in params:
                required = p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                if required and p.name not in sym.init_params:
                    out.append(
                        AuditProblem(
                            name,
                            f"constructor has a new required parameter {p.name!r} the shim does not pass",
                            sym.used_by,
                        )
                    )
    if sym.call_params is not None:
        params = _params(obj.__call__)  # type: ignore[operator]
        got = tuple(p.name for p in params) if params is not None else None
        if got != sym.call_params:
            out.append(
                AuditProblem(
                    name, f"__call__ parameters changed: shim passes {sym.call_params}, drop takes {got}", sym.used_by
                )
            )
    return out


#: Names the CuTe DSL's preprocessor gives its own parameters. nvidia-cutlass-dsl 4.8.1 turns a dynamic ``if``
#: into a function whose first parameter, the condition, is named ``pred`` (renamed only when the body assigns
#: that name), so a variable ``pred`` read inside the body silently reads the condition instead: an
#: ``if lane == 0: if pred:`` compiles to ``if lane == 0: if lane == 0:`` (drop v43's decode_bulk lost its
#: guard this way and read past its weights). ``tests/kernel_src/cutedsl_megamoe/test_dsl_hazards.py``
#: checks that the installed DSL still does this.
DSL_REGION_NAMES = ("pred",)
_DSL_USERS = ("every @cute.jit / @cute.kernel function (the CuTe DSL preprocessor)",)


def _last_name(node: ast.expr) -> str | None:
    """``b`` of ``a.b`` or of ``b``."""
    return getattr(node, "attr", getattr(node, "id", None))


def _preprocessed(fn: ast.FunctionDef) -> bool:
    """Whether the DSL rewrites ``fn``'s control flow: decorated ``@cute.jit`` / ``@cute.kernel``."""
    return any(_last_name(d.func if isinstance(d, ast.Call) else d) in ("jit", "kernel") for d in fn.decorator_list)


def _is_const_expr(test: ast.expr) -> bool:
    """``if cutlass.const_expr(...)``: decided at trace time, no region function."""
    return isinstance(test, ast.Call) and _last_name(test.func) == "const_expr"


def dsl_hazards(src_dir: Path) -> list[AuditProblem]:
    """Every read of a name in ``DSL_REGION_NAMES`` inside the body of a dynamic ``if`` of a DSL function
    under ``src_dir`` (file, line, function): the DSL compiles it as a read of the ``if``'s condition."""
    src_dir = Path(src_dir)
    out = []
    for path in sorted(src_dir.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for fn in ast.walk(tree):
            if not (isinstance(fn, ast.FunctionDef) and _preprocessed(fn)):
                continue
            seen = set()
            for node in ast.walk(fn):
                if not isinstance(node, ast.If) or _is_const_expr(node.test):
                    continue
                for stmt in node.body + node.orelse:
                    for x in ast.walk(stmt):
                        if isinstance(x, ast.Name) and x.id in DSL_REGION_NAMES and isinstance(x.ctx, ast.Load):
                            seen.add((x.lineno, x.id))
            rel = path.relative_to(src_dir).as_posix()
            for line, name in sorted(seen):
                out.append(AuditProblem(
                    f"{rel}:{line} ({fn.name})",
                    f"reads {name!r} inside a dynamic if: the CuTe DSL names the if's condition {name!r}, so this "
                    "read is the condition (rename the variable)",
                    _DSL_USERS,
                    kind="dsl",
                ))  # fmt: skip
    return out


def audit_src(src_dir: Path, symbols: dict[str, SrcSymbol] | None = None) -> list[AuditProblem]:
    """Every break between the shim's contract table and the drop in ``src_dir``, and every ``dsl_hazards``
    line ([] = compatible)."""
    symbols = symbols or SRC_SYMBOLS
    prepare_compile_env()  # heavy modules import cutlass; target sm_90a on a CPU-only machine
    problems: list[AuditProblem] = []
    with isolated_src(Path(src_dir)) as alias:
        modules: dict[str, ModuleType | Exception] = {}
        for name, sym in symbols.items():
            if sym.module not in modules:
                try:
                    modules[sym.module] = importlib.import_module(f"{alias}.{sym.module}")
                except Exception as exc:
                    modules[sym.module] = exc
            mod = modules[sym.module]
            if isinstance(mod, Exception):
                problems.append(AuditProblem(name, f"module src/{sym.module} fails to import: {mod!r}", sym.used_by))
                continue
            if not sym.attr:
                continue
            if not hasattr(mod, sym.attr):
                problems.append(AuditProblem(name, f"src/{sym.module} has no attribute {sym.attr!r}", sym.used_by))
                continue
            obj = getattr(mod, sym.attr)
            if inspect.isclass(obj):
                problems.extend(_check_class(name, sym, obj))
    return problems + dsl_hazards(Path(src_dir))


__all__ = ["DSL_REGION_NAMES", "AuditProblem", "audit_src", "dsl_hazards", "isolated_src"]
