"""``crf-diloco launch``: start N replicas of a training command that synchronise through an object store.

    crf-diloco launch --replicas N --uri URI [--executor local|ray|hf|modal] [--run-id ID] [--timeout S]
                      [--env KEY=VALUE ...] [executor options] (script.py | -m MODULE | --no-python PROGRAM) [args...]

Each replica runs ``python script.py args...``, ``python -m MODULE args...`` or (``--no-python``) ``PROGRAM
args...`` as is, e.g. ``--no-python torchrun --nproc-per-node 2 train.py`` or ``--no-python accelerate launch
train.py`` for a replica of several processes. Every replica gets ``CRF_DILOCO_RANK``, ``CRF_DILOCO_WORLD_SIZE``,
``CRF_DILOCO_URI``, ``CRF_DILOCO_RUN_ID`` and ``CRF_DILOCO_SECRET`` (the script calls
`ObjectStoreAllReduce.from_env`), and torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` for the ``torch.distributed`` world inside the replica (one process, unless a
wrapped torchrun sets its own; see `crf_diloco.executors.torch_env`). The secret authenticates every store
object; it is made fresh per launch (never printed) unless ``--env CRF_DILOCO_SECRET=...`` or the launcher's
environment gives one (to relaunch into a run). With ``--executor hf`` or ``modal`` a script travels inside the
command (`script_command`; a module or program must be in the image or the installed packages), the replicas
install ``--pip`` packages (default: this crf-diloco with the store's extra; when the package index does not have
this version, ``--crf-source auto`` ships this checkout's wheel, built with ``uv build``, with the job: see
`crf_diloco.executors.wheels`) and the secret goes through the backend's secrets; ``--secret NAME`` sends a variable of this shell as a secret too. Replica output is streamed
with a ``[rank r]`` prefix (stdout to stdout, stderr to stderr); a summary follows on stderr. Errors start with
``crf-diloco launch:``. Exit status: 0 when every replica exited 0, 1 when any failed or timed out, 2 on bad
arguments, 130/143 when interrupted by SIGINT/SIGTERM (the replicas are stopped first).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from crf_diloco._version import __version__
from crf_diloco.executors import registry
from crf_diloco.executors.base import (
    ReplicaResult,
    ServerlessExecutor,
    new_run_id,
    normalize_uri,
    run_replicas,
    validate_timeout,
)
from crf_diloco.executors.registry import BuildContext, option_dests, positive_int
from crf_diloco.executors.script import script_command
from crf_diloco.executors.torch_env import TORCH_ENV_VARS, with_torch_env
from crf_diloco.executors.wheels import index_has, index_url, with_wheels, workspace_wheel
from crf_diloco.layout import validate_name

_SUMMARY_TAIL_LINES = 5
EXECUTORS = tuple(entry.name for entry in registry.launchers())
"""The ``--executor`` choices: every `crf_diloco.executors.registry.Launcher` (the parser reads the registry)."""


def _remote() -> tuple[str, ...]:
    """The executors whose replicas run elsewhere (`Launcher.remote`)."""
    return tuple(entry.name for entry in registry.launchers() if entry.remote)


_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_STORE_EXTRAS = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure", "hf": "hf"}


class _Interrupted(Exception):
    """Raised in the main thread by the SIGTERM handler so the replicas get stopped on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


class _PrefixedPrinter:
    """Writes ``[rank r] line`` to stdout or stderr, one whole line at a time (called from reader threads)."""

    def __init__(self, stdout: TextIO, stderr: TextIO) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._lock = threading.Lock()

    def __call__(self, rank: int, stream: str, line: str) -> None:
        out = self._streams.get(stream, self._streams["stderr"])
        with self._lock:
            out.write(f"[rank {rank}] {line}\n")
            out.flush()


def _seconds(text: str) -> float:
    try:
        value = validate_timeout(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}") from None
    assert value is not None
    return value


def _run_id(text: str) -> str:
    try:
        return validate_name(text, "--run-id")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    """The ``crf-diloco`` argument parser (one subcommand, ``launch``)."""
    parser = argparse.ArgumentParser(prog="crf-diloco", description="Serverless DiLoCo launcher.")
    parser.add_argument("--version", action="version", version=f"crf-diloco {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    launch = commands.add_parser(
        "launch",
        help="start N replicas of a training script wired to one object store",
        description="Start N replicas of TARGET; each gets CRF_DILOCO_RANK/WORLD_SIZE/URI/RUN_ID/SECRET and torchrun's "
        "RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT for the torch.distributed world inside "
        "the replica (RANK=0, WORLD_SIZE=1 unless a wrapped torchrun sets its own; the replica's rank is "
        "CRF_DILOCO_RANK).",
    )
    launch.add_argument("--replicas", type=positive_int, required=True, metavar="N", help="number of replicas")
    launch.add_argument("--uri", required=True, help="object-store URI or local folder shared by the replicas")
    choices = [entry.name for entry in registry.launchers()]
    launch.add_argument("--executor", choices=choices, default="local", help="where replicas run")
    launch.add_argument("--run-id", type=_run_id, default=None, help="run id (default: a fresh one)")
    launch.add_argument("--timeout", type=_seconds, default=None, metavar="S", help="stop replicas after S seconds")
    launch.add_argument(
        "--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE", help="extra replica env var"
    )
    remote = _remote()
    for entry in registry.launchers():  # each executor's own options; the shared remote ones before the first remote
        if entry.remote and entry.name == remote[0]:
            title = f"--executor {' or '.join(remote)} (the script is shipped inside the command)"
            _add_remote_options(launch.add_argument_group(title))
        if option_dests(entry.add_options):
            entry.add_options(launch.add_argument_group(entry.title))
    what = launch.add_mutually_exclusive_group()
    what.add_argument("-m", dest="module", action="store_true", help="run TARGET as a module: python -m TARGET")
    what.add_argument(
        "--no-python",
        action="store_true",
        help="run TARGET as a program, not through Python (torchrun, accelerate, a shell script)",
    )
    launch.add_argument(
        "script",
        metavar="TARGET",
        help="the training script (run by this Python, or shipped to cloud replicas); a module with -m; "
        "a program with --no-python",
    )
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to TARGET")
    return parser


def _add_remote_options(cloud: argparse._ArgumentGroup) -> None:
    """The options every remote executor takes (``Launcher.remote``)."""
    cloud.add_argument("--image", default=None, help="container image (hf: Docker image; modal: registry image)")
    cloud.add_argument(
        "--pip",
        action="append",
        default=None,
        metavar="REQ",
        help="package the replicas install (repeatable; default: crf-diloco[<store extra>]==<this version>)",
    )
    cloud.add_argument("--no-pip", action="store_true", default=None, help="install nothing: the image has all")
    cloud.add_argument(
        "--crf-source",
        choices=("auto", "index", "workspace"),
        default=None,
        help="where the default crf-diloco requirement comes from: the package index, this checkout's wheel "
        "(uv build, shipped with the job), or auto: the wheel when the index lacks this version (default)",
    )
    cloud.add_argument(
        "--secret", action="append", default=[], metavar="NAME", help="send this shell's variable NAME as a secret"
    )
    cloud.add_argument(
        "--cancel-on-failure",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cancel the other replicas when one fails (default: yes)",
    )


def _executor_options() -> dict[str, tuple[str, ...]]:
    """Each executor-specific option's ``dest`` and the executors that take it."""
    owners: dict[str, tuple[str, ...]] = dict.fromkeys(option_dests(_add_remote_options), _remote())
    for entry in registry.launchers():
        owners.update(dict.fromkeys(option_dests(entry.add_options), (entry.name,)))
    return owners


def _check_executor_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse options that belong to another executor (``--ray-*`` with ``hf``, ``--modal-gpu`` with ``ray``...)."""
    for dest, executors in _executor_options().items():
        if getattr(args, dest) not in (None, []) and args.executor not in executors:  # every default is None or []
            parser.error(f"--{dest.replace('_', '-')} needs --executor {' or '.join(executors)}")
    if args.no_pip and args.pip:
        parser.error("--pip and --no-pip exclude each other")
    if args.crf_source and (args.no_pip or args.pip):
        parser.error("--crf-source applies to the default requirement only (not with --pip or --no-pip)")


def default_requirement(uri: str) -> str:
    """``crf-diloco[<extra>]==<this version>``, the extra chosen by the URI's scheme (``s3://`` → ``[s3]``)."""
    extra = _STORE_EXTRAS.get(uri.split("://", 1)[0].lower()) if "://" in uri else None
    return f"crf-diloco[{extra}]=={__version__}" if extra else f"crf-diloco=={__version__}"


def _replica_command(
    args: argparse.Namespace, script_args: list[str], uri: str, wheels: Sequence[Path] = ()
) -> list[str]:
    """What each replica runs: the target (script, module or program), with torchrun's variables set first.

    Locally this interpreter runs the script; on a cloud replica the script travels inside the command and the
    replica's ``python`` runs it (Hugging Face Jobs install the requirements with ``uv run --with``, finding
    ``wheels``, packed into the command, on the find-links).
    """
    entry = registry.launcher(args.executor)
    cloud = entry.remote
    python = "python" if cloud else sys.executable
    if args.no_python:
        target = [args.script, *script_args]
    elif args.module:
        target = [python, "-m", args.script, *script_args]
    elif cloud:
        target = script_command(args.script, script_args)
    else:
        target = [python, args.script, *script_args]
    command = with_torch_env(target, python=python)
    requirements = _requirements(args, uri) if cloud else []
    if entry.requirements_in_command and requirements:  # otherwise the executor installs them (Modal: the image)
        command = ["uv", "run", "--no-project", *[a for r in requirements for a in ("--with", r)], "--", *command]
        if wheels:
            command = with_wheels(wheels, command)
    return command


def _shipped_wheels(args: argparse.Namespace) -> list[Path]:
    """This checkout's crf-diloco wheel when cloud replicas cannot install this version from the index."""
    if not registry.launcher(args.executor).remote or args.no_pip or args.pip or args.crf_source == "index":
        return []
    if args.crf_source != "workspace":
        found = index_has("crf-diloco", __version__)
        if found:
            return []
        sys.stderr.write(
            f"crf-diloco launch: crf-diloco {__version__} is {'not' if found is False else 'not known to be'} on the "
            f"package index {index_url()}; the replicas get this checkout's wheel (uv build)\n"
        )
    return [workspace_wheel()]


def _check_target(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse a target that cannot run: a missing script, a bad module name, a program not on PATH (local executor:
    elsewhere the program need only exist where the replicas run)."""
    if args.module:
        if not _MODULE.match(args.script):
            parser.error(f"-m {args.script!r} is not a module name (dotted Python identifiers, e.g. pkg.train)")
    elif args.no_python:
        if registry.launcher(args.executor).same_machine and shutil.which(args.script) is None:
            parser.error(f"--no-python: program {args.script!r} is not found on PATH")
    elif not os.path.isfile(args.script):
        parser.error(f"script {args.script!r} is not a file (run a module with -m, a program with --no-python)")
    owned = sorted({key for key, _ in args.env} & set(TORCH_ENV_VARS))
    if owned:
        parser.error(
            f"--env must not set {owned}: each replica gets torchrun's variables for its own torch.distributed "
            "world (the replica's rank is CRF_DILOCO_RANK)"
        )


def _requirements(args: argparse.Namespace, uri: str) -> list[str]:
    return [] if args.no_pip else list(args.pip or [default_requirement(uri)])


def _make_executor(args: argparse.Namespace, uri: str, wheels: Sequence[Path] = ()) -> ServerlessExecutor[Any]:
    """The executor ``--executor`` names, configured from its options (its SDK is imported here)."""
    entry = registry.launcher(args.executor)
    requirements = _requirements(args, uri) if entry.remote else []
    return entry.build(args, BuildContext(uri, requirements, list(wheels)))


def _print_summary(results: Sequence[ReplicaResult], run_id: str, out: TextIO) -> None:
    succeeded = sum(r.ok for r in results)
    out.write(f"crf-diloco: run {run_id}: {succeeded} of {len(results)} replicas succeeded\n")
    for result in results:
        out.write(f"  {result.describe()}\n")
        if not result.ok:
            for line in result.stderr_tail.strip().splitlines()[-_SUMMARY_TAIL_LINES:]:
                out.write(f"    | {line}\n")
    out.flush()


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted(signum)


def launch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``crf-diloco launch``; return the process exit status (``parser``: the launch subcommand's)."""
    _check_executor_options(args, parser)
    _check_target(args, parser)
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    try:
        uri = normalize_uri(args.uri)
    except ValueError as exc:
        parser.error(str(exc))
    run_id = args.run_id or new_run_id()
    try:
        wheels = _shipped_wheels(args)
        command = _replica_command(args, script_args, uri, wheels)
        executor = _make_executor(args, uri, wheels)
    except (ImportError, ValueError, TypeError, RuntimeError) as exc:  # a missing SDK, a refused option, no wheel
        parser.error(str(exc))
    if registry.launcher(args.executor).remote and "://" not in args.uri:
        sys.stderr.write(
            f"crf-diloco launch: warning: --uri {args.uri} is a path on each replica's own machine; the replicas share it "
            "only if the same folder is mounted on every one of them (use s3://, gs://, az:// or hf://)\n"
        )
    sys.stderr.write(
        f"crf-diloco launch: {args.replicas} replicas of {args.script} "
        f"(executor {args.executor}, uri {uri}, run id {run_id})\n"
    )
    sys.stderr.flush()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupted) if in_main_thread else None
    try:
        results = run_replicas(
            executor,
            command,
            world_size=args.replicas,
            uri=uri,
            run_id=run_id,
            env=dict(args.env),
            on_output=_PrefixedPrinter(sys.stdout, sys.stderr),
            timeout=args.timeout,
        )
    except (KeyboardInterrupt, _Interrupted) as exc:
        signum = exc.signum if isinstance(exc, _Interrupted) else signal.SIGINT
        sys.stderr.write(f"crf-diloco launch: interrupted by {signal.Signals(signum).name}; replicas stopped\n")
        return 128 + int(signum)
    except (ValueError, TypeError) as exc:  # bad --uri / --env, rejected before any replica starts
        parser.error(str(exc))
    except (OSError, RuntimeError) as exc:  # a replica could not be started; the others were stopped
        sys.stderr.write(f"crf-diloco launch: {exc}\n")
        return 1
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
        close = getattr(executor, "close", None)
        if close is not None:
            close()
    _print_summary(results, run_id, sys.stderr)
    return 0 if all(r.ok for r in results) else 1


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``, so its errors read ``crf-diloco launch: error: ...``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise LookupError(name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``crf-diloco`` command and ``python -m crf_diloco``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "launch":
        return launch(args, _subcommand(parser, "launch"))
    parser.error(f"unknown command {args.command!r}")  # unreachable: argparse restricts the choices
    return 2
