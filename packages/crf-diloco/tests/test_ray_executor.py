"""RayExecutor on a real local Ray cluster (``ray.init(num_cpus=2)``, started once for the module)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crf_diloco.cli import main as cli_main
from crf_diloco.executors import ReplicaResult, ServerlessExecutor, run_replicas

pytestmark = pytest.mark.integration

BEHAVE = str(Path(__file__).parent / "replica_scripts" / "behave.py")


def behave(*args: str) -> list[str]:
    return [sys.executable, BEHAVE, *args]


def first_json_line(result: ReplicaResult) -> dict:
    return json.loads(result.stdout_tail.splitlines()[0])


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'crf-diloco[ray]')")
    # Started as from a background shell job (CI's): SIGINT ignored, which its raylet and workers inherit, and
    # through which a plain `ray.cancel` would no longer reach a running task (the executor re-arms it).
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture
def executor(ray_cluster: Any) -> Any:
    from crf_diloco.executors import RayExecutor

    return RayExecutor(terminate_grace_s=2.0)


def test_ray_executor_runs_replicas_with_environment_and_relays_output(executor: Any, tmp_path: Path) -> None:
    assert isinstance(executor, ServerlessExecutor)
    seen: list[tuple[int, str, str]] = []
    lock = threading.Lock()

    def on_output(rank: int, stream: str, line: str) -> None:
        with lock:
            seen.append((rank, stream, line))

    results = run_replicas(
        executor,
        behave("--lines", "2", "--show-env", "MY_FLAG", "--epochs", "3"),
        world_size=2,
        uri=str(tmp_path),
        run_id="ray-run",
        env={"MY_FLAG": "x"},
        on_output=on_output,
        timeout=120,
    )
    assert [r.rank for r in results] == [0, 1]
    assert all(r.ok for r in results), [r.describe() for r in results]
    for rank, result in enumerate(results):
        record = first_json_line(result)
        assert (record["rank"], record["world_size"], record["run_id"]) == (rank, 2, "ray-run")
        assert record["uri"] == str(tmp_path)
        assert record["env"] == {"MY_FLAG": "x"}
        assert record["extra_argv"] == ["--epochs", "3"]
        assert record["cwd"] == os.getcwd()  # the driver's cwd, not the Ray worker's session folder
        stdout = [line for r, s, line in seen if r == rank and s == "stdout"]
        assert stdout[1:] == [f"line 0 of rank {rank}", f"line 1 of rank {rank}"]
        assert (rank, "stderr", f"stderr line of rank {rank}") in seen


def test_ray_executor_maps_nonzero_exit_and_worker_crash_to_failed_replicas(executor: Any, tmp_path: Path) -> None:
    exit_results = run_replicas(
        executor,
        behave("--fail-rank", "1", "--fail-stderr", "diverged", "--fail-exit", "3"),
        world_size=2,
        uri=str(tmp_path),
        timeout=120,
    )
    assert exit_results[0].ok
    assert exit_results[1].returncode == 3
    assert exit_results[1].stderr_tail.splitlines()[-1] == "diverged"
    # rank 0's process SIGKILLs its parent, the Ray worker running the task: Ray reports the worker's death
    (crash,) = run_replicas(executor, behave("--fail-kill-parent"), world_size=1, uri=str(tmp_path), timeout=120)
    assert not crash.ok
    assert crash.returncode is None
    assert crash.error is not None
    assert crash.error.startswith("Ray worker died (")


def test_ray_executor_timeout_cancels_task_and_stops_its_process(executor: Any, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    handles = executor.launch_replicas(
        behave("--pidfile-dir", str(pids), "--sleep", "60"), world_size=1, uri=str(tmp_path)
    )
    # The timeout under test is the replica's: wait until its process runs (a loaded machine starts Ray workers
    # in seconds; a task still queued at the deadline is cancelled without a process, another path).
    deadline = time.monotonic() + 60
    while not (pids / "rank0.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    (result,) = executor.collect(handles, timeout=3.0)
    assert time.monotonic() - start < 30
    assert result.timed_out
    assert result.returncode == -signal.SIGTERM
    assert result.error == "timed out after 3 s; terminated (killed by signal SIGTERM)"
    assert result.stderr_tail == "stderr line of rank 0"  # the task's own report survives the cancellation
    pid = int((pids / "rank0.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_cli_launch_with_ray_executor(ray_cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = cli_main(
        ["launch", "--replicas", "2", "--uri", str(tmp_path), "--executor", "ray", BEHAVE, "--lines", "1"]
    )
    out, err = capsys.readouterr()
    assert status == 0, err
    for rank in (0, 1):
        assert f"[rank {rank}] line 0 of rank {rank}" in out.splitlines()
    assert "2 of 2 replicas succeeded" in err
    assert ray_cluster.is_initialized()  # the CLI did not shut down a cluster it did not start


def test_ray_executor_refuses_more_replicas_than_the_cluster_can_run_at_once(ray_cluster: Any, tmp_path: Path) -> None:
    from crf_diloco.executors import RayExecutor

    # 3 replicas x 1 CPU on a 2-CPU cluster: two would start and wait forever for the third in their first round
    executor = RayExecutor(placement_timeout_s=2.0)
    with pytest.raises(RuntimeError, match=r"cannot run 3 replicas at once \(\{'CPU': 1.0\} each"):
        executor.launch_replicas(behave(), world_size=3, uri=str(tmp_path))
    # the reservation was released: a launch that fits still runs
    results = run_replicas(executor, behave(), world_size=2, uri=str(tmp_path), timeout=120)
    assert all(r.ok for r in results)
