"""Repository checks on the documentation: every pytest node id the docs cite exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NODE_ID = re.compile(r"(packages/[\w.-]+/tests/[\w/.-]+\.py)::([\w:\[\]-]+)")
DOCUMENTS = sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md", *ROOT.glob("packages/*/README.md")])


def defined_names(path: Path) -> set[str]:
    """`name` and `Class::name` for every test function and class defined in a test module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names |= {
                f"{node.name}::{item.name}"
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
    return names


def cited_node_ids() -> list[tuple[str, str, str]]:
    cited = []
    for doc in DOCUMENTS:
        for match in NODE_ID.finditer(doc.read_text(encoding="utf-8")):
            cited.append((str(doc.relative_to(ROOT)), match.group(1), match.group(2)))
    return cited


def test_docs_cite_some_tests() -> None:
    assert any(doc == "docs/TROUBLESHOOTING.md" for doc, _, _ in cited_node_ids())


@pytest.mark.parametrize(("doc", "path", "name"), cited_node_ids())
def test_cited_node_id_exists(doc: str, path: str, name: str) -> None:
    module = ROOT / path
    assert module.is_file(), f"{doc} cites {path}, which does not exist"
    bare = name.split("[", 1)[0]
    assert bare in defined_names(module), f"{doc} cites {path}::{name}, but {path} defines no {bare}"
