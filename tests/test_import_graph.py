"""tools/import_graph.py: the files, edges and cycles it reports for a package whose imports are
known, and that it reads the real tree. The real tree's cycles are reported, not held to zero here
(tests/test_imports.py holds the layering)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_edges_and_cycles_of_a_known_package(tmp_path: pathlib.Path) -> None:
    tool = load_tool()
    root = tmp_path / "pkg"
    write(
        root,
        {
            "__init__.py": "from pkg.core import Core\nVERSION = 1\n",
            "core.py": "from pkg import helpers\nfrom pkg.plan import Plan\n",
            "plan.py": "def f():\n    from .core import Core  # lazy: still an edge\n",
            "helpers.py": "import os\nfrom pkg import VERSION\n",
            "leaf.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.deep import X\n",
            "sub/__init__.py": "",
            "sub/deep.py": "from ..leaf import f\nfrom . import other\n",
            "sub/other.py": "from pkg.sub import deep\n",
        },
    )
    found = {p.name: p for p in tool.packages(root)}
    assert list(found) == ["pkg", "pkg/sub"]
    assert found["pkg"].edges == {
        "__init__.py": ["core.py"],
        "core.py": ["helpers.py", "plan.py"],
        "helpers.py": ["__init__.py"],
        "leaf.py": [],  # pkg.sub.deep belongs to the subpackage
        "plan.py": ["core.py"],
    }
    assert found["pkg/sub"].edges == {"__init__.py": [], "deep.py": ["other.py"], "other.py": ["deep.py"]}
    assert tool.cycles(found["pkg"]) == [
        ["__init__.py", "core.py", "helpers.py"],
        ["core.py", "plan.py"],
    ]
    assert tool.cycles(found["pkg/sub"]) == [["deep.py", "other.py"]]
    assert tool.render([found["pkg/sub"]]).splitlines() == [
        "pkg/sub: 3 files, 2 edges, 1 cycles",
        "  __init__.py",
        "  deep.py -> other.py",
        "  other.py -> deep.py",
        "  cycle: deep.py -> other.py -> deep.py",
    ]


def test_reads_every_package_of_the_tree() -> None:
    tool = load_tool()
    names = [p.name for p in tool.packages()]
    assert names[0] == "prefixserve" and {"prefixserve/cache", "prefixserve/engine"} <= set(names)
    report = tool.render(tool.packages())
    assert all(f"{name}: " in report for name in names)
