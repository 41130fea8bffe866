"""The module list of the server package, podbay-server (its metadata is in pyproject.toml).

The import name ``podbay`` is shared by two packages built from this repository. The client package
(libs/pyproject.toml) ships ``podbay/__init__.py`` and the client modules it lists; this one ships the
services and every other module of libs/podbay beside them. So a module new in libs/podbay is a server module
unless the client's list names it, and the client wheel stays free of server code.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _package_dirs() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def server_modules() -> tuple[list[str], list[str]]:
    """``(packages, py_modules)`` of the server package: every package under pyproject's package-dir
    folders, less the client package's packages and modules (whose ``podbay/__init__.py`` stays the client's)."""
    client = tomllib.loads((ROOT / "libs" / "pyproject.toml").read_text())["tool"]["setuptools"]
    client_packages = tuple(client["packages"])
    packages: list[str] = []
    modules: list[str] = []
    for name, folder in sorted(_package_dirs().items()):
        found = [f"{name}.{sub}" for sub in find_packages(str(ROOT / folder))]
        if name == "podbay":
            modules += sorted(
                f"podbay.{f.stem}" for f in (ROOT / folder).glob("*.py")
                if f.stem != "__init__" and f"podbay.{f.stem}" not in client["py-modules"]
            )
        else:
            found.insert(0, name)
        packages += [p for p in found if not any(p == c or p.startswith(c + ".") for c in client_packages)]
    return packages, modules


class _BuildPy(build_py):
    """Leaves out ``podbay/__init__.py``, which the listed ``podbay.*`` modules would otherwise bring along:
    it belongs to the client package."""

    def find_modules(self):  # type: ignore[no-untyped-def]
        return [m for m in super().find_modules() if m[:2] != ("podbay", "__init__")]


if __name__ == "__main__":
    packages, py_modules = server_modules()
    setup(packages=packages, py_modules=py_modules, cmdclass={"build_py": _BuildPy})
