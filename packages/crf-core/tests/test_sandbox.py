"""run_python: what a program sees and gets back, under bubblewrap and rlimits-only; refusal and validation."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

import crf_core.rewards.sandbox as sandbox_module
from crf_core.rewards import SandboxUnavailableError, bubblewrap_problem, bubblewrap_usable, run_python


@pytest.fixture(params=["bwrap", "rlimits"])
def isolation(request: pytest.FixtureRequest) -> str:
    """Each isolation level; the bubblewrap one needs bubblewrap (see the ``bwrap`` fixture)."""
    if request.param == "bwrap":
        request.getfixturevalue("bwrap")
    return str(request.param)


@pytest.fixture(autouse=True)
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the sandbox's host temporary files at an empty folder, to check nothing is left there."""
    folder = tmp_path / "host-tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_runs_in_another_process_and_captures_output(isolation: str, private_tmp: Path) -> None:
    result = run_python(
        "import os, sys\nprint(os.getpid())\nprint('err', file=sys.stderr)\nprint(sys.stdin.read())",
        stdin="hello",
        isolation=isolation,  # type: ignore[arg-type]
    )
    assert result.ok, result
    assert result.returncode == 0
    assert result.isolation == isolation
    lines = result.stdout.split()
    assert int(lines[0]) != os.getpid()
    assert lines[1] == "hello"
    assert result.stderr.strip() == "err"
    assert list(private_tmp.iterdir()) == []


def test_environment_is_cleared(isolation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leak")
    monkeypatch.setenv("HF_TOKEN", "hf_should_not_leak")
    result = run_python(
        "import os\nprint(sorted(os.environ))",
        extra_env={"GIVEN": "1"},
        isolation=isolation,  # type: ignore[arg-type]
    )
    names = set(eval(result.stdout))  # a list of names printed by the program above
    assert names <= {"PATH", "HOME", "TMPDIR", "LANG", "PWD", "GIVEN"}
    assert "GIVEN" in names
    assert "sk-should-not-leak" not in result.stdout


def test_hanging_program_is_killed_at_the_time_limit(isolation: str) -> None:
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.0, isolation=isolation)  # type: ignore[arg-type]
    assert time.monotonic() - start < 30.0  # the program never ends: any bound proves the kill (margin for load)
    assert result.timed_out
    assert not result.ok
    assert result.returncode is None
    assert "Timed out" in result.describe()


def test_memory_limit_stops_a_large_allocation(isolation: str) -> None:
    result = run_python(
        "x = bytearray(2 * 1024**3)\nprint('allocated')",
        memory_mb=256,
        isolation=isolation,  # type: ignore[arg-type]
    )
    assert not result.ok
    assert "allocated" not in result.stdout
    assert "MemoryError" in result.stderr


def test_crash_reports_the_traceback(isolation: str) -> None:
    result = run_python("raise RuntimeError('boom')", isolation=isolation)  # type: ignore[arg-type]
    assert result.returncode == 1
    assert not result.ok
    assert "RuntimeError: boom" in result.describe()
    assert "main.py" in result.stderr


def test_signal_death_is_reported_as_a_negative_status(isolation: str) -> None:
    result = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", isolation=isolation)  # type: ignore[arg-type]
    assert result.returncode == -11
    assert "SIGSEGV" in result.describe()


def test_stderr_has_its_own_bound(isolation: str) -> None:
    program = "import sys\nprint('o' * 1000)\nsys.stderr.write('e' * 100000)"
    result = run_python(program, max_stderr_chars=50, isolation=isolation)  # type: ignore[arg-type]
    assert result.ok
    assert result.stdout.strip() == "o" * 1000
    assert result.stderr.startswith("e" * 50)
    assert "truncated" in result.stderr
    assert len(result.stderr) < 200


def test_output_is_truncated(isolation: str) -> None:
    result = run_python("print('x' * 100000)", max_output_chars=50, isolation=isolation)  # type: ignore[arg-type]
    assert result.ok
    assert len(result.stdout) < 200
    assert "truncated" in result.stdout


@pytest.mark.usefixtures("bwrap")
def test_bubblewrap_layout_read_only_root_private_tmp_no_capabilities() -> None:
    program = """
import os
print(os.getcwd(), os.environ["HOME"])
print(open("/proc/self/status").read().split("CapEff:")[1].split()[0])
for path in ("/x", "/usr/x", "/dev/x", "/etc/x"):
    try:
        open(path, "w").close()
        print("WROTE", path)
    except OSError:
        pass
open("/tmp/scratch", "w").write("ok")
open("/dev/shm/x", "w").write("ok")  # a private /dev/shm (multiprocessing's semaphores), gone with the sandbox
print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
"""
    result = run_python(program)
    assert result.ok, result
    cwd_home, caps, pids = result.stdout.splitlines()
    assert cwd_home == "/tmp /tmp"
    assert int(caps, 16) == 0
    assert "WROTE" not in result.stdout
    assert max(eval(pids)) < 10  # its own pid namespace: bubblewrap's init and the program


def test_bubblewrap_usable_agrees_with_bubblewrap_problem() -> None:
    assert bubblewrap_usable() is (bubblewrap_problem() is None)


def test_refuses_without_bubblewrap_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_module, "find_bwrap", lambda: None)
    assert bubblewrap_usable() is False
    assert "bubblewrap" in (bubblewrap_problem() or "")
    with pytest.raises(SandboxUnavailableError, match=r"apt-get install bubblewrap.*isolation='rlimits'"):
        run_python("print(1)")
    assert run_python("print(1)", isolation="rlimits").stdout == "1\n"  # the explicit opt-in still works


def test_rlimits_opt_in_warns_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sandbox_module, "_warned", sandbox_module.threading.Event())
    with caplog.at_level(logging.WARNING, logger="crf_core.rewards.sandbox"):
        run_python("pass", isolation="rlimits")
        run_python("pass", isolation="rlimits")
    warnings = [r for r in caplog.records if "isolation='rlimits'" in r.getMessage()]
    assert len(warnings) == 1
    assert "bubblewrap" in warnings[0].getMessage()


def test_rlimits_working_directory_is_removed(private_tmp: Path) -> None:
    result = run_python("import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())", isolation="rlimits")
    workdir = Path(result.stdout.strip())
    assert workdir.name.startswith("crf-sandbox-")
    assert workdir.parent == private_tmp
    assert not workdir.exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"memory_mb": 10}, "memory_mb"),
        ({"max_output_chars": -1}, "max_output_chars"),
        ({"max_processes": 0}, "max_processes"),
        ({"max_open_files": 3}, "max_open_files"),
        ({"tmp_mb": 0}, "tmp_mb"),
        ({"max_stderr_chars": 0}, "max_stderr_chars"),
        ({"isolation": "docker"}, "isolation"),
    ],
)
def test_bad_limits_are_rejected(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_python("pass", **kwargs)


def test_bad_argument_types_are_rejected() -> None:
    with pytest.raises(TypeError, match="code"):
        run_python(b"pass")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stdin"):
        run_python("pass", stdin=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="extra_env"):
        run_python("pass", extra_env={"A": 1})  # type: ignore[dict-item]
