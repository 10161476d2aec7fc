"""Every third-party module the package imports is a declared runtime dependency.

(`.ci/run` installs the test extra too, which pulls in more packages; this catches a runtime
dependency that only arrives through the test extra.)
"""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _imported_top_level_modules() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "proxy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "proxy"}


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-")


def test_runtime_imports_are_declared_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_normalise(Requirement(r).name) for r in project["dependencies"]}
    owners = packages_distributions()
    missing = {}
    for module in sorted(_imported_top_level_modules()):
        dists = {_normalise(d) for d in owners.get(module, [module])}
        if not dists & declared:
            missing[module] = sorted(dists)
    assert not missing, f"imported by proxy/ but not in [project].dependencies: {missing}"
