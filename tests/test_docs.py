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


def composer_config_fields() -> list[str]:
    """The fields ``ComposerConfig`` adds to TRL's ``GRPOConfig`` (read from the source: no TRL needed)."""
    path = ROOT / "packages/crf-core/src/crf_core/trainer/config.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ComposerConfig"]
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


@pytest.mark.parametrize("name", composer_config_fields())
def test_every_composer_config_field_is_documented(name: str) -> None:
    page = (ROOT / "docs/packages/crf-core-trainer.md").read_text(encoding="utf-8")
    assert f"| `{name}` |" in page, f"docs/packages/crf-core-trainer.md has no table row for ComposerConfig.{name}"


def test_bug_report_section_keeps_the_seeds_rules() -> None:
    """TROUBLESHOOTING's bug-report section keeps the seed's rules: no secrets, the failing test, regression or not,
    one bug per report."""
    text = (ROOT / "docs" / "TROUBLESHOOTING.md").read_text(encoding="utf-8")
    section = text[text.index("## How to file a bug report") :].lower()
    for rule in ("never paste api keys, tokens", "name the failing test", "whether it regressed", "one bug per report"):
        assert rule in section, rule


def test_guide_ablation_table_is_what_the_ablation_script_wrote() -> None:
    """The guide's ablation table is rendered from ``docs/ablation.json`` (what `benchmarks/main_job_ablation.py
    --update-docs` wrote from its runs), so it cannot drift from the measurement it reports."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("main_job_ablation", ROOT / "benchmarks" / "main_job_ablation.py")
    assert spec is not None
    assert spec.loader is not None
    ablation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablation)
    record = json.loads((ROOT / "docs" / "ablation.json").read_text(encoding="utf-8"))
    guide = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    block = guide.split(ablation.START, 1)[1].split(ablation.END, 1)[0].strip()
    assert block == ablation.table(record).strip()
    for arm, runs in record["runs"].items():
        assert {r["seed"] for r in runs} <= set(record["seeds"]), arm


def test_guide_sample_output_is_the_ablation_composed_seed_0_run() -> None:
    """The guide's sample output of the default run (seed 0) prints the held-out figures `docs/ablation.json` holds
    for the composed recipe on seed 0: a rerun of the job on new code cannot leave the sample stale."""
    import json

    record = json.loads((ROOT / "docs" / "ablation.json").read_text(encoding="utf-8"))
    run = next(r for r in record["runs"]["composed"] if r["seed"] == 0)
    guide = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    for subset, change in (("all ", run["change"]), ("hard", run["subsets"]["hard"]["change"])):
        line = re.search(rf"^  {subset} \(\d+ tasks\): before RL ([\d.]+) .* change ([+-][\d.]+) ", guide, re.M)
        assert line is not None, f"the guide's sample output has no '{subset.strip()}' line"
        before = run["before"] if subset == "all " else run["subsets"]["hard"]["before"]
        assert (line[1], line[2]) == (f"{before:.3f}", f"{change:+.3f}"), (subset, line[0])
