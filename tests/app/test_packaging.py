"""Every third-party module the package imports is a declared runtime dependency; the image's user
can be made on Debian.

(`.ci/run` installs the test extra too, which pulls in more packages; this catches a runtime
dependency that only arrives through the test extra.)
"""

from __future__ import annotations

import ast
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
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


def test_the_dockerfiles_user_can_be_created_on_debian(tmp_path: Path) -> None:
    """The image's `useradd` line, run against a copy of this Debian machine's account files (the
    image is Debian too): it succeeds (a user named `proxy`, which Debian already has, failed the
    build) and makes uid 10001, the uid the image runs as and the Kubernetes manifests name."""
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    if os.geteuid() != 0 or not Path(useradd).exists():
        pytest.skip("needs root and useradd (CI has both)")
    line = next(
        line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("RUN useradd ")
    )
    argv = shlex.split(line.removeprefix("RUN "))
    (tmp_path / "etc").mkdir()
    for name in ("passwd", "group", "shadow", "gshadow", "login.defs"):
        if Path("/etc", name).exists():
            shutil.copy(Path("/etc", name), tmp_path / "etc" / name)
    argv = [useradd, "-P", str(tmp_path), *[a for a in argv[1:] if a != "--create-home"]]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    user = argv[-1]
    entry = next(
        row for row in (tmp_path / "etc" / "passwd").read_text().splitlines() if row.startswith(user + ":")
    )
    assert entry.split(":")[2] == "10001"
    assert "USER 10001" in (ROOT / "Dockerfile").read_text()
