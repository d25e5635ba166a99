"""The direction of imports (docs/architecture.md), checked by parsing every module."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "prefixserve"


def imports_of(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def package_imports(pkg: str) -> dict[str, set[str]]:
    base = ROOT / pkg if (ROOT / pkg).is_dir() else ROOT / f"{pkg}.py"
    files = sorted(base.rglob("*.py")) if base.is_dir() else [base]
    return {str(f.relative_to(ROOT)): imports_of(f) for f in files}


def ours(names: set[str]) -> set[str]:
    return {n for n in names if n == "prefixserve" or n.startswith("prefixserve.")}


def test_plain_layers_import_nothing_above_them():
    for pkg in ("types", "config", "cache"):
        for f, names in package_imports(pkg).items():
            allowed = {"prefixserve.types", "prefixserve.config"} | {n for n in names if n.startswith(f"prefixserve.{pkg}")}
            assert ours(names) <= allowed, (f, ours(names) - allowed)
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f


def test_models_import_only_torch_and_themselves():
    for f, names in package_imports("models").items():
        bad = {n for n in ours(names) if not n.startswith(("prefixserve.models", "prefixserve.types"))}
        assert not bad, (f, bad)


def test_runner_never_imports_cache_and_nothing_imports_server():
    for f, names in package_imports("runner").items():
        assert not any(n.startswith("prefixserve.cache") for n in names), f
    for pkg in ("types", "config", "cache", "models", "runner", "engine", "ledger"):
        for f, names in package_imports(pkg).items():
            assert not any(n.startswith("prefixserve.server") for n in names), f


def test_modules_stay_small():
    """A module a reader takes in whole: at most 400 lines (docs/architecture.md)."""
    big = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if len(p.read_text().splitlines()) > 400]
    assert not big, big


def test_kv_events_import_only_the_cache_config_and_types():
    allowed = ("prefixserve.kvevents", "prefixserve.cache", "prefixserve.config", "prefixserve.types")
    for f, names in package_imports("kvevents").items():
        assert all(n.startswith(allowed) for n in ours(names)), (f, ours(names))
        assert not any(n == "torch" or n.startswith("torch.") for n in names), f
