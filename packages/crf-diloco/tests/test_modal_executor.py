"""ModalExecutor up to Modal's service: real ``modal`` app and function definitions, the container-side replica body
run for real (child processes), argument and secret plumbing, and the mapping of Modal's outcomes and errors.

What needs Modal's service (running the app, spawning calls in containers, the queue, cancellation on Modal) is
replaced by `ThreadSession`: each spawned call runs the real function body (``Function.local``) on a thread, and a
cancel raises ``modal.exception.InputCancellation`` in it, as Modal does in a container; the caller's ``get`` then
raises ``modal.exception.RemoteError``, as the real client does for a call whose result is TERMINATED (it never
raises ``InputCancellation``: that exists only in the container). A preemption kills an attempt the same way and runs
the body again, as Modal reschedules a preempted input. A live Modal run is the
remaining check (docs/packages/crf-diloco.md, "Modal").
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pickle
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

modal = pytest.importorskip("modal", reason="modal is not installed (pip install 'crf-diloco[modal]')")

from crf_diloco.executors import ModalExecutor, ReplicaResult, ServerlessExecutor, run_replicas  # noqa: E402
from crf_diloco.executors._modal_worker import run_replica  # noqa: E402
from crf_diloco.executors._remote import ReplicaSecrets  # noqa: E402
from crf_diloco.executors.modal import MAX_TIMEOUT_S, _ModalCall, _ModalLaunch  # noqa: E402

BEHAVE = str(Path(__file__).parent / "replica_scripts" / "behave.py")
RUN_SECRET = "crf-run-secret-0a9b8c7d6e5f4-0123456789abcdef"


def behave(*args: str) -> list[str]:
    return [sys.executable, BEHAVE, *args]


def first_json_line(result: ReplicaResult) -> dict[str, Any]:
    return json.loads(result.stdout_tail.splitlines()[0])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


class LocalQueue:
    """``modal.Queue``'s ``put``/``get_many`` on a ``queue.Queue``."""

    def __init__(self) -> None:
        self._q: queue.Queue[Any] = queue.Queue()

    def put(self, value: Any, block: bool = True, timeout: float | None = None) -> None:
        self._q.put(value)

    def get_many(self, n_values: int, block: bool = True, timeout: float | None = None) -> list[Any]:
        items = [self._q.get(block=block, timeout=timeout)] if block else []  # raises queue.Empty on timeout
        while len(items) < n_values:
            try:
                items.append(self._q.get_nowait())
            except queue.Empty:
                break
        return items


class LocalDict:
    """``modal.Dict``'s ``put``/``get`` on a dict."""

    def __init__(self) -> None:
        self._d: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def put(self, key: Any, value: Any, *, skip_if_exists: bool = False) -> bool:
        with self._lock:
            if skip_if_exists and key in self._d:
                return False
            self._d[key] = value
            return True

    def get(self, key: Any, default: Any = None) -> Any:
        return self._d.get(key, default)


class Preempted(BaseException):
    """Raised in an attempt's thread to kill it the way a preemption kills its container."""


class ThreadCall:
    """A spawned call running the real function body on a thread; ``get``/``cancel`` as ``modal.FunctionCall``.

    A cancel raises ``InputCancellation`` inside the body, as Modal does in a container. One that arrives before
    the thread has entered the body (a launch cancelled at once) is held and raised there, never into the thread's
    start-up code, where it would kill the thread without an outcome.
    """

    def __init__(self, function: Any, args: tuple[Any, ...], index: int) -> None:
        self.object_id = f"fc-thread{index}"
        self.cancelled_with: bool | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._in_body = False
        self._held: type[BaseException] | None = None
        self._value: Any = None
        self._error: BaseException | None = None
        self._function, self._args = function, args
        self._thread = self._start()

    def _start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        try:
            self._value = self._body()
        except Preempted:
            return  # Modal reschedules the input: `preempt` starts the next attempt
        except BaseException as exc:
            self._error = exc
        self._done.set()

    def _body(self) -> Any:
        with self._lock:
            held, self._held = self._held, None
            if held is not None:
                raise held
            self._in_body = True
        try:
            return self._function.local(*self._args)
        finally:
            with self._lock:
                self._in_body = False

    def get(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError()
        if isinstance(self._error, modal.exception.InputCancellation):
            raise modal.exception.RemoteError("Function call was terminated")  # what the client sees of TERMINATED
        if self._error is not None:
            raise self._error
        return self._value

    def _raise_in_thread(self, exc: type[BaseException]) -> None:
        with self._lock:
            if self._done.is_set():
                return
            if not self._in_body:
                self._held = exc  # raised when the body starts
                return
            assert self._thread.ident is not None
            ident = ctypes.c_ulong(self._thread.ident)
            # A thread the body is starting (its replica's output pumps) carries the body's ident until it runs
            # (CPython <= 3.12), so an exception set then lands on both. Such a thread sits in threading's limbo
            # from `start()` until it runs, and enters it under `_active_limbo_lock`: hold that lock and set the
            # exception only while limbo is empty.
            deadline = time.monotonic() + 30
            while True:
                with threading._active_limbo_lock:  # type: ignore[attr-defined]
                    if not threading._limbo:  # type: ignore[attr-defined]
                        hit = ctypes.pythonapi.PyThreadState_SetAsyncExc(ident, ctypes.py_object(exc))
                        assert hit == 1, f"the exception reached {hit} threads"
                        return
                assert time.monotonic() < deadline, "the body kept starting threads for 30 s"
                time.sleep(0.001)

    def cancel(self, terminate_containers: bool = False) -> None:
        self.cancelled_with = terminate_containers
        self._raise_in_thread(modal.exception.InputCancellation)

    def preempt(self) -> None:
        """Kill the running attempt (its command is stopped as on a cancel), then run the input again."""
        self._raise_in_thread(Preempted)
        self._thread.join(30)
        self._thread = self._start()


class ThreadSession:
    """Modal's service replaced by threads; records what the executor handed to it."""

    def __init__(self) -> None:
        self.apps: list[Any] = []
        self.spawned: list[tuple[Any, ...]] = []
        self.calls: list[ThreadCall] = []
        self.closed = threading.Event()
        self.fail_spawn_at: int | None = None

    def open(self, app: Any, *, show_output: bool, log_queue: bool) -> tuple[contextlib.ExitStack, Any, Any]:
        self.apps.append(app)
        stack = contextlib.ExitStack()
        stack.callback(self.closed.set)
        return stack, LocalQueue() if log_queue else None, LocalDict()

    def spawn(self, function: Any, *args: Any) -> ThreadCall:
        if self.fail_spawn_at == len(self.calls):
            raise modal.exception.ExecutionError(f"no capacity for {RUN_SECRET}")
        pickle.loads(pickle.dumps(args[:4] + args[5:7]))  # Modal pickles the arguments: they must survive it
        self.spawned.append(args)
        call = ThreadCall(function, args, len(self.calls))
        self.calls.append(call)
        return call


@pytest.fixture
def session() -> ThreadSession:
    return ThreadSession()


@pytest.fixture
def make_executor(session: ThreadSession) -> Callable[..., ModalExecutor]:
    def make(**options: Any) -> ModalExecutor:
        settings: dict[str, Any] = {"poll_interval_s": 0.1, "cancel_grace_s": 20.0, "terminate_grace_s": 2.0, **options}
        executor = ModalExecutor(**settings)
        executor._session = session  # type: ignore[assignment]
        return executor

    return make


def test_modal_app_definition_carries_gpu_timeout_image_and_secrets() -> None:
    executor = ModalExecutor(
        "crf-test",
        gpu="A100-80GB:2",
        cpu=4.0,
        memory=16384,
        pip=["crf-diloco[s3]==0.1.0"],
        timeout_s=3600.2,
        modal_secrets=["aws"],
        region="us-east",
    )
    definition = executor.build_app(ReplicaSecrets({"CRF_DILOCO_SECRET": RUN_SECRET}))
    assert isinstance(definition.app, modal.App)
    assert isinstance(definition.function, modal.Function)
    assert definition.app.name == "crf-test"
    options = definition.options
    assert isinstance(options["image"], modal.Image)
    assert {k: v for k, v in options.items() if k not in ("image", "secrets")} == {
        "gpu": "A100-80GB:2",
        "cpu": 4.0,
        "memory": 16384,
        "region": "us-east",
        "timeout": 3601,
        "retries": 0,  # a crash is a failed replica, not a silent re-run
        "serialized": True,
    }
    named, per_run = options["secrets"]  # the Modal secret "aws", then this launch's secrets
    assert isinstance(named, modal.Secret)
    assert isinstance(per_run, modal.Secret)
    assert "CRF_DILOCO_SECRET" in repr(per_run)  # Modal shows the names only
    assert RUN_SECRET not in repr(executor) + repr(definition)
    # the function is the replica body: calling it locally runs the command for real
    result = definition.function.local(3, [sys.executable, "-c", "print('hi')"], {}, [], None, 10, 1.0)
    assert result["rank"] == 3
    assert result["returncode"] == 0
    assert result["stdout_tail"] == "hi"


def test_modal_image_and_defaults() -> None:
    executor = ModalExecutor()
    assert executor.timeout_s == MAX_TIMEOUT_S  # Modal's own 300 s default is far too short to train
    assert executor.python_version == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert "gpu" not in executor.build_app(ReplicaSecrets()).options
    assert isinstance(ModalExecutor(image="pytorch/pytorch:2.7.0-cuda12.6-cudnn9-runtime").build_image(), modal.Image)
    assert isinstance(ModalExecutor(image=modal.Image.debian_slim(), gpu=["H100", "A100"]).build_image(), modal.Image)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"app_name": "my app"}, ValueError, "app_name"),
        ({"gpu": "H100 x8"}, ValueError, "gpu must be a GPU type"),
        ({"gpu": []}, ValueError, "gpu must be a GPU type"),
        ({"gpu": "H100:0"}, ValueError, "gpu must be a GPU type"),
        ({"cpu": 0}, ValueError, "cpu must be"),
        ({"memory": 1.5}, ValueError, "memory must be a whole number"),
        ({"memory": True}, ValueError, "memory must be a whole number"),
        ({"image": 3}, TypeError, "image must be a modal.Image"),
        ({"pip": "torch"}, ValueError, "pip must be a list"),
        ({"timeout_s": MAX_TIMEOUT_S + 1}, ValueError, "at most 86400"),
        ({"timeout_s": 0}, ValueError, "timeout_s"),
        ({"modal_secrets": "aws"}, TypeError, "list of secret names"),
        ({"modal_secrets": ["../aws"]}, ValueError, "modal_secrets entry"),
        ({"secrets": {"A": 1}}, ValueError, "non-empty strings"),
        ({"terminate_grace_s": -1}, ValueError, "terminate_grace_s"),
        ({"cancel_on_failure": None}, TypeError, "cancel_on_failure"),
    ],
)
def test_modal_executor_rejects_bad_settings(options: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ModalExecutor(**options)


def test_modal_worker_runs_the_command_relays_batches_and_masks_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRF_DILOCO_SECRET", RUN_SECRET)  # what Modal's secret does in the container
    env = {"CRF_DILOCO_RANK": "1", "CRF_DILOCO_WORLD_SIZE": "2", "CRF_DILOCO_URI": "s3://b/p", "CRF_DILOCO_RUN_ID": "r"}
    log_queue = LocalQueue()
    result = run_replica(
        1, behave("--show-env", "CRF_DILOCO_SECRET", "--lines", "3"), env, ["CRF_DILOCO_SECRET"], log_queue, 40, 1.0
    )
    assert result["returncode"] == 0
    assert result["error"] is None
    assert set(result) == {"rank", "returncode", "duration_s", "stdout_tail", "stderr_tail", "timed_out", "error"}
    record = json.loads(result["stdout_tail"].splitlines()[0])
    assert (record["rank"], record["uri"], record["env"]) == (1, "s3://b/p", {"CRF_DILOCO_SECRET": "***"})
    items = log_queue.get_many(100, block=False)
    assert {rank for rank, _ in items} == {1}
    lines = [item for _, batch in items for item in batch]
    stdout = [line for stream, line in lines if stream == "stdout"]
    assert stdout[1:] == ["line 0 of rank 1", "line 1 of rank 1", "line 2 of rank 1"]
    assert [line for stream, line in lines if stream == "stderr"] == ["stderr line of rank 1"]
    assert RUN_SECRET not in json.dumps([lines, result])


def test_modal_worker_without_a_queue_prints_rank_prefixed_lines(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"CRF_DILOCO_RANK": "0", "CRF_DILOCO_WORLD_SIZE": "1", "CRF_DILOCO_URI": "x", "CRF_DILOCO_RUN_ID": "r"}
    result = run_replica(0, behave("--fail-exit", "3"), env, [], None, 40, 1.0)
    assert result["returncode"] == 3
    out = capsys.readouterr()
    assert out.out.splitlines()[0].startswith('[rank 0] {"rank": 0')
    assert out.err.splitlines() == ["[rank 0] stderr line of rank 0"]


def test_modal_worker_reports_a_command_that_cannot_start() -> None:
    result = run_replica(2, ["/nonexistent/python"], {}, [], None, 40, 1.0)
    assert result["returncode"] is None
    assert result["error"].startswith("cannot start replica 2:")


def test_modal_executor_runs_replicas_and_relays_output(
    session: ThreadSession, make_executor: Callable[..., ModalExecutor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRF_DILOCO_SECRET", RUN_SECRET)  # the per-run key in the launcher; Modal injects it remotely
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-4e5f6a7b8c")
    executor = make_executor(secret_env=["AWS_SECRET_ACCESS_KEY"])
    assert isinstance(executor, ServerlessExecutor)
    seen: list[tuple[int, str, str]] = []
    lock = threading.Lock()

    def on_output(rank: int, stream: str, line: str) -> None:
        with lock:
            seen.append((rank, stream, line))

    results = run_replicas(
        executor,
        behave("--show-env", "MY_FLAG", "--show-env", "AWS_SECRET_ACCESS_KEY", "--lines", "2"),
        world_size=3,
        uri="s3://bucket/runs",
        run_id="modal-run",
        env={"MY_FLAG": "on"},
        on_output=on_output,
        timeout=120,
    )
    assert all(r.ok for r in results), [r.describe() for r in results]
    for rank, result in enumerate(results):
        record = first_json_line(result)
        assert (record["rank"], record["world_size"], record["run_id"]) == (rank, 3, "modal-run")
        assert record["env"] == {"MY_FLAG": "on", "AWS_SECRET_ACCESS_KEY": "***"}
        stdout = [line for r, s, line in seen if r == rank and s == "stdout"]
        assert stdout[1:] == [f"line 0 of rank {rank}", f"line 1 of rank {rank}"]
        assert [line for r, s, line in seen if r == rank and s == "stderr"] == [f"stderr line of rank {rank}"]
    # the arguments of each call: rank, command, plain env, the secrets' names (never their values)
    for rank, args in enumerate(session.spawned):
        assert args[0] == rank
        assert args[2] == {
            "PYTHONUNBUFFERED": "1",
            "MY_FLAG": "on",
            "CRF_DILOCO_RANK": str(rank),
            "CRF_DILOCO_WORLD_SIZE": "3",
            "CRF_DILOCO_URI": "s3://bucket/runs",
            "CRF_DILOCO_RUN_ID": "modal-run",
        }
        assert args[3] == ["AWS_SECRET_ACCESS_KEY", "CRF_DILOCO_SECRET"]
        assert RUN_SECRET not in repr(args)
    assert session.closed.is_set()  # collect stopped the app


def test_modal_executor_cancels_the_others_when_one_fails(
    session: ThreadSession, make_executor: Callable[..., ModalExecutor], tmp_path: Path
) -> None:
    executor = make_executor()
    command = behave("--pidfile-dir", str(tmp_path), "--fail-rank", "1", "--fail-raise", "--sleep", "120")
    handles = executor.launch_replicas(command, world_size=3, uri="memory://m")
    assert [h.call_id for h in handles] == ["fc-thread0", "fc-thread1", "fc-thread2"]
    results = executor.collect(handles, timeout=120)
    assert results[1].returncode == 1
    assert "RuntimeError: replica 1 raised on purpose" in results[1].stderr_tail
    for rank in (0, 2):
        assert results[rank].error == "cancelled after rank 1 failed; the call was cancelled on Modal"
        assert session.calls[rank].cancelled_with is True  # terminate_containers
        assert not pid_alive(int((tmp_path / f"rank{rank}.pid").read_text()))  # the container stopped its command


def test_modal_executor_timeout_and_terminate(
    session: ThreadSession, make_executor: Callable[..., ModalExecutor]
) -> None:
    executor = make_executor(cancel_grace_s=60.0)  # a cancelled local container ends in seconds, slower under load
    handles = executor.launch_replicas(
        behave("--fail-rank", "1", "--fail-sleep", "120"), world_size=2, uri="memory://m"
    )
    results = executor.collect(handles, timeout=3)
    assert results[0].ok
    assert results[1].timed_out
    assert results[1].error == "timed out after 3 s; the call was cancelled on Modal"
    handles = executor.launch_replicas(behave("--sleep", "120"), world_size=2, uri="memory://m")
    executor.terminate(handles)
    executor.terminate(handles)  # idempotent
    assert all(call.cancelled_with for call in session.calls[2:])
    results = executor.collect(handles, timeout=60)
    assert [r.error for r in results] == ["cancelled by terminate(); the call was cancelled on Modal"] * 2


# -- the SDK boundary: what each Modal outcome becomes -----------------------------------------------------------


class ScriptedCall:
    """A ``FunctionCall`` whose ``get`` returns or raises what the test says."""

    object_id = "fc-scripted"

    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome
        self.cancelled = False

    def get(self, timeout: float | None = None) -> Any:
        if isinstance(self.outcome, BaseException) or (
            isinstance(self.outcome, type) and issubclass(self.outcome, BaseException)
        ):
            raise self.outcome
        return self.outcome

    def cancel(self, terminate_containers: bool = False) -> None:
        self.cancelled = True


def scripted(outcome: Any, secrets: ReplicaSecrets | None = None, *, cancelled: bool = False) -> _ModalCall:
    launch = _ModalLaunch(
        modal=modal, stack=contextlib.ExitStack(), drain=None, secrets=secrets or ReplicaSecrets(), timeout_s=600
    )
    call = _ModalCall(launch, 1, ScriptedCall(outcome))
    call.cancel_requested = cancelled
    return call


GOOD = {"rank": 1, "returncode": 0, "duration_s": 2.5, "stdout_tail": "done", "stderr_tail": "", "timed_out": False,
        "error": None}  # fmt: skip


@pytest.mark.parametrize(
    ("outcome", "error", "timed_out"),
    [
        (GOOD, None, False),
        ({**GOOD, "returncode": -9, "error": "killed by signal SIGKILL"}, "killed by signal SIGKILL", False),
        (modal.exception.FunctionTimeoutError("Task's current input hit its timeout of 600s"),
         "Modal stopped it at the function timeout of 600 s (Task's current input hit its timeout of 600s)", True),
        (modal.exception.OutputExpiredError(), "Modal no longer holds the result of this call (it expired)", False),
        (modal.exception.RemoteError("container crashed"),
         "the replica's Modal call failed (RemoteError: container crashed)", False),
        (modal.exception.InternalFailure("worker lost"),
         "the replica's Modal call failed (InternalFailure: worker lost)", False),
        (ValueError("raised in the container"),
         "the replica's Modal call failed (ValueError: raised in the container)", False),
    ],
)  # fmt: skip
def test_modal_outcomes_map_to_replica_results(outcome: Any, error: str | None, timed_out: bool) -> None:
    result = scripted(outcome).poll()
    assert result is not None
    assert result.rank == 1
    assert result.error == error
    assert result.timed_out is timed_out
    assert result.ok is (error is None)
    if error is None:
        assert (result.returncode, result.duration_s, result.stdout_tail) == (0, 2.5, "done")


def test_modal_a_cancelled_call_is_the_remote_error_of_its_terminated_result() -> None:
    """The client raises ``RemoteError`` for a TERMINATED result (modal/_utils/function_utils.py, _process_result)."""
    terminated = modal.exception.RemoteError("Function call was terminated")
    result = scripted(terminated, cancelled=True).poll()
    assert result is not None
    assert result.error == "the call was cancelled on Modal"
    result = scripted(terminated).poll()  # not cancelled by the launcher: a failure, said as it is
    assert result is not None
    assert result.error == "the replica's Modal call failed (RemoteError: Function call was terminated)"


def test_modal_a_preempted_replica_is_not_rerun_and_says_it_was_restarted(
    session: ThreadSession, make_executor: Callable[..., ModalExecutor], tmp_path: Path
) -> None:
    executor = make_executor(cancel_on_failure=False)
    marks = tmp_path / "marks"
    marks.mkdir()
    handles = executor.launch_replicas(
        behave("--pidfile-dir", str(marks), "--sleep", "2"), world_size=2, uri="memory://m"
    )
    deadline = time.monotonic() + 60
    while not (marks / "rank1.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    first_pid = int((marks / "rank1.pid").read_text())
    (marks / "rank1.pid").unlink()
    session.calls[1].preempt()  # Modal kills rank 1's container and reschedules its input
    results = executor.collect(handles, timeout=120)
    assert results[0].ok
    assert not results[1].ok
    assert results[1].error is not None
    assert results[1].error.startswith("Modal restarted replica 1 (its input was preempted")
    assert "it was not run again" in results[1].error
    assert not (marks / "rank1.pid").exists()  # the command did not start a second time
    assert not pid_alive(first_pid)  # and the first attempt's command was stopped with its container


@pytest.mark.parametrize("still_running", [TimeoutError(), modal.exception.TimeoutError()])
def test_modal_call_not_done_yet_is_still_running(still_running: BaseException) -> None:
    assert scripted(still_running).poll() is None


@pytest.mark.parametrize("unreachable", [modal.exception.ConnectionError("reset"), ConnectionResetError("reset")])
def test_modal_connection_errors_propagate_to_the_lost_contact_clock(unreachable: BaseException) -> None:
    with pytest.raises(type(unreachable)):
        scripted(unreachable).poll()


# -- adversarial: hostile results, leaking secrets, broken transport -------------------------------------------------
# 12 attacks or bad inputs, all contained: nothing hangs, nothing leaks, no call is left running.


@pytest.mark.parametrize(
    "value",
    [
        "not a dict",
        {**GOOD, "rank": 0},  # someone else's result
        {**GOOD, "returncode": True},  # a bool is no exit code
        {**GOOD, "extra": 1},
        {k: v for k, v in GOOD.items() if k != "error"},
        {**GOOD, "stdout_tail": b"bytes"},
    ],
)
def test_adversarial_malformed_results_are_failures(value: Any) -> None:
    result = scripted(value).poll()
    assert result is not None
    assert not result.ok
    assert result.error is not None
    assert result.error.startswith("the replica's Modal call returned a malformed result")


def test_adversarial_secrets_in_remote_errors_and_results_are_masked() -> None:
    secrets = ReplicaSecrets({"CRF_DILOCO_SECRET": RUN_SECRET})
    failed = scripted(modal.exception.RemoteError(f"boom {RUN_SECRET}"), secrets).poll()
    assert failed is not None
    assert failed.error == "the replica's Modal call failed (RemoteError: boom ***)"
    leaked = {**GOOD, "stdout_tail": f"key={RUN_SECRET}", "error": f"x {RUN_SECRET}", "returncode": 1}
    result = scripted(leaked, secrets).poll()
    assert result is not None
    assert RUN_SECRET not in repr(result)


def test_adversarial_garbage_in_the_log_queue_is_dropped(
    session: ThreadSession, make_executor: Callable[..., ModalExecutor], caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[tuple[int, str, str]] = []
    executor = make_executor()
    handles = executor.launch_replicas(
        behave("--sleep", "1"), world_size=1, uri="memory://m", on_output=lambda r, s, line: seen.append((r, s, line))
    )
    log_queue = session.spawned[0][4]
    for garbage in ("junk", (7, [("stdout", "wrong rank")]), (0, "not a batch"), (0, [("stdout",)])):
        log_queue.put(garbage)
    log_queue.put((0, [("weird-stream", "kept as stdout")]))
    results = executor.collect(handles, timeout=60)
    assert results[0].ok
    assert (0, "stdout", "kept as stdout") in seen
    assert not any("wrong rank" in line for _, _, line in seen)
    assert caplog.text.count("dropped a malformed output batch") == 4


def test_adversarial_lost_contact_is_a_failure_and_cancels_the_rest(
    make_executor: Callable[..., ModalExecutor],
) -> None:
    executor = make_executor(lost_contact_s=0.5)
    handles = executor.launch_replicas(behave("--sleep", "120"), world_size=2, uri="memory://m")
    running = handles[0]._replica.call
    handles[0]._replica.call = ScriptedCall(
        modal.exception.ConnectionError("connection reset")
    )  # the link to Modal breaks
    try:
        results = executor.collect(handles, timeout=60)
    finally:  # rank 0's container, which the executor can no longer reach, is this test's to stop
        running.cancel(terminate_containers=True)
        with contextlib.suppress(modal.exception.RemoteError):
            running.get(timeout=60)
    assert results[0].error is not None
    assert results[0].error.startswith("lost contact with the backend for ")
    assert results[1].error == "cancelled after rank 0 failed; the call was cancelled on Modal"


def test_adversarial_failed_spawn_stops_the_app_and_masks_the_message(
    session: ThreadSession, make_executor: Callable[..., ModalExecutor]
) -> None:
    session.fail_spawn_at = 1
    executor = make_executor(secrets={"CRF_DILOCO_SECRET": RUN_SECRET})
    with pytest.raises(RuntimeError) as info:
        executor.launch_replicas(behave("--sleep", "120"), world_size=3, uri="memory://m")
    assert str(info.value) == (
        "spawning the Modal call of rank 1 failed (ExecutionError: no capacity for ***); the app was stopped"
    )
    assert session.calls[0].cancelled_with is True
    assert session.closed.is_set()


def test_adversarial_app_that_cannot_start_spawns_nothing(make_executor: Callable[..., ModalExecutor]) -> None:
    class NoAuth(ThreadSession):
        def open(self, app: Any, *, show_output: bool, log_queue: bool) -> tuple[contextlib.ExitStack, Any, Any]:
            raise modal.exception.AuthError(f"token {RUN_SECRET} rejected")

    executor = make_executor(secrets={"CRF_DILOCO_SECRET": RUN_SECRET})
    executor._session = NoAuth()  # type: ignore[assignment]
    with pytest.raises(
        RuntimeError, match=r"cannot start the Modal app 'crf-diloco' \(AuthError: token \*\*\* rejected\)"
    ):
        executor.launch_replicas(behave(), world_size=2, uri="memory://m")


def test_modal_image_carries_shipped_wheels_as_pips_find_links(tmp_path: Path) -> None:
    from crf_diloco.executors.modal import WHEEL_DIR

    wheel = tmp_path / "crf_diloco-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK")
    executor = ModalExecutor(pip=["crf-diloco[s3]==0.1.0"], wheels=[str(wheel)])
    assert executor.wheels == (str(wheel),)
    executor.build_image()  # Modal checks the local file and the build steps here
    assert WHEEL_DIR.startswith("/")
    for bad in ([str(tmp_path / "missing.whl")], [str(tmp_path)], str(wheel)):
        with pytest.raises(ValueError, match=r"wheels must be a list of paths of existing \.whl files"):
            ModalExecutor(wheels=bad)  # type: ignore[arg-type]
