"""HFJobsExecutor through the real ``huggingface_hub`` client, against a Jobs endpoint on 127.0.0.1 that runs every
job as a local process (``hf_jobs_server.py``; what it does not cover is listed in its docstring)."""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("huggingface_hub", reason="huggingface_hub is not installed (pip install 'crf-diloco[hf]')")

from crf_diloco.executors import HFJobsExecutor, ReplicaResult, ServerlessExecutor, run_replicas
from crf_diloco.executors.hf_jobs import DEFAULT_IMAGE, LABEL_RANK, LABEL_RUN_ID

pytestmark = pytest.mark.integration

TESTS = Path(__file__).parent
SERVER = TESTS / "hf_jobs_server.py"
BEHAVE = str(TESTS / "replica_scripts" / "behave.py")
TOKEN = "hf_crf_test_token_8f3a91c2d4"
USER = "alice"
RUN_SECRET = "crf-run-secret-5b2d7e0c9a41f3-0123456789abcdef"


def behave(*args: str) -> list[str]:
    return ["python", BEHAVE, *args]  # "python" as a job would say it; the server's PATH resolves it to this venv


def first_json_line(result: ReplicaResult) -> dict[str, Any]:
    return json.loads(result.stdout_tail.splitlines()[0])


@dataclass
class JobsServer:
    """The running fake endpoint: its URL plus the test-only views and switches."""

    url: str
    process: subprocess.Popen[str]

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")

    def jobs(self) -> list[dict[str, Any]]:
        return self._call("GET", "/_fake/jobs")

    def behave(self, **knobs: Any) -> None:
        self._call("POST", "/_fake/behaviour", knobs)

    def stats(self) -> dict[str, int]:
        return self._call("GET", "/_fake/stats")

    def kill(self, job_id: str) -> None:
        self._call("POST", f"/_fake/jobs/{job_id}/kill", {})

    def wait_for(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float = 60) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            jobs = self.jobs()
            if predicate(jobs):
                return jobs
            time.sleep(0.1)
        raise AssertionError(f"the jobs server never reached the expected state: {self.jobs()}")


@pytest.fixture
def jobs_server(tmp_path: Path) -> Iterator[JobsServer]:
    workdir = tmp_path / "jobs"
    workdir.mkdir()
    # the server's PATH stands in for the image: "python" in a job is this interpreter
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    process = subprocess.Popen(
        [sys.executable, str(SERVER), "--token", TOKEN, "--user", USER, "--org", "crf-org", "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    url = process.stdout.readline().strip()
    assert url.startswith("http://127.0.0.1:"), url
    try:
        yield JobsServer(url, process)
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture
def make_executor(jobs_server: JobsServer) -> Callable[..., HFJobsExecutor]:
    def make(**options: Any) -> HFJobsExecutor:
        settings: dict[str, Any] = {
            "endpoint": jobs_server.url,
            "token": TOKEN,
            "poll_interval_s": 0.1,
            "cancel_grace_s": 20.0,
            "log_drain_s": 5.0,
            **options,
        }
        return HFJobsExecutor(**settings)

    return make


def test_hf_jobs_replicas_get_the_env_contract_and_secrets_only_as_job_secrets(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRF_DILOCO_SECRET", RUN_SECRET)  # the per-run key, as `crf-diloco launch` provides it
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-9d8c7b6a5f4e")
    executor = make_executor(
        flavor="cpu-upgrade", job_timeout_s=120.5, labels={"team": "crf"}, secret_env=["AWS_SECRET_ACCESS_KEY"]
    )
    assert isinstance(executor, ServerlessExecutor)
    seen: list[tuple[int, str, str]] = []
    lock = threading.Lock()

    def on_output(rank: int, stream: str, line: str) -> None:
        with lock:
            seen.append((rank, stream, line))

    show = ("MY_FLAG", "CRF_DILOCO_SECRET", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "HOME_DIR")
    results = run_replicas(
        executor,
        behave(*[a for name in show for a in ("--show-env", name)], "--lines", "2", "--lr", "0.1"),
        world_size=3,
        uri="s3://bucket/runs",
        run_id="hf-run",
        env={"MY_FLAG": "on", "DB_PASSWORD": "db-password-31337", "HOME_DIR": "/data"},
        on_output=on_output,
        timeout=120,
    )
    assert [r.rank for r in results] == [0, 1, 2]
    assert all(r.ok and r.returncode == 0 for r in results), [r.describe() for r in results]
    for rank, result in enumerate(results):
        record = first_json_line(result)
        assert (record["rank"], record["world_size"], record["uri"], record["run_id"]) == (
            rank,
            3,
            "s3://bucket/runs",
            "hf-run",
        )
        assert record["extra_argv"] == ["--lr", "0.1"]
        assert record["env"] == {
            "MY_FLAG": "on",
            "CRF_DILOCO_SECRET": "***",  # the job had the value (below); what came back is masked
            "AWS_SECRET_ACCESS_KEY": "***",
            "DB_PASSWORD": "***",
            "HOME_DIR": "/data",
        }
        lines = [line for r, s, line in seen if r == rank]
        assert {s for r, s, _ in seen if r == rank} == {"stdout"}  # Jobs merge the streams into one log
        assert lines[1:] == [f"stderr line of rank {rank}", f"line 0 of rank {rank}", f"line 1 of rank {rank}"]
    jobs = jobs_server.jobs()
    assert len(jobs) == 3
    for rank, job in enumerate(jobs):
        spec = job["spec"]
        assert spec["dockerImage"] == DEFAULT_IMAGE
        assert spec["flavor"] == "cpu-upgrade"
        assert spec["timeoutSeconds"] == 121
        assert spec["labels"] == {
            "team": "crf",
            "name": f"crf-diloco-hf-run-rank{rank}",
            LABEL_RUN_ID: "hf-run",
            LABEL_RANK: str(rank),
        }
        assert spec["command"] == behave(
            *[a for name in show for a in ("--show-env", name)], "--lines", "2", "--lr", "0.1"
        )
        assert spec["environment"] == {
            "PYTHONUNBUFFERED": "1",
            "MY_FLAG": "on",
            "HOME_DIR": "/data",
            "CRF_DILOCO_RANK": str(rank),
            "CRF_DILOCO_WORLD_SIZE": "3",
            "CRF_DILOCO_URI": "s3://bucket/runs",
            "CRF_DILOCO_RUN_ID": "hf-run",
        }
        assert spec["secrets"] == {
            "CRF_DILOCO_SECRET": RUN_SECRET,
            "AWS_SECRET_ACCESS_KEY": "aws-secret-9d8c7b6a5f4e",
            "DB_PASSWORD": "db-password-31337",
        }
        assert RUN_SECRET in job["log"][1]  # the job itself saw the real value
    handles_text = repr(executor) + repr(results)
    for value in (RUN_SECRET, "aws-secret-9d8c7b6a5f4e", "db-password-31337", TOKEN):
        assert value not in handles_text
        assert all(value not in line for _, _, line in seen)


def test_hf_jobs_a_killed_job_is_reported_and_the_others_are_cancelled(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor]
) -> None:
    executor = make_executor()
    handles = executor.launch_replicas(behave("--sleep", "120"), world_size=3, uri="memory://hf-kill")
    assert [h.rank for h in handles] == [0, 1, 2]
    assert handles[1].url.endswith(f"/jobs/{USER}/{handles[1].job_id}")
    jobs = jobs_server.wait_for(lambda jobs: all(j["stage"] == "RUNNING" and len(j["log"]) > 2 for j in jobs))
    jobs_server.kill(handles[1].job_id)  # SIGKILL: an OOM kill or a lost machine
    start = time.monotonic()
    results = executor.collect(handles, timeout=120)
    assert time.monotonic() - start < 60
    killed = results[1]
    assert not killed.ok
    assert killed.returncode is None
    assert not killed.timed_out
    assert killed.error == f"job {handles[1].job_id} failed (stage ERROR): Job failed with exit code: 137"
    assert "stderr line of rank 1" in killed.stderr_tail  # the log up to the kill came back
    for rank in (0, 2):
        assert results[rank].error == (
            f"cancelled after rank 1 failed; job {handles[rank].job_id} was cancelled (stage CANCELED)"
        )
    jobs = jobs_server.wait_for(lambda jobs: [j["stage"] for j in jobs] == ["CANCELED", "ERROR", "CANCELED"])
    for job in jobs:
        with pytest.raises(ProcessLookupError):
            os.kill(job["pid"], 0)


def test_hf_jobs_without_cancel_on_failure_the_survivors_finish(make_executor: Callable[..., HFJobsExecutor]) -> None:
    executor = make_executor(cancel_on_failure=False)
    results = run_replicas(
        executor,
        behave("--fail-rank", "1", "--fail-stderr", "loss is NaN", "--fail-exit", "3", "--sleep", "1"),
        world_size=3,
        uri="memory://hf-survive",
        timeout=120,
    )
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].error is not None
    assert results[1].error.endswith("Job failed with exit code: 3")
    assert results[1].stderr_tail.splitlines()[-1] == "loss is NaN"


def test_hf_jobs_timeout_cancels_the_late_jobs(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor]
) -> None:
    executor = make_executor()
    handles = executor.launch_replicas(
        behave("--fail-rank", "1", "--fail-sleep", "120"), world_size=2, uri="memory://x"
    )
    results = executor.collect(handles, timeout=4)
    assert results[0].ok
    late = results[1]
    assert late.timed_out
    assert late.returncode is None
    assert late.error == f"timed out after 4 s; job {handles[1].job_id} was cancelled (stage CANCELED)"
    assert "stderr line of rank 1" in late.stdout_tail
    assert [j["stage"] for j in jobs_server.jobs()] == ["COMPLETED", "CANCELED"]


def test_hf_jobs_terminate_cancels_every_job(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor]
) -> None:
    executor = make_executor()
    handles = executor.launch_replicas(behave("--sleep", "120"), world_size=2, uri="memory://x")
    jobs_server.wait_for(lambda jobs: all(j["stage"] == "RUNNING" for j in jobs))
    executor.terminate(handles)
    executor.terminate(handles)  # idempotent
    results = executor.collect(handles, timeout=60)
    assert all(not r.ok and r.error and "was cancelled (stage CANCELED)" in r.error for r in results)
    assert [j["stage"] for j in jobs_server.jobs()] == ["CANCELED", "CANCELED"]


def test_hf_jobs_uv_script_runs_through_run_uv_job(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor], tmp_path: Path
) -> None:
    uv = shutil.which("uv")
    if uv is None:
        if os.environ.get("CI") == "true":
            pytest.fail("uv is not on PATH in CI (.ci/run installs it)")
        pytest.skip("uv is not on PATH (pip install uv)")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(TESTS / "replica_scripts"))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    script = f"http://127.0.0.1:{files.server_address[1]}/behave.py"
    try:
        executor = make_executor(uv=True, python=sys.executable, image="ghcr.io/astral-sh/uv:python3.11-bookworm")
        results = run_replicas(executor, [script, "--lines", "1"], world_size=2, uri="memory://uv", timeout=120)
    finally:
        files.shutdown()
    assert all(r.ok for r in results), [(r.describe(), r.stdout_tail) for r in results]
    assert [first_json_line(r)["rank"] for r in results] == [0, 1]
    for job in jobs_server.jobs():
        assert job["spec"]["command"] == ["uv", "run", "--python", sys.executable, script, "--lines", "1"]
        assert job["spec"]["dockerImage"] == "ghcr.io/astral-sh/uv:python3.11-bookworm"


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"flavor": "A100 large"}, ValueError, "flavor must be a hardware name"),
        ({"image": " "}, ValueError, "image must be a Docker image"),
        ({"job_timeout_s": 0}, ValueError, "job_timeout_s must be None"),
        ({"namespace": "../other"}, ValueError, "could escape"),
        ({"dependencies": ["torch"]}, ValueError, "uv scripts only: pass uv=True"),
        ({"uv": True, "dependencies": "torch"}, ValueError, "list of requirement strings"),
        ({"secrets": {"BAD NAME": "x"}}, ValueError, "environment variable names"),
        ({"secrets": {"TOKEN": ""}}, ValueError, "non-empty strings"),
        ({"secret_env": "AWS_SECRET_ACCESS_KEY"}, TypeError, "list of variable names"),
        ({"labels": {"a/b": "c"}}, ValueError, "the Hub refuses the label"),
        ({"poll_interval_s": -1}, ValueError, "poll_interval_s"),
        ({"cancel_on_failure": "yes"}, TypeError, "cancel_on_failure must be a bool"),
        ({"tail_lines": 0}, ValueError, "tail_lines"),
    ],
)
def test_hf_jobs_executor_rejects_bad_settings(options: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        HFJobsExecutor(**options)


def test_hf_jobs_launch_rejects_bad_env_before_submitting(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(ValueError, match=r"not set in this environment: \['NOT_SET_ANYWHERE'\]"):
        make_executor(secret_env=["NOT_SET_ANYWHERE"]).launch_replicas(behave(), world_size=1, uri="memory://x")
    with pytest.raises(ValueError, match="must not set"):
        make_executor(secrets={"CRF_DILOCO_RANK": "7"}).launch_replicas(behave(), world_size=1, uri="memory://x")
    with pytest.raises(ValueError, match="must not set"):
        make_executor().launch_replicas(behave(), world_size=1, uri="memory://x", env={"CRF_DILOCO_URI": "y"})
    assert jobs_server.jobs() == []


# -- adversarial: a server that lies or breaks, secrets that try to leak -------------------------------------------
# 15 attacks or bad inputs, all contained: nothing hangs, nothing leaks, no job is left running.


def test_adversarial_server_lying_running_forever_is_timed_out_and_given_up(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor]
) -> None:
    jobs_server.behave(lie_stage={"1": "RUNNING"})  # rank 1 ends at once, the server keeps saying RUNNING
    executor = make_executor(cancel_grace_s=1.0)
    start = time.monotonic()
    results = run_replicas(executor, behave(), world_size=2, uri="memory://x", timeout=3)
    assert time.monotonic() - start < 30
    assert results[0].ok
    assert results[1].timed_out
    assert results[1].returncode is None
    assert results[1].error == ("timed out after 3 s; the backend did not report an end within 1 s of the cancel")


def test_adversarial_unknown_stage_counts_as_running_until_the_deadline(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor], caplog: pytest.LogCaptureFixture
) -> None:
    jobs_server.behave(lie_stage={"0": "EXPLODED"})
    results = run_replicas(make_executor(cancel_grace_s=1.0), behave(), world_size=1, uri="memory://x", timeout=2)
    assert results[0].timed_out
    assert not results[0].ok
    assert "unknown stage 'EXPLODED'" in caplog.text


def test_adversarial_garbage_status_loses_contact_and_cancels_everything(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor]
) -> None:
    jobs_server.behave(garbage_inspect=[0])  # one listing serves every job's stage: the garbage reaches them all
    executor = make_executor(lost_contact_s=1.0, cancel_grace_s=5.0)
    results = run_replicas(executor, behave("--sleep", "120"), world_size=2, uri="memory://x", timeout=60)
    for result in results:
        assert result.returncode is None
        assert result.error is not None
        assert result.error.startswith("lost contact with the backend for ")
        assert "last error" in result.error
    jobs_server.wait_for(lambda jobs: [j["stage"] for j in jobs] == ["CANCELED", "CANCELED"])


def test_adversarial_transient_server_errors_are_ridden_out(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor]
) -> None:
    jobs_server.behave(flaky_inspect=6)
    results = run_replicas(make_executor(), behave(), world_size=2, uri="memory://x", timeout=60)
    assert all(r.ok for r in results), [r.describe() for r in results]
    # the six failures were really served, and status reads went on (and were answered) after them
    stats = jobs_server.stats()
    assert stats.get("flaky_500") == 6, stats
    assert stats.get("inspect", 0) + stats.get("list", 0) > 6, stats


def test_adversarial_rejected_submission_echoing_secrets_cancels_the_submitted_jobs(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor]
) -> None:
    jobs_server.behave(reject_from=2)  # a 429 whose message repeats the token and the spec, secrets included
    # 429s on a submission are waited out for up to lost_contact_s; 2 s keeps the give-up quick.
    executor = make_executor(secrets={"CRF_DILOCO_SECRET": RUN_SECRET}, lost_contact_s=2.0)
    with pytest.raises(RuntimeError) as info:
        executor.launch_replicas(behave("--sleep", "120"), world_size=3, uri="memory://x")
    message = str(info.value)
    assert re.match(r"submitting the job of rank 2 failed \(\w+: HTTP 429: ", message), message
    assert "Quota exceeded" in message
    assert RUN_SECRET not in message
    assert TOKEN not in message  # the server echoed the Authorization header too
    assert "Quota exceeded for Bearer ***" in message
    assert message.endswith("the 2 job(s) already submitted were cancelled")
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__
    jobs_server.wait_for(lambda jobs: [j["stage"] for j in jobs] == ["CANCELED", "CANCELED"])


def test_adversarial_job_id_that_escapes_the_api_path_is_refused(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor]
) -> None:
    jobs_server.behave(bad_job_id="../../whoami-v2")
    with pytest.raises(RuntimeError, match=r"returned the job id '../../whoami-v2', which is not a plain id"):
        make_executor().launch_replicas(behave(), world_size=2, uri="memory://x")
    assert len(jobs_server.jobs()) == 1  # nothing submitted after the first bad answer


def test_adversarial_server_echoing_secrets_in_job_info_leaks_nothing(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor]
) -> None:
    jobs_server.behave(echo_secrets=True)
    executor = make_executor(secrets={"CRF_DILOCO_SECRET": RUN_SECRET})
    handles = executor.launch_replicas(behave(), world_size=1, uri="memory://x")
    results = executor.collect(handles, timeout=60)
    assert results[0].ok
    assert RUN_SECRET not in repr(handles) + repr(results) + repr(executor)


def test_adversarial_secrets_printed_by_a_replica_are_masked_everywhere(
    make_executor: Callable[..., HFJobsExecutor], tmp_path: Path
) -> None:
    key_file = '{"type": "service_account",\n "private_key": "-----BEGIN KEY-----abcdef0123456789"}'
    script = tmp_path / "leak.py"
    script.write_text(
        "import os, sys\n"
        "print('secret is', os.environ['CRF_DILOCO_SECRET'])\n"
        "print(os.environ['GCP_CREDENTIALS_JSON'])\n"
        "sys.exit('failing with ' + os.environ['CRF_DILOCO_SECRET'])\n"
    )
    seen: list[str] = []
    executor = make_executor(secrets={"CRF_DILOCO_SECRET": RUN_SECRET, "GCP_CREDENTIALS_JSON": key_file})
    (result,) = run_replicas(
        executor,
        ["python", str(script)],
        world_size=1,
        uri="memory://x",
        on_output=lambda r, s, line: seen.append(line),
    )
    assert not result.ok
    text = "\n".join([*seen, result.stdout_tail, result.stderr_tail, result.error or ""])
    assert "secret is ***" in text
    assert "failing with ***" in text
    assert RUN_SECRET not in text
    for line in key_file.splitlines():
        assert line not in text


def test_adversarial_garbage_log_events_do_not_break_collect(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor], caplog: pytest.LogCaptureFixture
) -> None:
    jobs_server.behave(garbage_logs=True)
    results = run_replicas(make_executor(), behave(), world_size=2, uri="memory://x", timeout=60)
    assert all(r.ok for r in results)  # the stage decides; the broken log stream is reported in the log
    assert "log stream of job" in caplog.text


def test_adversarial_wrong_token_or_namespace_submits_nothing(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor]
) -> None:
    with pytest.raises(RuntimeError, match=r"cannot find the Hugging Face user .*HTTP 401"):
        make_executor(token="hf_wrong").launch_replicas(behave(), world_size=2, uri="memory://x")
    with pytest.raises(RuntimeError, match=r"rank 0 failed \(\w+: HTTP 401: "):
        make_executor(token="hf_wrong", namespace=USER).launch_replicas(behave(), world_size=2, uri="memory://x")
    with pytest.raises(RuntimeError, match=r"rank 0 failed \(\w+: HTTP 403: "):
        make_executor(namespace="someone-else").launch_replicas(behave(), world_size=2, uri="memory://x")
    assert jobs_server.jobs() == []


def test_adversarial_unknown_flavor_is_refused_by_the_server(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor]
) -> None:
    with pytest.raises(RuntimeError, match=r"rank 0 failed \(\w+: HTTP 400: (.|\n)*Invalid flavor 'a100-huge'"):
        make_executor(flavor="a100-huge").launch_replicas(behave(), world_size=2, uri="memory://x")
    assert jobs_server.jobs() == []


def test_adversarial_broken_output_callback_does_not_stop_the_run(make_executor: Callable[..., HFJobsExecutor]) -> None:
    def broken(rank: int, stream: str, line: str) -> None:
        raise RuntimeError("callback bug")

    results = run_replicas(make_executor(), behave("--lines", "50"), world_size=2, uri="memory://x", on_output=broken)
    assert all(r.ok for r in results)
    assert results[0].stdout_tail.splitlines()[-1] == "line 49 of rank 0"


# -- the whole chain a user meets: crf-diloco launch --executor hf, HF_ENDPOINT, S3, real DiLoCo --------------------


def test_cli_launch_hf_trains_diloco_through_the_jobs_endpoint_and_s3(
    jobs_server: JobsServer, moto_s3: dict[str, Any], tmp_path: Path, diloco_replicas_agree: Any
) -> None:
    """CLI → HFJobsExecutor → huggingface_hub → jobs endpoint → 2 jobs running the shipped script → s3fs → moto.

    The script travels inside the job command; the S3 secret key travels as a job secret (``--secret``); both
    replicas train a model with torchft's DiLoCo and end with bit-identical weights.
    """
    out = tmp_path / "out"
    out.mkdir()
    s3_secret = "s3-secret-key-71c4e9b0d2"
    env = {
        **os.environ,
        "HF_ENDPOINT": jobs_server.url,
        "HF_TOKEN": TOKEN,
        "AWS_SECRET_ACCESS_KEY": s3_secret,
    }
    proc = subprocess.run(
        [
            sys.executable, "-m", "crf_diloco", "launch", "--executor", "hf", "--no-pip", "--replicas", "2",
            "--uri", f"s3://{moto_s3['bucket']}/hf-diloco", "--run-id", "hf-e2e", "--timeout", "400",
            "--env", f"AWS_ENDPOINT_URL={moto_s3['endpoint']}", "--env", "AWS_ACCESS_KEY_ID=crf-key-id",
            "--env", "AWS_DEFAULT_REGION=us-east-1", "--secret", "AWS_SECRET_ACCESS_KEY", "--hf-flavor", "cpu-upgrade",
            str(TESTS / "replica_scripts" / "diloco_replica.py"), "--out", str(out), "--steps", "12", "--sync-every", "4",
        ],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=480,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "crf-diloco: run hf-e2e: 2 of 2 replicas succeeded" in proc.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank}: 3 outer steps" in proc.stdout
    diloco_replicas_agree(out, world_size=2, outer_steps=3)
    jobs = jobs_server.jobs()
    assert [j["stage"] for j in jobs] == ["COMPLETED", "COMPLETED"]
    for job in jobs:
        spec = job["spec"]
        assert spec["command"][:2] == ["python", "-c"]  # the script was shipped, not referenced by a local path
        assert str(TESTS) not in json.dumps(spec["command"])
        # the store credentials and the per-run key `crf-diloco launch` generated travel as job secrets only
        run_secret = spec["secrets"].pop("CRF_DILOCO_SECRET")
        assert len(run_secret) >= 32
        assert spec["secrets"] == {"AWS_SECRET_ACCESS_KEY": s3_secret, "AWS_ACCESS_KEY_ID": "crf-key-id"}
        assert run_secret not in json.dumps(spec["environment"]) + proc.stdout + proc.stderr
        assert s3_secret not in json.dumps(spec["environment"])
        assert spec["environment"]["AWS_ENDPOINT_URL"] == moto_s3["endpoint"]
        assert spec["timeoutSeconds"] == 400
    assert s3_secret not in proc.stdout + proc.stderr


# -- within the Hub's rules: rate limits, labels ------------------------------------------------------------------


def test_hf_jobs_a_rate_limited_run_of_8_replicas_completes_with_every_log_line(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor]
) -> None:
    """The old executor read each job's stage every poll: 8 jobs at 0.1 s = 80 requests/s, cancelled as 'lost'."""
    jobs_server.behave(rate_limit=[12, 2])  # 12 requests per 2 s for everything: submissions, listings, log streams
    lines: dict[int, list[str]] = {}
    executor = make_executor(lost_contact_s=5.0)  # 429s must not count as lost contact, however long they last
    results = run_replicas(
        executor,
        behave("--lines", "3", "--sleep", "3"),
        world_size=8,
        uri="memory://x",
        timeout=240,
        on_output=lambda rank, stream, line: lines.setdefault(rank, []).append(line),
    )
    assert all(r.ok for r in results), [r.describe() for r in results]
    stats = jobs_server.stats()
    assert stats.get("429", 0) > 0  # the limit was hit, and ridden out
    assert stats.get("inspect", 0) <= 2 * 8  # stages come from listings (the client's log stream inspects at its end)
    assert stats.get("cancel", 0) == 0
    for rank in range(8):
        body = sorted(line for line in lines[rank] if not line.startswith("{"))  # one merged log: order may vary
        assert body == sorted([f"stderr line of rank {rank}", *(f"line {i} of rank {rank}" for i in range(3))])
    assert [j["stage"] for j in jobs_server.jobs()] == ["COMPLETED"] * 8


def test_hf_jobs_a_log_stream_cut_by_429s_resumes_without_repeating_lines(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor]
) -> None:
    jobs_server.behave(rate_limit=[4, 3])  # the log stream's own job-status checks and reopenings hit the limit
    lines: list[str] = []
    results = run_replicas(
        make_executor(poll_interval_s=1.0, lost_contact_s=5.0),
        behave("--lines", "20", "--sleep", "2"),
        world_size=1,
        uri="memory://x",
        timeout=240,
        on_output=lambda rank, stream, line: lines.append(line),
    )
    assert results[0].ok, results[0].describe()
    numbered = [line for line in lines if line.startswith("line ")]
    assert numbered == [f"line {i} of rank 0" for i in range(20)]  # each once, in order
    assert jobs_server.stats().get("429", 0) > 0


@pytest.mark.parametrize(
    ("options", "run_id"),
    [
        ({}, "run.with.dots"),  # the run id becomes the job name and a label
        ({"labels": {"team": "ml", "name": "my-job"}}, "v1.2-run"),
    ],
)
def test_hf_jobs_a_run_id_the_hub_refuses_as_a_label_is_refused_before_any_job_starts(
    jobs_server: JobsServer, make_executor: Callable[..., HFJobsExecutor], options: dict[str, Any], run_id: str
) -> None:
    with pytest.raises(ValueError, match=r"the Hub refuses the label .*no '\.'"):
        make_executor(**options).launch_replicas(behave(), world_size=3, uri="memory://x", run_id=run_id)
    assert jobs_server.jobs() == []


@pytest.mark.parametrize(
    "labels", [{"team.name": "ml"}, {"team": "ml.v2"}, {"": "x"}, {"team": "a b"}, {"team": "a/b"}]
)
def test_hf_jobs_labels_the_hub_refuses_are_refused_by_the_executor(labels: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="the Hub refuses the label"):
        HFJobsExecutor(labels=labels, token=TOKEN, endpoint="http://127.0.0.1:9")


def test_hf_jobs_server_refuses_what_the_hub_refuses(jobs_server: JobsServer) -> None:
    """The stand-in is only worth its tests if it refuses what the Hub does: bad labels, flavours, timeouts."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=jobs_server.url, token=TOKEN)
    for bad in ({"labels": {"a.b": "c"}}, {"flavor": "a100-huge"}, {"timeout": 0.5}):
        with pytest.raises(HfHubHTTPError) as info:
            api.run_job(image="python:3.12", command=["true"], namespace=USER, **bad)
        assert info.value.response.status_code == 400
    info = api.run_job(image="python:3.12", command=["true"], namespace=USER, flavor="rtx-pro-6000")
    assert info.flavor == "rtx-pro-6000"  # a flavour huggingface_hub 2.4 knows
    jobs_server.behave(rate_limit=[1, 60])
    api.whoami()
    with pytest.raises(HfHubHTTPError) as limited:
        api.inspect_job(job_id=info.id, namespace=USER)
    assert limited.value.response.status_code == 429
    assert 1 <= int(limited.value.response.headers["Retry-After"]) <= 60


def test_cli_launch_hf_before_a_release_ships_the_workspace_wheel_and_the_job_installs_it(
    jobs_server: JobsServer, tmp_path: Path
) -> None:
    """The documented ``crf-diloco launch --executor hf`` with the default ``--pip``, while crf-diloco is on no index.

    The launcher asks the index (a 127.0.0.1 one that lacks crf-diloco), builds this checkout's wheel, packs it into
    the job command; the job's ``uv run --with crf-diloco==<version>`` installs that wheel (its dependencies from
    uv's cache: ``UV_OFFLINE=1``, nothing leaves this machine) and the shipped script imports it.
    """
    if shutil.which("uv") is None:
        pytest.skip("uv is not on PATH (pip install uv)")
    from crf_diloco import __version__
    from crf_diloco.executors.wheels import source_tree

    if source_tree() is None:
        pytest.skip("crf-diloco is installed from a wheel here (nox -s wheels), not a checkout to build one from")

    index = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # 501 to all
    threading.Thread(target=index.serve_forever, daemon=True).start()
    script = tmp_path / "which_crf.py"
    script.write_text(
        "import os, sys, crf_diloco\n"
        "print('crf-diloco', crf_diloco.__version__, 'from', os.path.dirname(crf_diloco.__file__), sys.prefix)\n"
    )
    env = {
        **os.environ,
        "HF_ENDPOINT": jobs_server.url,
        "HF_TOKEN": TOKEN,
        "CRF_DILOCO_INDEX_URL": f"http://127.0.0.1:{index.server_address[1]}/simple",
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "crf_diloco", "launch", "--executor", "hf", "--replicas", "2", "--uri",
             "memory://wheel", "--run-id", "wheel-run", "--timeout", "300", "--env", "UV_OFFLINE=1", str(script)],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=360,
        )  # fmt: skip
    finally:
        index.shutdown()
    if proc.returncode != 0 and "offline" in proc.stdout.lower():
        pytest.skip(f"uv's cache lacks crf-diloco's dependencies for an offline install: {proc.stdout[-500:]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the replicas get this checkout's wheel (uv build)" in proc.stderr
    src = str(Path(__file__).parents[1] / "src")
    if any(x.endswith(f" {sys.prefix}") for x in proc.stdout.splitlines()):
        pytest.skip(
            "the job's `uv run` reused this test's own virtual environment (its python comes first on PATH, as "
            "under nox), which already holds crf-diloco, so it never installs the shipped wheel; run this test "
            "from an interpreter outside a virtual environment to check the wheel path"
        )
    for rank in (0, 1):
        (line,) = [x for x in proc.stdout.splitlines() if x.startswith(f"[rank {rank}] crf-diloco ")]
        assert line.startswith(f"[rank {rank}] crf-diloco {__version__} from ")
        assert src not in line  # installed into the job's environment from the shipped wheel, not this checkout
    for job in jobs_server.jobs():
        command = job["spec"]["command"]
        assert command[:2] == ["python", "-c"]
        assert command[3] == f"crf_diloco-{__version__}-py3-none-any.whl"
        rest = command[command.index("--") + 1 :]
        assert rest[:6] == ["uv", "run", "--no-project", "--with", f"crf-diloco=={__version__}", "--"]
