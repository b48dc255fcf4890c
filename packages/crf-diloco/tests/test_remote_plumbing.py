"""What the cloud executors share, without any SDK: the secret split and masking, the wait loop, script shipping."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crf_diloco.executors import script_command
from crf_diloco.executors._remote import (
    ReplicaSecrets,
    WaitPolicy,
    looks_secret,
    split_replica_env,
    wait_for_replicas,
)
from crf_diloco.executors.base import ReplicaResult
from crf_diloco.executors.script import MAX_PAYLOAD_BYTES


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("CRF_DILOCO_SECRET", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("AWS_ACCESS_KEY_ID", True),
        ("AWS_SESSION_TOKEN", True),
        ("HF_TOKEN", True),
        ("AZURE_STORAGE_CONNECTION_STRING", True),
        ("AZURE_STORAGE_ACCOUNT_KEY", True),
        ("OPENAI_API_KEY", True),
        ("DB_PASSWORD", True),
        ("AWS_ENDPOINT_URL", False),
        ("AWS_DEFAULT_REGION", False),
        ("HF_HOME", False),
        ("CRF_DILOCO_URI", False),
    ],
)
def test_looks_secret(name: str, secret: bool) -> None:
    assert looks_secret(name) is secret


def test_split_sends_credentials_declared_and_per_run_secrets_as_secrets() -> None:
    environ = {"CRF_DILOCO_SECRET": "run-key-123456", "AWS_SECRET_ACCESS_KEY": "aws-abcdef", "OTHER": "x"}
    plain, secrets = split_replica_env(
        {"LR": "0.1", "HF_TOKEN": "hf_abcdef"},
        secrets={"EXTRA": "extra-value"},
        secret_env=["AWS_SECRET_ACCESS_KEY"],
        environ=environ,
    )
    assert plain == {"LR": "0.1"}
    assert secrets.values == {
        "HF_TOKEN": "hf_abcdef",
        "AWS_SECRET_ACCESS_KEY": "aws-abcdef",
        "EXTRA": "extra-value",
        "CRF_DILOCO_SECRET": "run-key-123456",  # forwarded: a remote replica does not inherit the launcher's env
    }
    assert repr(secrets) == "ReplicaSecrets(names=['AWS_SECRET_ACCESS_KEY', 'CRF_DILOCO_SECRET', 'EXTRA', 'HF_TOKEN'])"
    # a per-run secret given in env wins over the launcher's environment
    _, secrets = split_replica_env({"CRF_DILOCO_SECRET": "given"}, secrets={}, secret_env=[], environ=environ)
    assert secrets.values == {"CRF_DILOCO_SECRET": "given"}


@pytest.mark.parametrize(
    ("env", "secrets", "secret_env", "error", "match"),
    [
        ({"BAD-NAME": "x"}, {}, [], ValueError, "environment variable names"),
        ({"A": 1}, {}, [], TypeError, "env values must be strings"),
        ({}, {}, ["MISSING_VAR"], ValueError, r"not set in this environment: \['MISSING_VAR'\]"),
        ({}, {"CRF_DILOCO_RANK": "1"}, [], ValueError, "secrets must not set"),
        ({"API_KEY": ""}, {}, [], ValueError, "must not be empty"),
    ],
)
def test_split_rejects_bad_input(
    env: dict, secrets: dict, secret_env: list[str], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        split_replica_env(env, secrets=secrets, secret_env=secret_env, environ={})


def test_redaction_masks_values_lines_of_multiline_values_and_overlaps() -> None:
    secrets = ReplicaSecrets(
        {"A": "abcd1234", "B": "abcd12345678", "KEY": "-----BEGIN-----\nMIIEvQIBADAN\nxy", "SHORT": "ab"}
    )
    assert secrets.redact("x abcd12345678 y abcd1234") == "x *** y ***"  # the longer value first
    assert secrets.redact("MIIEvQIBADAN") == "***"  # one line of a multi-line value
    assert secrets.redact("ab xy") == "ab xy"  # too short to mask without masking ordinary text
    assert ReplicaSecrets().redact("anything") == "anything"


class Scripted:
    """A `RemoteReplica` that ends after ``polls`` polls with ``result``, or never (``polls=None``)."""

    def __init__(self, rank: int, polls: int | None, ok: bool = True, raises: int = 0, ends_on_cancel: bool = True):
        self.rank = rank
        self.polls = polls
        self.ok = ok
        self.raises = raises
        self.ends_on_cancel = ends_on_cancel
        self.cancel_requested = False
        self.seen = 0

    def poll(self) -> ReplicaResult | None:
        self.seen += 1
        if self.raises:
            self.raises -= 1
            raise ConnectionError("backend unreachable")
        if self.cancel_requested and self.ends_on_cancel:
            return ReplicaResult(self.rank, None, 0.1, error="stopped by the backend")
        if self.polls is not None and self.seen > self.polls:
            return ReplicaResult(self.rank, 0 if self.ok else 3, 0.1)
        return None

    def cancel(self) -> None:
        self.cancel_requested = True


FAST = WaitPolicy(poll_interval_s=0.01, cancel_grace_s=0.2, lost_contact_s=0.2)


def test_wait_cancels_the_others_when_one_fails() -> None:
    replicas = [Scripted(0, None), Scripted(1, 2, ok=False), Scripted(2, 50)]
    results = wait_for_replicas(replicas, timeout=30, policy=FAST, redact=str)
    assert results[1].returncode == 3
    assert results[0].error == "cancelled after rank 1 failed; stopped by the backend"
    assert results[2].error == "cancelled after rank 1 failed; stopped by the backend"


def test_wait_without_cancel_on_failure_lets_survivors_finish() -> None:
    replicas = [Scripted(0, 5), Scripted(1, 1, ok=False)]
    policy = WaitPolicy(poll_interval_s=0.01, cancel_on_failure=False)
    results = wait_for_replicas(replicas, timeout=30, policy=policy, redact=str)
    assert [r.ok for r in results] == [True, False]
    assert not replicas[0].cancel_requested


def test_wait_deadline_and_a_backend_that_ignores_the_cancel() -> None:
    replicas = [Scripted(0, 1), Scripted(1, None, ends_on_cancel=False)]
    start = time.monotonic()
    results = wait_for_replicas(replicas, timeout=0.3, policy=FAST, redact=str)
    assert time.monotonic() - start < 5
    assert results[0].ok
    assert results[1].timed_out
    assert results[1].error == ("timed out after 0.3 s; the backend did not report an end within 0.2 s of the cancel")


def test_wait_rides_out_short_outages_and_gives_up_on_long_ones() -> None:
    results = wait_for_replicas(
        [Scripted(0, 1, raises=3)], timeout=30, policy=WaitPolicy(0.01, lost_contact_s=5.0), redact=str
    )
    assert results[0].ok
    lost = Scripted(0, None, raises=10**6)
    results = wait_for_replicas(
        [lost, Scripted(1, None)], timeout=30, policy=FAST, redact=lambda t: t.replace("unreachable", "***")
    )
    assert results[0].error is not None
    assert results[0].error.startswith(
        "lost contact with the backend for 0.2 s (last error ConnectionError: backend ***)"
    )
    assert lost.cancel_requested
    assert results[1].error == "cancelled after rank 0 failed; stopped by the backend"


def test_wait_gives_up_on_a_replica_terminate_cancelled_that_never_ends() -> None:
    stuck = Scripted(0, None, ends_on_cancel=False)
    stuck.cancel()  # terminate() ran before collect
    start = time.monotonic()
    results = wait_for_replicas([stuck], timeout=None, policy=FAST, redact=str)
    assert time.monotonic() - start < 5
    assert results[0].error == (
        "cancelled by terminate(); the backend did not report an end within 0.2 s of the cancel"
    )


def test_wait_keeps_a_replica_that_succeeded_before_the_cancel_landed() -> None:
    class FinishesAnyway(Scripted):
        def poll(self) -> ReplicaResult | None:
            return ReplicaResult(self.rank, 0, 0.1) if self.cancel_requested else None

    results = wait_for_replicas([FinishesAnyway(0, None)], timeout=0.1, policy=FAST, redact=str)
    assert results[0].ok


def test_wait_policy_validation() -> None:
    with pytest.raises(ValueError, match="poll_interval_s"):
        WaitPolicy(poll_interval_s=0)
    with pytest.raises(ValueError, match="lost_contact_s"):
        WaitPolicy(lost_contact_s=float("inf"))


def test_script_command_runs_the_script_like_python_script_py(tmp_path: Path) -> None:
    script = tmp_path / "train me.py"
    script.write_text(
        "import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'file': os.path.basename(__file__), 'name': __name__, 'é': 'ü'}))\n"
    )
    command = script_command(script, ["--lr", "3e-4", "two words"], python=sys.executable)
    assert command[:2] == [sys.executable, "-c"]
    assert str(tmp_path) not in json.dumps(command)  # the file travels, not its path
    out = subprocess.run(command, cwd="/", capture_output=True, text=True, check=True, timeout=60).stdout
    assert json.loads(out) == {
        "argv": ["--lr", "3e-4", "two words"],
        "file": "train me.py",
        "name": "__main__",
        "é": "ü",
    }


def test_script_command_refuses_what_cannot_travel(tmp_path: Path) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        script_command(binary)
    big = tmp_path / "big.py"
    big.write_text("".join(f"x{i} = {i * 7919 % 1000003!r}  # {i:x}\n" for i in range(60000)))
    with pytest.raises(ValueError, match=rf"more than the {MAX_PAYLOAD_BYTES // 1024} KiB"):
        script_command(big)
    with pytest.raises(FileNotFoundError):
        script_command(tmp_path / "missing.py")
    with pytest.raises(TypeError, match="list of strings"):
        script_command(big, "--lr 1")  # type: ignore[arg-type]
