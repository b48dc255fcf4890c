"""Layers of crf-diloco (an import-linter-style check): the protocol never imports the launch layer.

Layers, lowest first: ``replica_env`` (the environment contract: no crf_diloco imports) < the protocol (auth, wire,
records, store, allreduce, manager, ...) < the launch layer (``executors``, ``cli``). A module may import only its
own layer or lower ones; every module of the package must be in a layer, so a new one has to be placed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import crf_diloco

PACKAGE = Path(crf_diloco.__file__).parent
CONTRACT = {"crf_diloco.replica_env", "crf_diloco._version"}
LAUNCH_PREFIXES = ("crf_diloco.executors", "crf_diloco.cli", "crf_diloco.__main__")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every crf_diloco module ``source`` (the code of ``module``) imports, at any depth (function bodies and
    TYPE_CHECKING blocks too), relative imports resolved."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] == "crf_diloco"}


def _layer(module: str) -> int:
    if module in CONTRACT:
        return 0
    if module.startswith(LAUNCH_PREFIXES) or module == "crf_diloco":
        return 2  # the package root re-exports everything lazily
    return 1


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[_module_name(p) for p in MODULES])
def test_no_module_imports_a_higher_layer(path: Path) -> None:
    module = _module_name(path)
    imports = _imports(path.read_text(), module, path.name == "__init__.py")
    upward = sorted(name for name in imports if _layer(name) > _layer(module) and name != "crf_diloco")
    assert not upward, f"{module} (layer {_layer(module)}) imports higher layers: {upward}"


def test_the_protocol_runs_without_the_launch_layer() -> None:
    code = (
        "import sys, crf_diloco.allreduce, crf_diloco.manager, crf_diloco.checkpoint\n"
        "print(sorted(m for m in sys.modules if m.startswith(('crf_diloco.executors', 'crf_diloco.cli'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_checker_sees_an_upward_import() -> None:
    """The check can fail: a protocol module importing the launch layer is caught (relative imports too)."""
    source = "from .executors import base\nimport crf_diloco.cli\n\ndef f():\n    from crf_diloco import executors\n"
    found = _imports(source, "crf_diloco.wire")
    assert {"crf_diloco.executors", "crf_diloco.executors.base", "crf_diloco.cli"} <= found
    assert max(_layer(name) for name in found) > _layer("crf_diloco.wire")
