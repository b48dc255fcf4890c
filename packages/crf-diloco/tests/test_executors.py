"""LocalProcessExecutor, the executor protocol and helpers (real child processes); the cloud executors' import contract."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from crf_diloco.executors import (
    ENV_RANK,
    HFJobsExecutor,
    LocalProcessExecutor,
    LocalReplicaHandle,
    ModalExecutor,
    ReplicaFailureError,
    ReplicaResult,
    ServerlessExecutor,
    raise_for_failures,
    replica_environment,
    run_replicas,
)
from crf_diloco.executors.base import describe_returncode

BEHAVE = str(Path(__file__).parent / "replica_scripts" / "behave.py")


def behave(*args: str) -> list[str]:
    return [sys.executable, BEHAVE, *args]


def first_json_line(result: ReplicaResult) -> dict:
    return json.loads(result.stdout_tail.splitlines()[0])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_replica_environment_sets_the_four_variables_and_keeps_extra() -> None:
    env = replica_environment(2, 4, "s3://b/p", "run-1", {"FOO": "bar"})
    assert env == {
        "FOO": "bar",
        "CRF_DILOCO_RANK": "2",
        "CRF_DILOCO_WORLD_SIZE": "4",
        "CRF_DILOCO_URI": "s3://b/p",
        "CRF_DILOCO_RUN_ID": "run-1",
    }
    with pytest.raises(ValueError, match="must not set"):
        replica_environment(0, 1, "x", "r", {ENV_RANK: "5"})
    with pytest.raises(ValueError, match="0 <= rank < world_size=2"):
        replica_environment(2, 2, "x", "r")
    with pytest.raises(TypeError, match="strings"):
        replica_environment(0, 1, "x", "r", {"A": 1})  # type: ignore[dict-item]


def test_local_executor_wires_environment_args_and_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    executor = LocalProcessExecutor()
    assert isinstance(executor, ServerlessExecutor)
    handles = executor.launch_replicas(
        behave("--show-env", "MY_FLAG", "--show-env", "PYTHONUNBUFFERED", "--lr", "0.1"),
        world_size=3,
        uri="relative/store",
        run_id="exp-7",
        env={"MY_FLAG": "on"},
    )
    assert [h.rank for h in handles] == [0, 1, 2]
    assert len({h.pid for h in handles}) == 3
    results = executor.collect(handles, timeout=60)
    assert [r.rank for r in results] == [0, 1, 2]
    assert all(r.ok and r.returncode == 0 and r.error is None for r in results), [r.describe() for r in results]
    for rank, result in enumerate(results):
        record = first_json_line(result)
        assert record["rank"] == rank
        assert record["world_size"] == 3
        assert record["uri"] == str(tmp_path / "relative" / "store")  # made absolute for replicas with another cwd
        assert record["run_id"] == "exp-7"
        assert record["extra_argv"] == ["--lr", "0.1"]
        assert record["cwd"] == str(tmp_path)
        assert record["env"] == {"MY_FLAG": "on", "PYTHONUNBUFFERED": "1"}
        assert result.stderr_tail == f"stderr line of rank {rank}"


def test_local_executor_generates_a_fresh_run_id_and_keeps_scheme_uris() -> None:
    executor = LocalProcessExecutor()
    first = executor.collect(executor.launch_replicas(behave(), world_size=2, uri="memory://store"), timeout=60)
    second = executor.collect(executor.launch_replicas(behave(), world_size=1, uri="memory://store"), timeout=60)
    ids = {first_json_line(r)["run_id"] for r in first}
    assert len(ids) == 1  # one run id shared by the replicas of one launch
    assert ids.isdisjoint({first_json_line(second[0])["run_id"]})
    assert first_json_line(first[0])["uri"] == "memory://store"


def test_local_executor_streams_every_line_with_rank_and_stream(tmp_path: Path) -> None:
    seen: list[tuple[int, str, str]] = []
    lock = threading.Lock()

    def on_output(rank: int, stream: str, line: str) -> None:
        with lock:
            seen.append((rank, stream, line))

    executor = LocalProcessExecutor()
    results = run_replicas(executor, behave("--lines", "3"), world_size=2, uri=str(tmp_path), on_output=on_output)
    assert all(r.ok for r in results)
    for rank in (0, 1):
        stdout = [line for r, s, line in seen if r == rank and s == "stdout"]
        assert json.loads(stdout[0])["rank"] == rank
        assert stdout[1:] == [f"line {i} of rank {rank}" for i in range(3)]  # order kept within a replica
        assert [line for r, s, line in seen if r == rank and s == "stderr"] == [f"stderr line of rank {rank}"]


def test_local_executor_keeps_a_bounded_tail_and_survives_a_broken_callback(tmp_path: Path) -> None:
    def broken(rank: int, stream: str, line: str) -> None:
        raise RuntimeError("callback bug")

    executor = LocalProcessExecutor(tail_lines=5)
    # 20k lines (> a 64 KiB pipe buffer): if the pump stopped draining after the callback failed, this would hang
    (result,) = run_replicas(
        executor, behave("--lines", "20000"), world_size=1, uri=str(tmp_path), on_output=broken, timeout=60
    )
    assert result.ok, result.describe()
    assert result.stdout_tail.splitlines() == [f"line {i} of rank 0" for i in range(19995, 20000)]


def test_local_executor_reports_exception_exit_code_and_traceback_tail(tmp_path: Path) -> None:
    executor = LocalProcessExecutor()
    results = run_replicas(
        executor, behave("--fail-rank", "0", "--fail-raise"), world_size=2, uri=str(tmp_path), timeout=60
    )
    assert not results[0].ok
    assert results[0].returncode == 1
    assert results[0].error is None  # a plain non-zero exit: the exit code says it all
    assert "RuntimeError: replica 0 raised on purpose" in results[0].stderr_tail
    assert "Traceback" in results[0].stderr_tail
    assert results[0].describe().startswith("rank 0: FAILED (exit code 1) after ")
    assert results[1].ok


def test_local_executor_reports_death_by_signal(tmp_path: Path) -> None:
    executor = LocalProcessExecutor()
    (result,) = run_replicas(
        executor, behave("--fail-kill-self", "SIGKILL"), world_size=1, uri=str(tmp_path), timeout=60
    )
    assert result.returncode == -signal.SIGKILL
    assert result.error == "killed by signal SIGKILL"
    assert not result.ok
    assert not result.timed_out


def test_local_executor_timeout_terminates_late_replicas(tmp_path: Path) -> None:
    executor = LocalProcessExecutor(terminate_grace_s=5.0)
    handles = executor.launch_replicas(
        behave("--fail-rank", "1", "--fail-sleep", "60"), world_size=2, uri=str(tmp_path)
    )
    start = time.monotonic()
    results = executor.collect(handles, timeout=2.0)
    assert time.monotonic() - start < 15
    assert results[0].ok  # finished in time: not touched by the deadline
    late = results[1]
    assert late.timed_out
    assert late.returncode == -signal.SIGTERM  # went politely
    assert late.error == "timed out after 2 s; terminated (killed by signal SIGTERM)"
    assert late.stderr_tail == "stderr line of rank 1"  # output captured before the deadline is kept


def test_local_executor_sigkills_a_replica_that_ignores_sigterm(tmp_path: Path) -> None:
    executor = LocalProcessExecutor(terminate_grace_s=0.5)
    handles = executor.launch_replicas(behave("--ignore-sigterm", "--sleep", "60"), world_size=1, uri=str(tmp_path))
    (result,) = executor.collect(handles, timeout=1.0)
    assert result.timed_out
    assert result.returncode == -signal.SIGKILL


def test_local_executor_terminate_stops_the_whole_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    executor = LocalProcessExecutor(terminate_grace_s=2.0)
    handles = executor.launch_replicas(
        behave("--grandchild-pidfile", str(pidfile), "--sleep", "60"), world_size=1, uri=str(tmp_path)
    )
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pidfile.read_text())
    assert pid_alive(grandchild)
    executor.terminate(handles)
    executor.terminate(handles)  # idempotent
    (result,) = executor.collect(handles)
    assert result.returncode == -signal.SIGTERM
    assert not result.timed_out  # stopped on request, not by a deadline
    deadline = time.monotonic() + 10
    while pid_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(grandchild)


class Interrupted(BaseException):
    pass


class InterruptedWhileStarting(LocalProcessExecutor):
    """Delivers ``sig`` to this process right after rank 1's child exists, before its handle is returned."""

    def __init__(self, sig: signal.Signals, times: int = 1) -> None:
        super().__init__(terminate_grace_s=5.0)
        self.sig, self.times = sig, times
        self.pids: list[int] = []
        self.returned = 0

    def start_replica(self, launch: Any, plan: Any, rank: int) -> LocalReplicaHandle:
        handle = super().start_replica(launch, plan, rank)
        self.pids.append(handle.pid)
        if rank == 1:
            for _ in range(self.times):
                os.kill(os.getpid(), self.sig)
                time.sleep(0.2)  # the handler runs here, between bytecodes, unless it is held
        self.returned += 1
        return handle


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupt_while_a_replica_starts_stops_every_started_replica(tmp_path: Path, sig: signal.Signals) -> None:
    def raise_interrupted(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    executor = InterruptedWhileStarting(sig)
    previous = signal.signal(sig, raise_interrupted)
    try:
        with pytest.raises(Interrupted):
            executor.launch_replicas(behave("--sleep", "60"), world_size=3, uri=str(tmp_path))
    finally:
        signal.signal(sig, previous)
    assert signal.getsignal(sig) is previous  # the held handler was put back
    assert len(executor.pids) == 2  # rank 2 never started
    assert not any(pid_alive(pid) for pid in executor.pids)  # rank 1 included: started, then stopped, not orphaned
    assert executor.returned == 2  # the interrupt waited for rank 1's start to return


def test_a_second_interrupt_is_not_held_back_by_a_start_that_hangs(tmp_path: Path) -> None:
    def raise_interrupted(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    executor = InterruptedWhileStarting(signal.SIGINT, times=2)
    previous = signal.signal(signal.SIGINT, raise_interrupted)
    try:
        with pytest.raises(Interrupted):
            executor.launch_replicas(behave("--sleep", "60"), world_size=3, uri=str(tmp_path))
    finally:
        signal.signal(signal.SIGINT, previous)
        for pid in executor.pids:  # rank 1's start never returned its handle: this test stops it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    assert executor.returned == 1  # raised inside rank 1's start, at the second Ctrl-C
    assert signal.getsignal(signal.SIGINT) is previous


def test_local_executor_cannot_start_names_the_replica_and_command(tmp_path: Path) -> None:
    executor = LocalProcessExecutor()
    missing = str(tmp_path / "no-such-program")
    with pytest.raises(OSError, match=r"cannot start replica 0: .*no-such-program"):
        executor.launch_replicas([missing], world_size=2, uri=str(tmp_path))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, "world_size must be an int >= 1"),
        ({"world_size": True}, ValueError, "world_size must be an int >= 1"),
        ({"uri": ""}, ValueError, "uri must be a non-empty"),
        ({"run_id": "../escape"}, ValueError, "could escape the store prefix"),
        ({"run_id": "a/b"}, ValueError, "could escape the store prefix"),
        ({"command": "python train.py"}, TypeError, "argv list"),
        ({"command": []}, ValueError, "non-empty list of strings"),
        ({"env": {"CRF_DILOCO_URI": "x"}}, ValueError, "must not set"),
    ],
)
def test_local_executor_rejects_bad_launch_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    call = {"command": behave(), "world_size": 2, "uri": "memory://x", **kwargs}
    command = call.pop("command")
    with pytest.raises(error, match=match):
        LocalProcessExecutor().launch_replicas(command, **call)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), True])
def test_collect_rejects_bad_timeouts(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout must be None"):
        LocalProcessExecutor().collect([], timeout=timeout)


def test_local_executor_rejects_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cwd must be an existing directory"):
        LocalProcessExecutor(cwd=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="terminate_grace_s"):
        LocalProcessExecutor(terminate_grace_s=0)
    with pytest.raises(ValueError, match="tail_lines"):
        LocalProcessExecutor(tail_lines=0)


def test_raise_for_failures_lists_failed_ranks_with_their_stderr() -> None:
    ok = ReplicaResult(rank=0, returncode=0, duration_s=1.0)
    bad = ReplicaResult(rank=1, returncode=3, duration_s=0.5, stderr_tail="loading\nCUDA out of memory")
    raise_for_failures([ok])
    with pytest.raises(ReplicaFailureError) as info:
        raise_for_failures([ok, bad])
    message = str(info.value)
    assert message.startswith("1 of 2 replicas failed:")
    assert "rank 1: FAILED (exit code 3) after 0.5 s" in message
    assert "    | CUDA out of memory" in message
    assert info.value.results == [ok, bad]


@pytest.mark.parametrize(
    ("returncode", "text"),
    [
        (0, "exit code 0"),
        (3, "exit code 3"),
        (-9, "killed by signal SIGKILL"),
        (-15, "killed by signal SIGTERM"),
        (None, "no exit code"),
    ],
)
def test_describe_returncode(returncode: int | None, text: str) -> None:
    assert describe_returncode(returncode) == text


@pytest.mark.parametrize(
    ("cls", "module", "extra"), [(ModalExecutor, "modal", "modal"), (HFJobsExecutor, "huggingface_hub", "hf")]
)
def test_cloud_executors_without_their_sdk_name_the_extra(
    cls: type, module: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seed's v0 contract (failure mode 9: ``__init__`` raises ``NotImplementedError``) is gone: construction
    works once the SDK is installed, and without it fails with an ImportError that names the extra to install."""
    monkeypatch.setitem(sys.modules, module, None)  # makes `import <module>` raise ImportError
    with pytest.raises(ImportError, match=rf"pip install 'crf-diloco\[{extra}\]'") as info:
        cls()
    assert not isinstance(info.value, NotImplementedError)


@pytest.mark.parametrize(("cls", "module"), [(ModalExecutor, "modal"), (HFJobsExecutor, "huggingface_hub")])
def test_cloud_executors_construct_and_implement_the_protocol(cls: type, module: str) -> None:
    pytest.importorskip(module)
    executor = cls()
    assert isinstance(executor, ServerlessExecutor)


def test_cloud_executors_import_without_their_sdks() -> None:
    code = (
        "import sys\n"
        "from crf_diloco import HFJobsExecutor, LocalProcessExecutor, ModalExecutor, RayExecutor\n"
        "from crf_diloco import ReplicaResult, ServerlessExecutor, run_replicas\n"
        "import crf_diloco.executors.modal, crf_diloco.executors.hf_jobs, crf_diloco.executors.ray\n"
        "import crf_diloco.executors._modal_worker, crf_diloco.cli\n"
        "print(sorted(m for m in ('modal', 'huggingface_hub', 'ray', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_ray_executor_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from crf_diloco.executors.ray import RayExecutor

    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'crf-diloco\[ray\]'"):
        RayExecutor()


# -- the workspace's own wheel, for cloud replicas before a release ------------------------------------------------


class _Index(http.server.BaseHTTPRequestHandler):
    """A PEP 691 simple index on 127.0.0.1 answering what ``answers`` says per path."""

    answers: ClassVar[dict[str, tuple[int, bytes]]] = {}

    def do_GET(self) -> None:
        status, body = self.answers.get(self.path, (404, b"Not Found"))
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def simple_index() -> Iterator[tuple[str, dict[str, tuple[int, bytes]]]]:
    answers: ClassVar[dict[str, tuple[int, bytes]]] = {}
    handler = type("Index", (_Index,), {"answers": answers})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple", answers
    finally:
        server.shutdown()


def test_index_has_reads_the_json_simple_api(simple_index: tuple[str, dict[str, tuple[int, bytes]]]) -> None:
    from crf_diloco.executors.wheels import index_has

    url, answers = simple_index
    assert index_has("crf-diloco", "0.1.0", index=url) is False  # 404: the project is not there at all
    answers["/simple/crf-diloco/"] = (200, json.dumps({"versions": ["0.0.9", "0.1.0"], "files": []}).encode())
    assert index_has("crf-diloco", "0.1.0", index=url) is True
    assert index_has("crf-diloco", "0.2.0", index=url) is False
    files = [{"filename": "crf_diloco-0.2.0-py3-none-any.whl"}]
    answers["/simple/crf-diloco/"] = (200, json.dumps({"files": files}).encode())  # no PEP 700 "versions"
    assert index_has("crf-diloco", "0.2.0", index=url) is True
    answers["/simple/crf-diloco/"] = (200, b"<html>not json</html>")
    assert index_has("crf-diloco", "0.1.0", index=url) is None  # no clear answer: the caller ships the wheel
    answers["/simple/crf-diloco/"] = (503, b"")
    assert index_has("crf-diloco", "0.1.0", index=url) is None
    assert index_has("crf-diloco", "0.1.0", index="http://127.0.0.1:9/simple", timeout=2) is None


def test_index_url_follows_the_installers_settings() -> None:
    from crf_diloco.executors.wheels import DEFAULT_INDEX, index_url

    assert index_url({}) == DEFAULT_INDEX
    assert index_url({"PIP_INDEX_URL": "https://mirror/simple/"}) == "https://mirror/simple"
    assert (
        index_url({"UV_DEFAULT_INDEX": "https://a/simple", "PIP_INDEX_URL": "https://b/simple"}) == "https://a/simple"
    )
    assert (
        index_url({"CRF_DILOCO_INDEX_URL": "http://c/simple", "UV_DEFAULT_INDEX": "https://a/simple"})
        == "http://c/simple"
    )


def test_with_wheels_delivers_the_wheel_byte_for_byte_on_the_find_links(tmp_path: Path) -> None:
    from crf_diloco.executors.wheels import CHUNK_CHARS, with_wheels

    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    payload = os.urandom(200 * 1024)  # incompressible, bigger than one argument may be
    wheel.write_bytes(payload)
    probe = (
        "import hashlib,os,sys;d=os.environ['UV_FIND_LINKS'].split(',')[0];"
        "print((os.listdir(d), hashlib.sha256(open(os.path.join(d,'demo-1.0-py3-none-any.whl'),'rb').read()).hexdigest(),"
        " os.environ['UV_FIND_LINKS'].split(',')[1:], os.environ['PIP_FIND_LINKS'].split(' ')[0] == d, sys.argv[1:]))"
    )
    command = with_wheels([wheel], [sys.executable, "-c", probe, "a", "--", "b"], python=sys.executable)
    assert max(len(a) for a in command) <= CHUNK_CHARS + 1024
    env = {**os.environ, "UV_FIND_LINKS": "/srv/other"}
    env.pop("PIP_FIND_LINKS", None)
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == str(
        (["demo-1.0-py3-none-any.whl"], hashlib.sha256(payload).hexdigest(), ["/srv/other"], True, ["a", "--", "b"])
    )
    with pytest.raises(ValueError, match="is not a wheel file"):
        with_wheels([tmp_path / "missing.whl"], ["true"])


def test_workspace_wheel_is_built_from_this_checkout(tmp_path: Path) -> None:
    if shutil.which("uv") is None:
        pytest.skip("uv is not on PATH (pip install uv)")
    import zipfile

    from crf_diloco import __version__
    from crf_diloco.executors.wheels import source_tree, workspace_wheel

    if source_tree() is None:
        pytest.skip("crf-diloco is installed from a wheel here, not from a checkout")
    wheel = workspace_wheel(tmp_path)
    assert wheel.name == f"crf_diloco-{__version__}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    assert "crf_diloco/executors/wheels.py" in names
