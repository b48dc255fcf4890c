"""`ModalExecutor`: each replica is one call of a Modal function, spawned N times in an ephemeral Modal app.

``launch_replicas`` defines an app with one function (`_modal_worker.run_replica`: GPU, CPU, memory, image and
timeout as configured, ``retries=0`` so a crash is a failed replica rather than a silent re-run), runs the app and
calls ``function.spawn(rank, command, env, ...)`` once per rank. Modal reschedules an input whose container was preempted
even with ``retries=0``; each call records its first attempt in an ephemeral ``modal.Dict``, so a restarted one
does not run the command again but ends with an error saying the replica was restarted (reported per replica). Inside its container each call starts the command
as a child process with the ``CRF_DILOCO_*`` variables and ``env``, and returns how it ended. Secrets (the per-run
key ``CRF_DILOCO_SECRET``, anything named like a credential, ``secrets``/``secret_env``) become one
``modal.Secret.from_dict`` attached to the function, next to the named Modal secrets in ``modal_secrets``: they
reach the container's environment through Modal's secret store, never as call arguments. Output lines travel back
through an ephemeral ``modal.Queue`` to ``on_output``; ``collect`` polls each ``FunctionCall`` and maps Modal's
errors (function timeout, remote failure, expired result; a call the launcher cancelled ends, in the client, with
the ``RemoteError`` of its terminated result) to failed `ReplicaResult` s, cancels the
other calls when one fails (unless ``cancel_on_failure=False``) and the late ones at the deadline, then stops the
app. Text that comes back has secret values masked, in the container and again here.

The image is Modal's ``debian_slim`` with this interpreter's Python (or ``image``), plus ``pip`` packages, plus
this launcher's own ``crf_diloco`` source, so the container runs the same executor code. ``modal`` is imported when
the executor is constructed: ``pip install 'crf-diloco[modal]'``, then ``modal token new`` once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from crf_diloco._checks import is_int
from crf_diloco.executors._modal_worker import run_replica
from crf_diloco.executors._remote import (
    PreparedLaunch,
    RemoteExecutor,
    ReplicaSecrets,
    ceil_seconds,
    validate_positive,
)
from crf_diloco.executors.base import OutputCallback, ReplicaResult
from crf_diloco.executors.registry import BuildContext, Launcher, cancel_option, number, positive_int
from crf_diloco.layout import validate_name

logger = logging.getLogger(__name__)

MAX_TIMEOUT_S = 24 * 3600
"""The longest a Modal function call may run."""
WHEEL_DIR = "/crf-diloco/wheels"
"""Where ``wheels`` are copied in the image (``pip``'s find-links)."""
_MODAL_HINT = "ModalExecutor needs modal>=1.0, which is not installed: pip install 'crf-diloco[modal]'"
_GPU = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*(:[1-9][0-9]*)?$")
_MAX_LINE_CHARS = 4000
_RESULT_TYPES: dict[str, tuple[type, ...]] = {
    "rank": (int,),
    "returncode": (int, type(None)),
    "duration_s": (int, float),
    "stdout_tail": (str,),
    "stderr_tail": (str,),
    "timed_out": (bool,),
    "error": (str, type(None)),
}


def _import_modal() -> Any:
    try:
        import modal
    except ImportError as exc:
        raise ImportError(_MODAL_HINT) from exc
    if not hasattr(getattr(modal, "Image", None), "add_local_python_source"):
        raise ImportError(
            f"ModalExecutor needs modal>=1.0, found {getattr(modal, '__version__', '?')}: pip install -U 'crf-diloco[modal]'"
        )
    return modal


class _ModalSession:
    """Where the executor meets Modal's service: run the app, make a log queue, spawn a call (replaced in tests)."""

    def __init__(self, modal: Any) -> None:
        self.modal = modal

    def open(self, app: Any, *, show_output: bool, log_queue: bool) -> tuple[contextlib.ExitStack, Any, Any]:
        """Enter ``app.run()``, a ``Dict.ephemeral()`` of first attempts (and a ``Queue.ephemeral()`` when asked)."""
        stack = contextlib.ExitStack()
        try:
            if show_output:
                stack.enter_context(self.modal.enable_output())
            stack.enter_context(app.run())
            attempts = stack.enter_context(self.modal.Dict.ephemeral())
            q = stack.enter_context(self.modal.Queue.ephemeral()) if log_queue else None
        except BaseException:
            stack.close()
            raise
        return stack, q, attempts

    def spawn(self, function: Any, *args: Any) -> Any:
        return function.spawn(*args)


class _LogDrain:
    """Reads ``(rank, [(stream, line), ...])`` batches from the launch's queue and calls ``on_output`` per line."""

    def __init__(self, log_queue: Any, on_output: OutputCallback, world_size: int, secrets: ReplicaSecrets) -> None:
        self._queue = log_queue
        self._on_output = on_output
        self._world_size = world_size
        self._secrets = secrets
        self._stop = threading.Event()
        self._callback_failed = False
        self._thread = threading.Thread(target=self._run, name="modal-log-drain", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while True:
            stopping = self._stop.is_set()
            try:
                items = self._queue.get_many(64, block=not stopping, timeout=0.5)
            except queue.Empty:
                items = []
            except Exception as exc:  # the queue is gone or unreachable: keep trying until stopped
                failures += 1
                if failures == 1:
                    logger.warning("reading replica output from Modal failed: %s", self._secrets.redact(repr(exc)))
                if stopping:
                    return
                time.sleep(0.5)
                continue
            for item in items:
                self._deliver(item)
            if stopping and not items:
                return

    def _deliver(self, item: Any) -> None:
        try:
            rank, batch = item
            if not isinstance(rank, int) or not 0 <= rank < self._world_size:
                raise ValueError(f"rank {rank!r}")
            lines = [(str(stream), str(line)) for stream, line in batch]
        except (TypeError, ValueError) as exc:
            logger.warning("dropped a malformed output batch from Modal (%s)", exc)
            return
        for stream, line in lines:
            if self._callback_failed:
                return
            try:
                self._on_output(rank, stream if stream in ("stdout", "stderr") else "stdout",
                                self._secrets.redact(line)[:_MAX_LINE_CHARS])  # fmt: skip
            except Exception:
                self._callback_failed = True
                logger.exception("on_output callback failed; no more lines are relayed")

    def close(self) -> None:
        """Deliver what is still queued, then stop."""
        self._stop.set()
        self._thread.join(10.0)


@dataclass
class _ModalLaunch:
    """What the calls of one ``launch_replicas`` share: the running app, the log drain, the secrets."""

    modal: Any
    stack: contextlib.ExitStack
    drain: _LogDrain | None
    secrets: ReplicaSecrets
    timeout_s: int
    function: Any = None  # the app's replica function (spawned once per rank)
    log_queue: Any = None
    attempts: Any = None
    closed: bool = False

    def close(self) -> None:
        """Stop relaying output and stop the app (Modal stops whatever still runs in it). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.drain is not None:
            self.drain.close()
        try:
            self.stack.close()
        except Exception as exc:
            logger.warning("stopping the Modal app failed: %s", self.secrets.redact(f"{type(exc).__name__}: {exc}"))


class _ModalCall:
    """One spawned call: polls its ``FunctionCall`` and maps the outcome to a `ReplicaResult` (a `RemoteReplica`)."""

    def __init__(self, launch: _ModalLaunch, rank: int, call: Any) -> None:
        self.launch = launch
        self.rank = rank
        self.call = call
        self.started_at = time.monotonic()
        self.result: ReplicaResult | None = None
        self.cancel_requested = False

    def poll(self) -> ReplicaResult | None:
        """The result once the call has ended, else ``None``; raises when Modal cannot be reached."""
        if self.result is None:
            self.result = self._outcome()
        return self.result

    def _outcome(self) -> ReplicaResult | None:
        errors = self.launch.modal.exception
        try:
            value = self.call.get(timeout=0)
        except errors.FunctionTimeoutError as exc:
            return self._failed(f"Modal stopped it at the function timeout of {self.launch.timeout_s} s ({exc})", True)
        except errors.OutputExpiredError:
            return self._failed("Modal no longer holds the result of this call (it expired)")
        except (TimeoutError, errors.TimeoutError):
            return None  # still running
        except Exception as exc:
            if _unreachable(exc, errors):
                raise
            if self.cancel_requested and isinstance(exc, errors.RemoteError):
                return self._failed("the call was cancelled on Modal")  # its result is TERMINATED: a RemoteError
            return self._failed(f"the replica's Modal call failed ({type(exc).__name__}: {exc})")
        return self._from_value(value)

    def _failed(self, error: str, timed_out: bool = False) -> ReplicaResult:
        return ReplicaResult(
            rank=self.rank,
            returncode=None,
            duration_s=time.monotonic() - self.started_at,
            timed_out=timed_out,
            error=self.launch.secrets.redact(error),
        )

    def _from_value(self, value: Any) -> ReplicaResult:
        """The container's report, checked field by field (it crossed a network) and with secrets masked."""
        if not isinstance(value, dict) or set(value) != set(_RESULT_TYPES):
            return self._failed(f"the replica's Modal call returned a malformed result: {str(value)[:200]!r}")
        bad = [key for key, types in _RESULT_TYPES.items() if not _has_type(value[key], types)]
        if bad or value["rank"] != self.rank:
            return self._failed(f"the replica's Modal call returned a malformed result (fields {bad or ['rank']})")
        redact = self.launch.secrets.redact
        return ReplicaResult(
            rank=self.rank,
            returncode=value["returncode"],
            duration_s=float(value["duration_s"]),
            stdout_tail=redact(value["stdout_tail"]),
            stderr_tail=redact(value["stderr_tail"]),
            timed_out=value["timed_out"],
            error=None if value["error"] is None else redact(value["error"]),
        )

    def cancel(self) -> None:
        """``FunctionCall.cancel(terminate_containers=True)`` (once)."""
        if self.result is None and not self.cancel_requested:
            self.cancel_requested = True
            self.call.cancel(terminate_containers=True)

    @property
    def secrets(self) -> ReplicaSecrets:
        return self.launch.secrets

    def close(self) -> None:
        """Stop the launch's app (shared by its calls; the first close stops it)."""
        self.launch.close()


def _has_type(value: object, types: tuple[type, ...]) -> bool:
    """``isinstance`` where a bool is not an int (``True`` is no exit code)."""
    return isinstance(value, types) and (isinstance(value, bool) == (bool in types) or value is None)


def _unreachable(exc: BaseException, errors: Any) -> bool:
    """True for errors of the connection to Modal (worth retrying), not of the call itself."""
    transient = tuple(
        t for t in (getattr(errors, n, None) for n in ("ConnectionError", "ServiceError", "InternalError")) if t
    )
    return isinstance(exc, (OSError, *transient)) or type(exc).__module__.startswith("grpclib")


@dataclass(frozen=True)
class ModalReplicaApp:
    """A Modal app holding the replica function, and the options the function was defined with."""

    app: Any
    function: Any
    options: Mapping[str, Any]


@dataclass(frozen=True)
class ModalReplicaHandle:
    """One replica running as a Modal function call: rank, run id and the call's id (``fc-...``)."""

    rank: int
    run_id: str
    call_id: str
    _replica: _ModalCall = field(repr=False, compare=False)


class ModalExecutor(RemoteExecutor[_ModalLaunch, ModalReplicaHandle]):
    """Runs each replica as one call of a Modal function (see the module docstring for the lifecycle).

    Args:
        app_name: name of the ephemeral Modal app each launch runs.
        gpu: GPU per replica (``"H100"``, ``"A100-80GB"``, ``"H100:8"``, or a list of acceptable types).
        cpu: CPU cores per replica (fractional allowed); memory: MiB per replica.
        image: a ``modal.Image``, or a registry image name (it must have Python); default Modal's ``debian_slim``
            with ``python_version`` (default: this interpreter's).
        pip: packages installed into the image (the replica script's dependencies, ``crf-diloco[s3]``, ...).
        wheels: local wheel files copied into the image and used as ``pip``'s find-links (this checkout's
            crf-diloco before it is on an index: `crf_diloco.executors.wheels.workspace_wheel`).
        timeout_s: Modal's limit for each call, at most 24 h (Modal's own default of 300 s is too short to train).
        secrets: more secret variables for every replica (name → value); secret_env: names of variables of this
            process's environment to send as secrets (a missing one is an error at launch).
        modal_secrets: names of secrets already stored in Modal (``modal secret create aws ...``).
        region: Modal region(s) to run in.
        cancel_on_failure: cancel the other calls when one fails.
        poll_interval_s, cancel_grace_s, lost_contact_s: how ``collect`` waits (see `WaitPolicy`).
        terminate_grace_s: seconds between SIGTERM and SIGKILL when a container stops its command.
        tail_lines: how many trailing lines of stdout and stderr each `ReplicaResult` keeps.
        show_output: show Modal's own progress and container logs on this terminal (``modal.enable_output()``).
    """

    def __init__(
        self,
        app_name: str = "crf-diloco",
        *,
        gpu: str | Sequence[str] | None = None,
        cpu: float | None = None,
        memory: int | None = None,
        image: Any = None,
        python_version: str | None = None,
        pip: Sequence[str] = (),
        wheels: Sequence[str] = (),
        timeout_s: float = MAX_TIMEOUT_S,
        secrets: Mapping[str, str] | None = None,
        secret_env: Sequence[str] = (),
        modal_secrets: Sequence[str] = (),
        region: str | Sequence[str] | None = None,
        cancel_on_failure: bool = True,
        poll_interval_s: float = 1.0,
        cancel_grace_s: float = 60.0,
        lost_contact_s: float = 60.0,
        terminate_grace_s: float = 5.0,
        tail_lines: int = 40,
        show_output: bool = False,
    ) -> None:
        self._modal = modal = _import_modal()
        validate_name(app_name, "app_name")
        gpus = [gpu] if isinstance(gpu, str) else list(gpu or [])
        if gpu is not None and (not gpus or not all(isinstance(g, str) and _GPU.match(g) for g in gpus)):
            raise ValueError(f"gpu must be a GPU type such as 'H100', 'A100-80GB' or 'H100:8' (or a list), got {gpu!r}")
        if cpu is not None:
            validate_positive(cpu, "cpu")
        if memory is not None and (not is_int(memory) or memory <= 0):
            raise ValueError(f"memory must be a whole number of MiB > 0, got {memory!r}")
        if image is not None and not isinstance(image, (str, modal.Image)):
            raise TypeError(f"image must be a modal.Image or a registry image name, got {type(image).__name__}")
        if isinstance(pip, str) or not all(isinstance(p, str) and p for p in pip):
            raise ValueError(f"pip must be a list of requirement strings, got {pip!r}")
        if isinstance(wheels, str) or not all(
            isinstance(w, str) and w.endswith(".whl") and os.path.isfile(w) for w in wheels
        ):
            raise ValueError(f"wheels must be a list of paths of existing .whl files, got {wheels!r}")
        timeout = validate_positive(timeout_s, "timeout_s")
        if timeout > MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s must be at most {MAX_TIMEOUT_S} (Modal's 24 h limit), got {timeout_s!r}")
        super().__init__(
            secrets=secrets,
            secret_env=secret_env,
            cancel_on_failure=cancel_on_failure,
            poll_interval_s=poll_interval_s,
            cancel_grace_s=cancel_grace_s,
            lost_contact_s=lost_contact_s,
            tail_lines=tail_lines,
        )
        if isinstance(modal_secrets, str):
            raise TypeError(f"modal_secrets must be a list of secret names, not the string {modal_secrets!r}")
        for name in modal_secrets:
            validate_name(name, "modal_secrets entry")
        validate_positive(terminate_grace_s, "terminate_grace_s")
        self.app_name = app_name
        self.gpu: str | list[str] | None = gpus[0] if isinstance(gpu, str) else (gpus or None)
        self.cpu = cpu
        self.memory = memory
        self.image = image
        self.python_version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
        self.pip = tuple(pip)
        self.wheels = tuple(wheels)
        self.timeout_s = ceil_seconds(timeout) or 1
        self.modal_secrets = tuple(modal_secrets)
        self.region = region
        self.terminate_grace_s = float(terminate_grace_s)
        self.show_output = show_output
        self._session = _ModalSession(modal)
        self.build_app(ReplicaSecrets())  # Modal checks the function's options here, before anything runs

    def __repr__(self) -> str:
        return (
            f"ModalExecutor(app_name={self.app_name!r}, gpu={self.gpu!r}, timeout_s={self.timeout_s}, "
            f"modal_secrets={list(self.modal_secrets)}, secret_names={self.secret_names})"
        )

    def build_image(self) -> Any:
        """The replicas' image: the base, ``wheels``, ``pip`` packages, and this launcher's ``crf_diloco`` source."""
        modal = self._modal
        if isinstance(self.image, str):
            image = modal.Image.from_registry(self.image)
        elif self.image is None:
            image = modal.Image.debian_slim(python_version=self.python_version)
        else:
            image = self.image
        for wheel in self.wheels:
            image = image.add_local_file(wheel, f"{WHEEL_DIR}/{os.path.basename(wheel)}", copy=True)
        if self.pip:
            image = image.pip_install(*self.pip, find_links=WHEEL_DIR if self.wheels else None)
        return image.add_local_python_source("crf_diloco")

    def build_app(self, secrets: ReplicaSecrets) -> ModalReplicaApp:
        """A fresh ``modal.App`` and its replica function, with ``secrets`` attached as a Modal secret."""
        modal = self._modal
        app = modal.App(self.app_name)
        attached = [modal.Secret.from_name(name) for name in self.modal_secrets]
        if secrets.values:
            attached.append(modal.Secret.from_dict(dict(secrets.values)))
        options: dict[str, Any] = {
            "image": self.build_image(),
            "secrets": attached,
            "timeout": self.timeout_s,
            "retries": 0,
            "serialized": True,
        }
        for key in ("gpu", "cpu", "memory", "region"):
            if getattr(self, key) is not None:
                options[key] = getattr(self, key)
        return ModalReplicaApp(app, app.function(**options)(run_replica), options)

    def begin_launch(self, plan: PreparedLaunch, on_output: OutputCallback | None) -> _ModalLaunch:
        """Build the app and run it (its output drained to ``on_output``)."""
        secrets = plan.secrets
        definition = self.build_app(secrets)
        try:
            stack, log_queue, attempts = self._session.open(
                definition.app, show_output=self.show_output, log_queue=on_output is not None
            )
        except Exception as exc:
            raise RuntimeError(
                f"cannot start the Modal app {self.app_name!r} ({type(exc).__name__}: {secrets.redact(str(exc))}); "
                "is Modal set up (`modal token new`)?"
            ) from None
        drain = _LogDrain(log_queue, on_output, plan.world_size, secrets) if on_output is not None else None
        return _ModalLaunch(
            modal=self._modal,
            stack=stack,
            drain=drain,
            secrets=secrets,
            timeout_s=self.timeout_s,
            function=definition.function,
            log_queue=log_queue,
            attempts=attempts,
        )

    def start_replica(self, launch: _ModalLaunch, plan: PreparedLaunch, rank: int) -> ModalReplicaHandle:
        """Spawn rank ``rank``'s call in the running app."""
        call = self._session.spawn(
            launch.function, rank, plan.argv, plan.envs[rank], plan.secrets.names, launch.log_queue, self.tail_lines,
            self.terminate_grace_s, launch.attempts,
        )  # fmt: skip
        call_id = str(getattr(call, "object_id", "") or f"rank-{rank}")
        return ModalReplicaHandle(rank, plan.run_id, call_id, _ModalCall(launch, rank, call))

    def abort_launch(self, launch: _ModalLaunch) -> None:
        launch.close()

    def launch_error(self, exc: Exception, launch: _ModalLaunch, started: int) -> Exception:
        return RuntimeError(
            f"spawning the Modal call of rank {started} failed ({type(exc).__name__}: "
            f"{launch.secrets.redact(str(exc))}); the app was stopped"
        )


def _add_cli_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--modal-gpu", default=None, metavar="GPU", help="GPU per replica, e.g. H100 or A100-80GB:2")
    group.add_argument(
        "--modal-cpu",
        type=number(minimum=0.0, inclusive=False),
        default=None,
        metavar="C",
        help="CPU cores per replica",
    )
    group.add_argument("--modal-memory", type=positive_int, default=None, metavar="MIB", help="memory per replica")
    group.add_argument(
        "--modal-secret", action="append", default=[], metavar="NAME", help="a secret stored in Modal (repeatable)"
    )
    group.add_argument("--modal-app", default=None, metavar="NAME", help="Modal app name (crf-diloco)")


def _from_cli(args: argparse.Namespace, context: BuildContext) -> ModalExecutor:
    resources = {k: v for k, v in (("cpu", args.modal_cpu), ("memory", args.modal_memory)) if v is not None}
    return ModalExecutor(
        args.modal_app or "crf-diloco",
        gpu=args.modal_gpu,
        image=args.image,
        pip=context.requirements,  # installed into the image, not at start-up
        wheels=[str(w) for w in context.wheels],
        timeout_s=min(args.timeout, MAX_TIMEOUT_S) if args.timeout else MAX_TIMEOUT_S,
        secret_env=args.secret,
        modal_secrets=args.modal_secret,
        **resources,
        **cancel_option(args),
    )


LAUNCHER = Launcher(
    "modal",
    "--executor modal (Modal; `modal token new` once)",
    _from_cli,
    add_options=_add_cli_options,
    remote=True,
    order=30,
)
