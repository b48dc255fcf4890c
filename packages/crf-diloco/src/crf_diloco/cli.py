"""``crf-diloco launch``: start N replicas of a training script that synchronise through an object store.

    crf-diloco launch --replicas N --uri URI [--executor local|ray] [--run-id ID] [--timeout S]
                      [--env KEY=VALUE ...] [--ray-address ADDR] [--ray-num-cpus C] [--ray-num-gpus G]
                      script.py [args...]

Each replica runs ``python script.py args...`` with ``CRF_DILOCO_RANK``, ``CRF_DILOCO_WORLD_SIZE``,
``CRF_DILOCO_URI``, ``CRF_DILOCO_RUN_ID`` and ``CRF_DILOCO_SECRET`` set (the script calls
`ObjectStoreAllReduce.from_env`). The secret authenticates every store object; it is made fresh per launch (never
printed) unless ``--env CRF_DILOCO_SECRET=...`` or the launcher's environment gives one (to relaunch into a run). Replica
output is streamed with a ``[rank r]`` prefix (stdout to stdout, stderr to stderr); a summary follows on stderr.
Exit status: 0 when every replica exited 0, 1 when any failed or timed out, 2 on bad arguments, 130/143 when
interrupted by SIGINT/SIGTERM (the replicas are stopped first).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
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
from crf_diloco.layout import validate_name

_SUMMARY_TAIL_LINES = 5


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
        description="Start N replicas of SCRIPT; each gets CRF_DILOCO_RANK/WORLD_SIZE/URI/RUN_ID/SECRET in its environment.",
    )
    launch.add_argument("--replicas", type=_positive_int, required=True, metavar="N", help="number of replicas")
    launch.add_argument("--uri", required=True, help="object-store URI or local folder shared by the replicas")
    launch.add_argument("--executor", choices=("local", "ray"), default="local", help="where replicas run")
    launch.add_argument("--run-id", type=_run_id, default=None, help="run id (default: a fresh one)")
    launch.add_argument("--timeout", type=_seconds, default=None, metavar="S", help="stop replicas after S seconds")
    launch.add_argument(
        "--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE", help="extra replica env var"
    )
    launch.add_argument("--ray-address", default=None, help="Ray cluster address (--executor ray; default: local)")
    launch.add_argument(
        "--ray-num-cpus", type=_non_negative, default=None, metavar="C", help="CPUs per replica (--executor ray; 1)"
    )
    launch.add_argument(
        "--ray-num-gpus", type=_non_negative, default=None, metavar="G", help="GPUs per replica (--executor ray; 0)"
    )
    launch.add_argument("script", help="the training script, run with this Python interpreter")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return parser


def _make_executor(args: argparse.Namespace) -> ServerlessExecutor[Any]:
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
    """Run ``crf-diloco launch``; return the process exit status."""
    ray_only = [flag for flag in ("ray_address", "ray_num_cpus", "ray_num_gpus") if getattr(args, flag) is not None]
    if ray_only and args.executor != "ray":
        parser.error(f"--{ray_only[0].replace('_', '-')} needs --executor ray")
    if not os.path.isfile(args.script):
        parser.error(f"script {args.script!r} is not a file")
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    try:
        uri = normalize_uri(args.uri)
    except ValueError as exc:
        parser.error(str(exc))
    run_id = args.run_id or new_run_id()
    command = [sys.executable, args.script, *script_args]
    try:
        executor = _make_executor(args)
    except ImportError as exc:
        parser.error(str(exc))
    sys.stderr.write(
        f"crf-diloco: launching {args.replicas} replicas of {args.script} "
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
        sys.stderr.write(f"crf-diloco: interrupted by {signal.Signals(signum).name}; replicas stopped\n")
        return 128 + int(signum)
    except (ValueError, TypeError) as exc:  # bad --uri / --env, rejected before any replica starts
        parser.error(str(exc))
    except OSError as exc:  # a replica could not be started; the others were stopped
        sys.stderr.write(f"crf-diloco: {exc}\n")
        return 1
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
        close = getattr(executor, "close", None)
        if close is not None:
            close()
    _print_summary(results, run_id, sys.stderr)
    return 0 if all(r.ok for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``crf-diloco`` command and ``python -m crf_diloco``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "launch":
        return launch(args, parser)
    parser.error(f"unknown command {args.command!r}")  # unreachable: argparse restricts the choices
    return 2
