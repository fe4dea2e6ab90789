"""The package's structure: no import circles, no private names imported across modules.

Every ``import`` inside ``cpkv`` (lazy and ``TYPE_CHECKING`` ones included) is an edge of a
module graph; the graph must be acyclic, and no module may import a ``_private`` name
from another cpkv module. Notebook helpers live with the notebooks, not in the wheel.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cpkv"


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> tuple[dict[str, set[str]], list[str]]:
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {name: set() for name in modules}
    private: list[str] = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [(alias.name, "") for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [(base, alias.name) for alias in node.names]
            else:
                continue
            for base, imported in targets:
                full = f"{base}.{imported}" if imported else base
                target = full if full in modules else base
                if target in modules and target != name:
                    edges[name].add(target)
                if imported.startswith("_") and not imported.startswith("__") and base in modules and base != name:
                    private.append(f"{name} imports {base}.{imported}")
    return edges, private


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        state[node] = 2
        stack.pop()
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_no_import_circles() -> None:
    edges, _ = _imports()
    assert _cycle(edges) is None, " -> ".join(_cycle(edges) or [])


def test_no_private_names_across_modules() -> None:
    _, private = _imports()
    assert not private


def test_the_checker_finds_a_circle() -> None:
    """The checker itself can fail: a two-module circle is found."""
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_notebook_helpers_are_not_in_the_wheel() -> None:
    assert not (PACKAGE / "tutorial.py").exists()


def test_nothing_outside_the_tests_imports_the_test_suite() -> None:
    """Scripts, benchmarks, examples and the package import no ``tests`` module (shared cases live in cpkv.bench)."""
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for folder in ("cpkv", "scripts", "benchmarks", "examples"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                offenders += [f"{path.relative_to(root)}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert not offenders


def test_each_script_name_is_used_once() -> None:
    """Two scripts of one file name (e.g. two compile_report.py) would be two jobs under one name."""
    root = Path(__file__).resolve().parents[1]
    names = [p.name for folder in ("scripts", "benchmarks") for p in (root / folder).glob("*.py")]
    assert len(names) == len(set(names)), sorted(names)
