"""Every shell command in the docs and READMEs runs as written, or is checked, or is skipped for a stated reason.

The commands are the lines of the fenced ``bash``/``sh``/``shell``/``console`` blocks of docs/*.md,
docs/packages/*.md, README.md and packages/*/README.md (backslash continuations joined, ``#`` comments dropped).
Each one must match exactly one rule of `RULES`:

- ``run``: executed here, in a temporary folder with a tiny input (a replica script that reports its environment;
  ``crf-diloco`` is this checkout's, ``python -m crf_diloco`` with ``packages/crf-diloco/src`` on the path);
- ``check``: what can be checked without the long run or the service: the command is parsed by the real argument
  parser of the program it calls (``crf-diloco launch`` for the cloud executors, ``examples/composer_main.py``),
  the test files a pytest command names exist, the nox sessions it names are defined, the files it runs exist;
- ``skip``: not run, with the reason (installs from an index, needs an account, a release step, ...).

Inline ``code`` in prose is not extracted (it is mostly fragments of these commands).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted(
    [*ROOT.glob("docs/*.md"), *ROOT.glob("docs/packages/*.md"), ROOT / "README.md", *ROOT.glob("packages/*/README.md")]
)
SHELL_FENCES = ("bash", "sh", "shell", "console")
DILOCO_SRC = ROOT / "packages" / "crf-diloco" / "src"


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str  # as written, continuations joined
    argv: tuple[str, ...]  # shell words, comments dropped

    @property
    def words(self) -> str:
        return " ".join(self.argv)

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.words}"


def documented_commands(documents: list[Path] = DOCUMENTS, root: Path = ROOT) -> list[Command]:
    commands = []
    for doc in documents:
        lines = doc.read_text(encoding="utf-8").splitlines()
        fence: str | None = None
        pending, start = "", 0
        for number, line in enumerate(lines, 1):
            stripped = line.strip()
            if stripped.startswith("```"):
                fence = None if fence is not None else stripped[3:].strip()
                continue
            if fence not in SHELL_FENCES:
                continue
            if not pending:
                start = number
                stripped = stripped[2:] if stripped.startswith("$ ") else stripped
            pending = f"{pending} {stripped}".strip()
            if pending.endswith("\\"):
                pending = pending[:-1].rstrip()
                continue
            argv = tuple(shlex.split(pending, comments=True))
            if argv:
                commands.append(Command(str(doc.relative_to(root)), start, pending, argv))
            pending = ""
    return commands


# -- the checks ---------------------------------------------------------------------------------------------------

REPLICA = """\
import json, os
names = ["CRF_DILOCO_RANK", "CRF_DILOCO_WORLD_SIZE", "CRF_DILOCO_URI", "RANK", "WORLD_SIZE", "LOCAL_RANK"]
print("REPLICA", json.dumps({name: os.environ.get(name) for name in names}), flush=True)
"""


def _diloco_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(DILOCO_SRC), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def run_local_launch(command: Command, tmp_path: Path) -> None:
    """``crf-diloco launch`` with the local executor, for real, on a replica script that reports itself."""
    argv = list(command.argv)
    if "torchrun" in argv and (shutil.which("torchrun") is None or not _importable("torch")):
        pytest.skip("needs torch and torchrun")
    if "accelerate" in argv and shutil.which("accelerate") is None:
        pytest.skip("needs accelerate (not a dependency of crf; only the torchrun form is tested)")
    (tmp_path / "train.py").write_text(REPLICA if "torchrun" not in argv else _TORCHRUN_REPLICA)
    (tmp_path / "my_project").mkdir()
    (tmp_path / "my_project" / "__init__.py").write_text("")
    (tmp_path / "my_project" / "train.py").write_text(REPLICA)
    proc = subprocess.run(
        [sys.executable, "-m", "crf_diloco", *argv[1:]],
        cwd=tmp_path, env=_diloco_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
    replicas = int(argv[argv.index("--replicas") + 1])
    reports = [line for line in proc.stdout.splitlines() if " REPLICA " in line]
    processes = 2 if "--nproc-per-node" in argv else 1
    assert len(reports) == replicas * processes, proc.stdout
    assert f"{replicas} of {replicas} replicas succeeded" in proc.stderr


_TORCHRUN_REPLICA = """\
import json, os
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()  # both workers are connected before either leaves
record = {"replica": os.environ["CRF_DILOCO_RANK"], "rank": dist.get_rank()}
os.write(1, ("REPLICA " + json.dumps(record) + "\\n").encode())  # one write: the workers share torchrun's stdout
dist.destroy_process_group()
"""


def parse_cloud_launch(command: Command, tmp_path: Path) -> None:
    """A cloud ``crf-diloco launch``: the real parser accepts it and the options fit together (nothing starts)."""
    (tmp_path / "train.py").write_text(REPLICA)
    program = (
        "import sys\n"
        "from crf_diloco.cli import _check_executor_options, _check_target, _subcommand, build_parser\n"
        "parser = build_parser()\n"
        "args = parser.parse_args(sys.argv[1:])\n"
        "launch = _subcommand(parser, 'launch')\n"
        "_check_executor_options(args, launch)\n"
        "_check_target(args, launch)\n"
        "print('PARSED', args.executor, args.replicas)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", program, *command.argv[1:]],
        cwd=tmp_path, env=_diloco_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, f"{command}\n{proc.stderr}"
    assert "PARSED" in proc.stdout, command


def check_synopsis(command: Command, tmp_path: Path) -> None:
    """A synopsis: every option it shows is an option of ``crf-diloco launch --help``."""
    proc = subprocess.run(
        [sys.executable, "-m", "crf_diloco", "launch", "--help"],
        env=_diloco_env(), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    options = set(re.findall(r"--(?:\[no-\])?[a-z][a-z-]*|(?<![\w-])-m(?![\w-])", command.text))
    for option in options:
        option = option.replace("[no-]", "")
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", proc.stdout), f"{command}: {option} is no option"


def check_pytest(command: Command, tmp_path: Path) -> None:
    """A pytest command: the files and node ids it names exist (running the suites takes minutes)."""
    targets = [a for a in command.argv if a.startswith(("packages/", "tests/"))]
    assert targets, command
    for target in targets:
        path, _, name = target.partition("::")
        assert (ROOT / path).exists(), f"{command}: {path} does not exist"
        if name:
            tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
            defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            assert name.split("[")[0] in defined, f"{command}: {path} defines no {name}"


def _nox_sessions() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("session" in ast.unparse(d) for d in node.decorator_list):
            names.add(node.name)
    return names


def check_nox(command: Command, tmp_path: Path) -> None:
    """A nox command: every session it names is defined in noxfile.py (the sessions themselves run in CI)."""
    argv = list(command.argv)
    argv = argv[argv.index("nox") :]
    if "-s" not in argv:
        return  # plain `nox`: the default sessions
    end = argv.index("--") if "--" in argv else len(argv)
    wanted = [a for a in argv[argv.index("-s") + 1 : end] if not a.startswith("-")]
    sessions = _nox_sessions()
    for name in wanted:
        assert re.sub(r"[-(].*$", "", name) in sessions, f"{command}: no nox session {name!r}"


def check_composer_main(command: Command, tmp_path: Path) -> None:
    """The main job: ``--help`` lists every flag as written; with torch here, its real parser accepts the values too
    (``parse_args`` imports torch to pick the device). The run itself takes minutes."""
    argv = list(command.argv)
    flags = [os.path.expandvars(f) for f in argv[argv.index("examples/composer_main.py") + 1 :]]  # as the shell would
    script = str(ROOT / "examples" / "composer_main.py")
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60, check=True)
    for flag in (f.split("=", 1)[0] for f in flags if f.startswith("--")):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", shown.stdout), f"{command}: {flag} is no option"
    if not _importable("torch"):
        return
    program = "import sys, composer_main\ncomposer_main.parse_args(sys.argv[1:])\nprint('PARSED')\n"
    path = os.pathsep.join(filter(None, [str(ROOT / "examples"), os.environ.get("PYTHONPATH")]))  # as for the script
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", program, *flags], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{command}\n{proc.stderr}"
    assert "PARSED" in proc.stdout, command


def check_file_exists(command: Command, tmp_path: Path) -> None:
    """A script the command runs exists (a benchmark: minutes of measuring)."""
    scripts = [a for a in command.argv if a.endswith(".py")]
    assert scripts, command
    assert all((ROOT / s).is_file() for s in scripts), command


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@dataclass(frozen=True)
class Rule:
    pattern: str  # matched (re.search) against the command's words
    kind: str  # "run", "check" or "skip"
    reason: str
    check: Callable[[Command, Path], None] | None = None


RULES = [
    Rule(r"^crf-diloco launch --replicas N ", "check", "a synopsis", check_synopsis),
    Rule(r"^python -m crf_diloco launch \.\.\.$", "skip", "a synopsis: `...` stands for the options above"),
    Rule(
        r"^crf-diloco launch (?!--replicas N )(?!.*--executor (ray|hf|modal))",
        "run",
        "the local executor",
        run_local_launch,
    ),
    Rule(r"^crf-diloco launch .*--executor (hf|modal)", "check", "needs the service (an account)", parse_cloud_launch),
    Rule(r"^crf-diloco launch .*--executor ray", "check", "needs a Ray cluster or ray installed", parse_cloud_launch),
    Rule(r"^crf-replaysim ", "skip", "covered by crf-replaysim's own CLI tests"),
    Rule(r"(^|[/ ])python -m pytest ", "check", "runs a test suite (minutes)", check_pytest),
    Rule(r"(^|&& )nox( |$)", "check", "a nox session (minutes; CI runs them)", check_nox),
    Rule(r"^python examples/composer_main\.py", "check", "a training run (minutes)", check_composer_main),
    Rule(r"benchmarks/\S+\.py$", "check", "a benchmark (minutes)", check_file_exists),
    Rule(
        r"^(python -m )?pip install (?!.*&& nox)|^uv (pip install|add) ",
        "skip",
        "installs from a package index (network)",
    ),
    Rule(r"^(sudo )?(apt-get|dnf) install ", "skip", "a system package manager (root, network)"),
    Rule(r"^(hf auth login|modal token new|modal secret create )", "skip", "needs an account on the service"),
    Rule(r"^export ", "skip", "sets variables (credentials) in your shell"),
    Rule(r"^(source |cd )", "skip", "changes the shell's state (nothing to check on its own)"),
    Rule(r"^uv sync$", "skip", "resolves and installs the whole workspace (network, minutes)"),
    Rule(
        r"^(\$EDITOR |uv lock$|rm -rf dist|uvx twine|git commit|git push|uv publish)",
        "skip",
        "a release step (edits, builds, tags, publishes)",
    ),
]


def rule_for(command: Command) -> list[Rule]:
    return [rule for rule in RULES if re.search(rule.pattern, command.words)]


COMMANDS = documented_commands()


def test_the_docs_hold_commands() -> None:
    assert len(COMMANDS) > 50
    assert any(c.doc == "docs/hf-jobs.md" and c.argv[:2] == ("crf-diloco", "launch") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_every_documented_command_has_exactly_one_rule(command: Command) -> None:
    matching = rule_for(command)
    assert len(matching) == 1, f"{command}: matches {[r.pattern for r in matching]}; add a rule (or fix the docs)"


def test_every_rule_is_used() -> None:
    used = {rule.pattern for command in COMMANDS for rule in rule_for(command)}
    assert [r.pattern for r in RULES if r.pattern not in used] == []


@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if [r.kind for r in rule_for(c)] in (["run"], ["check"])], ids=str
)
def test_documented_command_runs_or_checks_as_written(command: Command, tmp_path: Path) -> None:
    (rule,) = rule_for(command)
    assert rule.check is not None
    rule.check(command, tmp_path)


def test_the_extractor_joins_continuations_and_drops_comments(tmp_path: Path) -> None:
    text = "```python\nx = 1\n```\n```bash\ncrf-diloco launch --replicas 2 \\\n    --uri ./store train.py   # a comment\n```\n"
    doc = tmp_path / "probe.md"
    doc.write_text(text)
    (probe,) = documented_commands([doc], tmp_path)
    assert probe.argv == ("crf-diloco", "launch", "--replicas", "2", "--uri", "./store", "train.py")
    assert probe.line == 5
