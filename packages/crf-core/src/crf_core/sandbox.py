"""Run untrusted generated Python in a separate, limited process.

Every call starts a fresh interpreter (never the trainer's process) in isolated mode (``-I``: no
user site, no ``PYTHON*`` variables, no script directory on ``sys.path``) with:

* a **time limit**: wall clock ``timeout_s`` (the whole process group is killed) plus an
  ``RLIMIT_CPU`` backstop;
* a **memory limit**: ``RLIMIT_AS`` = ``memory_mb`` (allocation fails with ``MemoryError``);
* an **output limit**: stdout/stderr go to files capped by ``RLIMIT_FSIZE`` and are read back
  truncated to ``max_output_chars``;
* a **temporary working directory**, deleted afterwards, which is also ``HOME`` and ``TMPDIR``;
* a **scrubbed environment**: only ``PATH``, ``LANG``, ``LC_ALL``, ``HOME``, ``TMPDIR`` and
  ``PYTHONIOENCODING`` (plus ``extra_env``); nothing is inherited, so no API keys or tokens leak.

The limits are set by a small bootstrap inside the child before the untrusted file runs
(``resource.setrlimit``), not by ``preexec_fn``, so it is safe to call from several threads.
Limits need a POSIX system; where a limit is unsupported the call still runs with the others.
This is process isolation, not a security boundary against a determined attacker (no seccomp,
namespaces or network isolation); run the trainer in a container for that.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SandboxResult", "run_python"]

_BOOTSTRAP = """
import resource, runpy, sys
def _limit(name, value):
    res = getattr(resource, name, None)
    if res is None:
        return
    try:
        resource.setrlimit(res, (value, value))
    except (ValueError, OSError):
        pass
_limit("RLIMIT_AS", int(sys.argv[1]))
_limit("RLIMIT_CPU", int(sys.argv[2]))
_limit("RLIMIT_FSIZE", int(sys.argv[3]))
_limit("RLIMIT_CORE", 0)
script = sys.argv[4]
sys.argv = [script]
runpy.run_path(script, run_name="__main__")
"""

_SAFE_ENV_KEYS = ("LANG", "LC_ALL")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        returncode: the child's exit status (negative = killed by that signal); ``None`` if it was
            killed for exceeding the wall-clock limit.
        timed_out: the wall-clock limit was hit.
        stdout, stderr: captured output, each truncated to ``max_output_chars``.
        duration_s: wall-clock seconds.
    """

    returncode: int | None
    timed_out: bool
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        """Exited normally with status 0 within the time limit."""
        return not self.timed_out and self.returncode == 0

    def describe(self) -> str:
        """A one-paragraph account of a failed run (for feedback): timeout, signal or stderr tail."""
        if self.timed_out:
            return f"Timed out: the program did not finish within the time limit ({self.duration_s:.1f} s)."
        if self.returncode is not None and self.returncode < 0:
            name = signal.Signals(-self.returncode).name if -self.returncode in signal.valid_signals() else "?"
            return f"Killed by signal {name} (a resource limit was exceeded or the program crashed)."
        tail = self.stderr.strip() or self.stdout.strip()
        return tail if tail else f"Exited with status {self.returncode} and no output."


def _read_capped(path: Path, limit: int) -> str:
    with open(path, "rb") as fh:
        data = fh.read(limit * 4 + 4)
    text = data.decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[:limit] + "\n[... output truncated ...]"


def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_chars: int = 4000,
    max_file_mb: int = 16,
    python: str | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a separate limited interpreter and capture its output.

    Args:
        code: Python source to run (untrusted).
        stdin: text fed to the child's standard input.
        timeout_s: wall-clock limit in seconds (> 0); the child's process group is killed after it.
        memory_mb: address-space limit of the child in MiB (≥ 64).
        max_output_chars: characters kept from each of stdout and stderr (> 0).
        max_file_mb: largest file the child may write, output files included (> 0).
        python: interpreter to run; defaults to ``sys.executable``.
        extra_env: variables to add to the scrubbed environment (nothing else is inherited).

    Returns:
        ``SandboxResult``. Never raises for anything the child does (crash, hang, memory blow-up).
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str of Python source, got {type(code).__name__}")
    if not isinstance(stdin, str):
        raise TypeError(f"stdin must be a str, got {type(stdin).__name__}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if not (isinstance(memory_mb, int) and memory_mb >= 64):
        raise ValueError(f"memory_mb must be an int ≥ 64 (the interpreter itself needs ~30 MiB), got {memory_mb!r}")
    for name, value in (("max_output_chars", max_output_chars), ("max_file_mb", max_file_mb)):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if extra_env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in extra_env.items()):
        raise TypeError("extra_env must map str to str")

    with tempfile.TemporaryDirectory(prefix="crf-sandbox-") as tmp:
        workdir = Path(tmp)
        script = workdir / "main.py"
        script.write_text(code, encoding="utf-8")
        env = {"PATH": os.defpath, "HOME": tmp, "TMPDIR": tmp, "PYTHONIOENCODING": "utf-8"}
        env.update({k: os.environ[k] for k in _SAFE_ENV_KEYS if k in os.environ})
        env.update(extra_env or {})
        cmd = [
            python or sys.executable,
            "-I",
            "-c",
            _BOOTSTRAP,
            str(memory_mb * 1024 * 1024),
            str(int(timeout_s) + 1),
            str(max_file_mb * 1024 * 1024),
            str(script),
        ]
        out_path, err_path = workdir / ".stdout", workdir / ".stderr"
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                cmd,
                cwd=tmp,
                env=env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            timed_out = False
            try:
                proc.communicate(input=stdin.encode("utf-8"), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                proc.wait()
            _kill_group(proc)  # reap anything the child left running in its session
        duration = time.monotonic() - start
        return SandboxResult(
            returncode=None if timed_out else proc.returncode,
            timed_out=timed_out,
            stdout=_read_capped(out_path, max_output_chars),
            stderr=_read_capped(err_path, max_output_chars),
            duration_s=duration,
        )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
