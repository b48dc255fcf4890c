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
import math
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
from crf_diloco.executors.base import (
    ReplicaResult,
    ServerlessExecutor,
    new_run_id,
    normalize_uri,
    run_replicas,
    validate_timeout,
)
from crf_diloco.executors.script import script_command
from crf_diloco.executors.torch_env import TORCH_ENV_VARS, with_torch_env
from crf_diloco.executors.wheels import index_has, index_url, with_wheels, workspace_wheel
from crf_diloco.layout import validate_name

_SUMMARY_TAIL_LINES = 5
EXECUTORS = ("local", "ray", "hf", "modal")
_CLOUD = ("hf", "modal")
_EXECUTOR_OPTIONS: dict[str, tuple[str, ...]] = {
    "ray_address": ("ray",),
    "ray_num_cpus": ("ray",),
    "ray_num_gpus": ("ray",),
    "image": _CLOUD,
    "pip": _CLOUD,
    "no_pip": _CLOUD,
    "crf_source": _CLOUD,
    "secret": _CLOUD,
    "cancel_on_failure": _CLOUD,
    "hf_flavor": ("hf",),
    "hf_namespace": ("hf",),
    "modal_gpu": ("modal",),
    "modal_cpu": ("modal",),
    "modal_memory": ("modal",),
    "modal_secret": ("modal",),
    "modal_app": ("modal",),
}
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = validate_timeout(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}") from None
    assert value is not None
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
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
    launch.add_argument("--replicas", type=_positive_int, required=True, metavar="N", help="number of replicas")
    launch.add_argument("--uri", required=True, help="object-store URI or local folder shared by the replicas")
    launch.add_argument("--executor", choices=EXECUTORS, default="local", help="where replicas run")
    launch.add_argument("--run-id", type=_run_id, default=None, help="run id (default: a fresh one)")
    launch.add_argument("--timeout", type=_seconds, default=None, metavar="S", help="stop replicas after S seconds")
    launch.add_argument(
        "--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE", help="extra replica env var"
    )
    ray = launch.add_argument_group("--executor ray")
    ray.add_argument("--ray-address", default=None, help="Ray cluster address (default: a local one)")
    ray.add_argument("--ray-num-cpus", type=_non_negative, default=None, metavar="C", help="CPUs per replica (1)")
    ray.add_argument("--ray-num-gpus", type=_non_negative, default=None, metavar="G", help="GPUs per replica (0)")
    cloud = launch.add_argument_group("--executor hf or modal (the script is shipped inside the command)")
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
    hf = launch.add_argument_group("--executor hf (Hugging Face Jobs; HF_TOKEN or `hf auth login`)")
    hf.add_argument("--hf-flavor", default=None, metavar="FLAVOR", help="hardware per replica (cpu-basic)")
    hf.add_argument("--hf-namespace", default=None, metavar="NS", help="user or org that runs the jobs")
    modal = launch.add_argument_group("--executor modal (Modal; `modal token new` once)")
    modal.add_argument("--modal-gpu", default=None, metavar="GPU", help="GPU per replica, e.g. H100 or A100-80GB:2")
    modal.add_argument("--modal-cpu", type=_positive_float, default=None, metavar="C", help="CPU cores per replica")
    modal.add_argument("--modal-memory", type=_positive_int, default=None, metavar="MIB", help="memory per replica")
    modal.add_argument(
        "--modal-secret", action="append", default=[], metavar="NAME", help="a secret stored in Modal (repeatable)"
    )
    modal.add_argument("--modal-app", default=None, metavar="NAME", help="Modal app name (crf-diloco)")
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


def _check_executor_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse options that belong to another executor (``--ray-*`` with ``hf``, ``--modal-gpu`` with ``ray``...)."""
    for dest, executors in _EXECUTOR_OPTIONS.items():
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
    cloud = args.executor in _CLOUD
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
    if args.executor == "hf" and requirements:  # Modal installs them into the image instead
        command = ["uv", "run", "--no-project", *[a for r in requirements for a in ("--with", r)], "--", *command]
        if wheels:
            command = with_wheels(wheels, command)
    return command


def _shipped_wheels(args: argparse.Namespace) -> list[Path]:
    """This checkout's crf-diloco wheel when cloud replicas cannot install this version from the index."""
    if args.executor not in _CLOUD or args.no_pip or args.pip or args.crf_source == "index":
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
        if args.executor == "local" and shutil.which(args.script) is None:
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
    cancel = {} if args.cancel_on_failure is None else {"cancel_on_failure": args.cancel_on_failure}
    if args.executor == "hf":
        from crf_diloco.executors.hf_jobs import HFJobsExecutor

        hf_options: dict[str, Any] = {"image": args.image} if args.image else {}
        return HFJobsExecutor(
            args.hf_flavor or "cpu-basic",
            job_timeout_s=args.timeout,
            namespace=args.hf_namespace,
            secret_env=args.secret,
            **hf_options,
            **cancel,
        )
    if args.executor == "modal":
        from crf_diloco.executors.modal import MAX_TIMEOUT_S, ModalExecutor

        modal_options = {k: v for k, v in (("cpu", args.modal_cpu), ("memory", args.modal_memory)) if v is not None}
        return ModalExecutor(
            args.modal_app or "crf-diloco",
            gpu=args.modal_gpu,
            image=args.image,
            pip=_requirements(args, uri),
            wheels=[str(w) for w in wheels],
            timeout_s=min(args.timeout, MAX_TIMEOUT_S) if args.timeout else MAX_TIMEOUT_S,
            secret_env=args.secret,
            modal_secrets=args.modal_secret,
            **modal_options,
            **cancel,
        )
    if args.executor == "ray":
        from crf_diloco.executors.ray import RayExecutor

        resources = {"num_cpus": args.ray_num_cpus, "num_gpus": args.ray_num_gpus}
        return RayExecutor(address=args.ray_address, **{k: v for k, v in resources.items() if v is not None})
    from crf_diloco.executors.local import LocalProcessExecutor

    return LocalProcessExecutor()


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
    if args.executor in ("hf", "modal") and "://" not in args.uri:
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
