"""Contract audit: import a candidate ``src/`` in isolation (CPU only) and check it against the shim's
table (``kernel_helpers.SRC_SYMBOLS``). Every missing module or symbol and every changed signature is
reported together with the shim files that depend on it."""

from __future__ import annotations

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

    def __str__(self) -> str:
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


def audit_src(src_dir: Path, symbols: dict[str, SrcSymbol] | None = None) -> list[AuditProblem]:
    """Every break between the shim's contract table and the drop in ``src_dir`` ([] = compatible)."""
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
    return problems


__all__ = ["AuditProblem", "audit_src", "isolated_src"]
