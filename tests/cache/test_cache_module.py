"""prefixserve/cache stays pure (no torch, nothing of ours but types and config), small and fast."""

from __future__ import annotations

import ast
from pathlib import Path

import prefixserve.cache

CACHE_DIR = Path(prefixserve.cache.__file__).parent
ALLOWED_OURS = {"prefixserve.types", "prefixserve.config"}
FORBIDDEN_THIRD_PARTY = {"torch", "numpy", "transformers"}


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against prefixserve.cache
                base = ["prefixserve", "cache"][: 2 - (node.level - 1)]
                modules.add(".".join([*base, node.module] if node.module else base))
            else:
                assert node.module is not None
                modules.add(node.module)
    return modules


def test_cache_imports_only_types_config_and_itself() -> None:
    files = sorted(CACHE_DIR.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "prefix_cache.py", "index.py", "state.py", "stats.py"}
    for path in files:
        for module in imported_modules(path):
            top = module.split(".")[0]
            assert top not in FORBIDDEN_THIRD_PARTY, f"{path.name} imports {module}"
            if top == "prefixserve":
                ok = (
                    module in ALLOWED_OURS
                    or module == "prefixserve.cache"
                    or module.startswith("prefixserve.cache.")
                )
                assert ok, f"{path.name} imports {module}"


def test_modules_stay_small() -> None:
    for path in CACHE_DIR.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 400, path.name  # as every module (tests/test_imports.py)
