"""The rules that keep the tree readable (docs/architecture.md, "Rules"), checked by parsing every file:

- no import cycle inside a package (tools/import_graph.py), nor between the subpackages of one package;
- no module reads another module's private (`_name`) attribute or imports one;
- no function over 80 lines, no module over 400 (tests/test_imports.py holds the module cap).

Each test names what breaks the rule, file and line, so the failure says what to fix.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys
from collections.abc import Iterator
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[1]
CODE = [ROOT / "prefixserve", ROOT / "bench", ROOT / "tools", ROOT / "tests"]
MAX_FUNCTION_LINES = 80

# Private names that belong to a library's public surface, or that a library only offers that way.
LIBRARY_PRIVATES = {
    "_replace", "_asdict", "_fields", "_make",  # namedtuple's API
    "_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu",  # torch's int4 ops (torch.ops.aten)
    # argparse lists a parser's flags only through these (tools/flags_doc.py renders --help as a table)
    "_actions", "_SubParsersAction", "_choices_actions", "_AppendAction", "_HelpAction",
    # numpy's one switch for its huge-page advice after import (documented in numpy/_core/_add_newdocs.py;
    # NUMPY_MADVISE_HUGEPAGE only acts at import): models/loaders/gguf.py `small_pages`
    "_set_madvise_hugepage",
}


def load_import_graph() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def python_files(*roots: pathlib.Path) -> Iterator[pathlib.Path]:
    for root in roots:
        yield from sorted(p for p in root.rglob("*.py") if ".venv" not in p.parts)


def test_no_import_cycle_inside_a_package() -> None:
    tool = load_import_graph()
    found = {pkg.name: tool.cycles(pkg) for pkg in tool.packages()}
    assert not {name: c for name, c in found.items() if c}, "import cycles (tools/import_graph.py --cycles)"


def test_no_import_cycle_between_the_subpackages_of_a_package() -> None:
    """models/llama importing models/kernels and models/kernels importing models/llama is a cycle of
    two packages even when each file graph is clean."""
    tool = load_import_graph()
    pkgs = tool.packages()
    names = {p.name for p in pkgs}
    edges: dict[str, set[str]] = {n: set() for n in names}
    for path in python_files(ROOT / "prefixserve"):
        here = str(path.parent.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            for dotted in targets:
                if not dotted.startswith("prefixserve"):
                    continue
                parts = dotted.split(".")
                while parts and "/".join(parts) not in names:
                    parts.pop()
                there = "/".join(parts)
                # a package importing its own parent's __init__ re-exports is not an edge between siblings
                if there and there != here and pathlib.PurePath(there).parent == pathlib.PurePath(here).parent:
                    edges[here].add(there)
    seen_cycles = [(a, b) for a in edges for b in edges[a] if a in _reach(edges, b)]
    assert not seen_cycles, f"sibling packages that import each other (directly or around): {sorted(seen_cycles)}"


def _reach(edges: dict[str, set[str]], start: str) -> set[str]:
    todo, seen = [start], {start}
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _own_names(tree: ast.AST) -> set[str]:
    """Names a module defines itself: functions, classes, assigned names, arguments, and attributes
    it sets or defines on `self` / `cls` (another instance of its own class may read those)."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
    return own


def private_reads(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    own = _own_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if _private(a.name)]
        elif (isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{path.name}:{node.lineno} reads .{node.attr}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in LIBRARY_PRIVATES


def test_no_module_reads_another_modules_private_names() -> None:
    found = {str(p.relative_to(ROOT)): r for p in python_files(ROOT / "prefixserve", ROOT / "bench", ROOT / "tools")
             if (r := private_reads(p))}
    assert not found, found


def test_private_reads_are_seen(tmp_path: pathlib.Path) -> None:
    """The check above can fail: an import of another module's private name, and a read of another
    object's private field; a class reading its own field on another instance is fine."""
    path = tmp_path / "probe.py"
    path.write_text(
        "from a import _hidden\n\ndef f(core):\n    return core._reserved\n\n"
        "class A:\n    def g(self, o):\n        self._x = 1\n        return o._x\n"
    )
    assert private_reads(path) == ["probe.py:1 imports _hidden", "probe.py:4 reads ._reserved"]


def long_functions(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_80_lines() -> None:
    found = [f for p in python_files(*CODE) for f in long_functions(p)]
    assert not found, found
