"""Print every package of prefixserve, its files and the import edges between them, and the import
cycles inside each package (docs/architecture.md: no cycle inside a package).

    .venv/bin/python tools/import_graph.py             # every package
    .venv/bin/python tools/import_graph.py engine      # one package (a path under prefixserve/)
    .venv/bin/python tools/import_graph.py --cycles    # only the cycles; exit 1 when there is one

An edge is any import of a module of the same package, wherever it stands in the file (a function
body and `if TYPE_CHECKING:` included: a cycle hidden in a function is still two files that need
each other). `from pkg import name` is an edge to `pkg/name.py` where that file exists, else to
`pkg/__init__.py`.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1] / "prefixserve"


@dataclass(frozen=True, slots=True)
class Package:
    """One directory with an `__init__.py`: its files (relative to the directory) and, per file, the
    files of the same package it imports."""

    name: str
    edges: dict[str, list[str]] = field(default_factory=dict)

    @property
    def num_edges(self) -> int:
        return sum(len(targets) for targets in self.edges.values())


def packages(root: pathlib.Path = ROOT) -> list[Package]:
    """Every package under `root` (itself included), in path order. Reads files; changes nothing."""
    dotted_root = root.name
    found = []
    for init in sorted(root.rglob("__init__.py")):
        directory = init.parent
        prefix = ".".join((dotted_root, *directory.relative_to(root).parts))
        files = sorted(p.name for p in directory.glob("*.py"))
        edges = {
            name: sorted(_local_targets(directory / name, prefix, set(files)) - {name}) for name in files
        }
        found.append(Package(prefix.replace(".", "/"), edges))
    return found


def cycles(package: Package) -> list[list[str]]:
    """Import cycles inside the package: for every file on one (a member of a strongly connected
    component of more than one file), a shortest cycle through it, each written from its least name
    and listed once. Sorted; empty when the package's imports form a DAG."""
    found: set[tuple[str, ...]] = set()
    for component in _components(package.edges):
        if len(component) < 2:
            continue
        for name in component:
            loop = _shortest_cycle(package.edges, name, set(component))
            turn = loop.index(min(loop))
            found.add(tuple(loop[turn:] + loop[:turn]))
    return sorted(list(loop) for loop in found)


def render(found: list[Package], only_cycles: bool = False) -> str:
    """The report `main` prints: per package its counts, then (unless `only_cycles`) each file with
    the files it imports, then its cycles as `a.py -> b.py -> a.py`."""
    lines = []
    for package in found:
        loops = cycles(package)
        if only_cycles and not loops:
            continue
        lines.append(
            f"{package.name}: {len(package.edges)} files, {package.num_edges} edges, {len(loops)} cycles"
        )
        if not only_cycles:
            for name, targets in package.edges.items():
                lines.append(f"  {name}" + (f" -> {', '.join(targets)}" if targets else ""))
        lines += [f"  cycle: {' -> '.join([*loop, loop[0]])}" for loop in loops]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", nargs="?", help="a path under prefixserve/, e.g. engine or models/llama")
    parser.add_argument("--cycles", action="store_true", help="only packages with cycles; exit 1 if any")
    args = parser.parse_args(argv)
    found = packages()
    if args.package:
        found = [p for p in found if p.name == f"{ROOT.name}/{args.package.strip('/')}"]
        if not found:
            parser.error(f"no package {args.package} under {ROOT}")
    print(render(found, args.cycles))
    return 1 if args.cycles and any(cycles(p) for p in found) else 0


def _local_targets(path: pathlib.Path, prefix: str, files: set[str]) -> set[str]:
    """Files of the package `prefix` (dotted) that the module at `path` imports."""
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                targets |= _module_file(alias.name, prefix, files)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, prefix, path.name == "__init__.py")
            if module is None:
                continue
            if module != prefix:
                targets |= _module_file(module, prefix, files)
                continue
            # `from pkg import sub, name`: the file `sub.py`, and `__init__.py` for a name defined there
            for alias in node.names:
                targets |= {f"{alias.name}.py"} & files or {"__init__.py"} & files
    return targets


def _absolute(node: ast.ImportFrom, prefix: str, is_init: bool) -> str | None:
    if node.level == 0:
        return node.module
    parts = prefix.split(".")
    # in pkg/mod.py and in pkg/__init__.py alike, one dot is `pkg`
    up = node.level - 1
    if up > len(parts) - 1:
        return None
    base = parts[: len(parts) - up]
    return ".".join(base + ([node.module] if node.module else []))


def _module_file(module: str, prefix: str, files: set[str]) -> set[str]:
    if module == prefix:
        return {"__init__.py"} & files
    if not module.startswith(prefix + "."):
        return set()
    first = module[len(prefix) + 1 :].split(".")[0]
    return {f"{first}.py"} & files  # a deeper module belongs to a subpackage: not an edge here


def _components(edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges.get(root, [])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges.get(child, []))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _shortest_cycle(edges: dict[str, list[str]], start: str, within: set[str]) -> list[str]:
    """Breadth first from `start` back to it, inside one component (which guarantees a way back)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in edges.get(node, []):
                if child not in within:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} has no way back within its component")


if __name__ == "__main__":
    sys.exit(main())
