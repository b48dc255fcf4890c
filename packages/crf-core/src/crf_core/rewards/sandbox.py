"""Run untrusted generated Python in an isolated, limited, short-lived process.

``run_python(code)`` starts a fresh interpreter (``python -I -S -B -X utf8``: no user site, no
``site`` module, no ``PYTHON*`` variables, no bytecode written) and returns a ``SandboxResult``.
Two isolation levels:

``isolation="bwrap"`` (the default) runs it under bubblewrap: new user, pid, network, ipc, uts and
cgroup namespaces; a read-only root holding only ``/usr``, the interpreter's prefix and
``/etc/ld.so.cache``; private ``/proc`` and ``/dev``; one writable tmpfs of ``tmp_mb`` MiB at
``/tmp`` (working directory, ``HOME``, ``TMPDIR``) and a small one at ``/dev/shm``, gone when the
run ends; a cleared environment; no capabilities; a seccomp filter against memory held outside the
rlimits, namespace and mount calls and unneeded socket families; its own uid per concurrent
sandbox when the trainer is root; killed with the caller (``--die-with-parent``). Details:
``crf_core.rewards._bubblewrap``. When bubblewrap is not usable, ``run_python`` refuses with
``SandboxUnavailableError`` naming the ``bubblewrap`` package.

``isolation="rlimits"`` (explicit opt-in; a warning is logged once per process) runs the same
interpreter with only the rlimits, a scrubbed environment and a host temporary directory that is
removed afterwards. It does not stop the program from reading other processes' files in ``/proc``,
signalling processes of the same user, using the network, writing wherever the user may write,
or leaving processes that left its process group (``setsid``).

``run_python(..., pool=SandboxPool(...))`` (explicit opt-in, root trainers) runs under bubblewrap too, in a warm
worker that forks each run from an interpreter already started inside the sandbox, with fresh namespaces, tmpfs,
uid, rlimits and seccomp per run; ``crf_core.rewards._pool`` says how, and what differs from a fresh sandbox.

Both set, before the untrusted code runs: ``RLIMIT_AS`` = ``memory_mb``, ``RLIMIT_CPU`` = the time
limit, ``RLIMIT_FSIZE`` = ``max_file_mb``, ``RLIMIT_NOFILE`` = ``max_open_files``,
``RLIMIT_NPROC`` = ``max_processes`` (under bubblewrap it counts only the sandbox's processes; a
root trainer's sandbox runs as a uid of its own so that the kernel applies it and no concurrent
sandbox shares the count), ``RLIMIT_CORE`` = 0. Memory is bounded per process, so a sandbox holds
at most ``max_processes`` x ``memory_mb`` (no cgroup limit for the whole sandbox is applied).

Contract: ``run_python`` raises only for invalid arguments and for missing isolation, before
anything runs. Whatever the program does, it returns within ``timeout_s`` plus a few seconds
(the whole process tree is killed at the limit; under bubblewrap the pid namespace makes that
exact), moves its input, code and output through pipes only the trainer's ends of which it reads
(no host file is open in the program, so it cannot grow one, swap it for a FIFO or a link, or
change how the trainer reads it), and leaves no process (no zombie either), no file and no open
descriptor behind.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import select
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from crf_core._checks import is_int, is_number
from crf_core.rewards._bubblewrap import BWRAP_PACKAGE, Interpreter, bwrap_command, find_bwrap, interpreter, release_uid
from crf_core.rewards._seccomp import seccomp_filter
from crf_core.rewards._tree import remove_tree

if TYPE_CHECKING:
    from crf_core.rewards._pool import SandboxPool

__all__ = [
    "Isolation",
    "SandboxResult",
    "SandboxUnavailableError",
    "bubblewrap_problem",
    "bubblewrap_usable",
    "run_python",
]

Isolation = Literal["bwrap", "rlimits"]
_log = logging.getLogger(__name__)
_KILL_GRACE_S = 2.0  # bound on each wait after a kill
_PATH = "/usr/local/bin:/usr/bin:/bin"
_INSTALL_HINT = (
    f"install the `{BWRAP_PACKAGE}` package (Debian/Ubuntu: apt-get install {BWRAP_PACKAGE}; "
    f"Fedora/RHEL: dnf install {BWRAP_PACKAGE}); inside a container bubblewrap also needs user namespaces "
    "(docker run --security-opt seccomp=unconfined --security-opt apparmor=unconfined "
    "--security-opt systempaths=unconfined; see the crf-core rewards docs), "
    "or opt into isolation='rlimits' (resource limits only, no namespaces)"
)

# Run in the program's process before the untrusted code: the signal state ``python file.py`` starts with (SIGINT
# raises KeyboardInterrupt, SIGPIPE and SIGXFSZ ignored, every other signal at its default), whoever started the
# trainer. exec hands ignored signals down, and a trainer started in the background by a shell ignores SIGINT and
# SIGQUIT. Shared with the warm pool's zygote (``_pool``).
RESET_SIGNALS = r"""
import signal as _sig
for _s in _sig.valid_signals():
    if _s not in (_sig.SIGKILL, _sig.SIGSTOP):
        try:
            _sig.signal(_s, _sig.SIG_DFL)
        except (OSError, ValueError):
            pass
_sig.signal(_sig.SIGINT, _sig.default_int_handler)
for _s in (_sig.SIGPIPE, _sig.SIGXFSZ):
    _sig.signal(_s, _sig.SIG_IGN)
del _sig, _s
"""

# Runs inside the sandbox before the untrusted code. Under bubblewrap it is the pid namespace's init
# (``--as-pid-1``): it forks the program and reaps every process until the program exits, then exits
# with its status (128 + N for signal N), which ends the namespace; bubblewrap, its parent, reaps it,
# so no process is ever left for the host's init. The program: read the code from its file
# descriptor, set the rlimits, drop to the sandbox uid (root trainers), then run the code as module
# __main__ (source kept as main.py in the cwd for tracebacks).
_BOOTSTRAP = r"""
import os, resource, sys
_a = [int(x) for x in sys.argv[1:]]
if _a[7]:
    _child = os.fork()
    if _child:
        os.closerange(0, 1 << 16)
        while True:
            try:
                _pid, _status = os.waitpid(-1, 0)
            except ChildProcessError:
                os._exit(255)
            except InterruptedError:
                continue
            if _pid == _child:
                _code = os.waitstatus_to_exitcode(_status)
                os._exit(_code if _code >= 0 else 128 - _code)
_chunks = []
while True:
    _b = os.read(_a[0], 1 << 20)
    if not _b:
        break
    _chunks.append(_b)
os.close(_a[0])
os.closerange(3, 1 << 16)  # nothing but stdin, stdout and stderr (bubblewrap passes its user-namespace fd on)
for _name, _value in zip(("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC"), _a[1:6]):
    _res = getattr(resource, _name, None)
    if _res is not None:
        try:
            resource.setrlimit(_res, (_value, _value))
        except (ValueError, OSError):
            pass
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
#RESET_SIGNALS#
if _a[6] >= 0:
    os.setgroups([])
    os.setresgid(_a[6], _a[6], _a[6])
    os.setresuid(_a[6], _a[6], _a[6])
    if os.getuid() != _a[6] or os.geteuid() != _a[6]:
        sys.exit("crf sandbox: could not drop to the sandbox uid")
_path = os.path.join(os.getcwd(), "main.py")
with open(_path, "wb") as _f:
    _f.write(b"".join(_chunks))
_code = compile(b"".join(_chunks), _path, "exec")
del _a, _chunks, _b, _name, _value, _res, _f
_main = type(sys)("__main__")
_main.__file__ = _path
sys.modules["__main__"] = _main
sys.argv = [_path]
exec(_code, _main.__dict__)
""".replace("#RESET_SIGNALS#\n", RESET_SIGNALS.lstrip("\n"))


class SandboxUnavailableError(RuntimeError):
    """The requested isolation cannot be provided on this machine (the message names the fix)."""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        returncode: the program's exit status (negative = killed by that signal); ``None`` if it was
            killed at the time limit or never started.
        timed_out: the wall-clock limit was hit.
        stdout, stderr: captured output, truncated to ``max_output_chars`` (stderr: ``max_stderr_chars``) characters.
        duration_s: wall-clock seconds, start to cleanup.
        isolation: ``"bwrap"`` or ``"rlimits"``.
        error: why the sandbox itself failed (bubblewrap setup, no process could start); ``None``
            when the program ran.
    """

    returncode: int | None
    timed_out: bool
    stdout: str
    stderr: str
    duration_s: float
    isolation: str = "bwrap"
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Ran, exited with status 0, within the time limit."""
        return self.error is None and not self.timed_out and self.returncode == 0

    def describe(self) -> str:
        """A one-paragraph account of a failed run (for feedback): sandbox error, timeout, signal or output tail."""
        if self.error is not None:
            return f"The sandbox failed to run the program: {self.error}"
        if self.timed_out:
            return f"Timed out: the program did not finish within the time limit ({self.duration_s:.1f} s)."
        if self.returncode is not None and self.returncode < 0:
            number = -self.returncode
            name = signal.Signals(number).name if number in {s.value for s in signal.Signals} else str(number)
            return f"Killed by signal {name} (a resource limit was exceeded or the program crashed)."
        tail = self.stderr.strip() or self.stdout.strip()
        return tail if tail else f"Exited with status {self.returncode} and no output."


def run_python(
    code: str,
    *,
    stdin: str | bytes = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_chars: int = 4000,
    max_file_mb: int = 16,
    python: str | None = None,
    extra_env: Mapping[str, str] | None = None,
    isolation: Isolation = "bwrap",
    max_processes: int = 16,
    max_open_files: int = 64,
    tmp_mb: int = 64,
    max_stderr_chars: int | None = None,
    pool: SandboxPool | None = None,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh isolated interpreter and capture its output.

    Args:
        code: Python source to run (untrusted).
        stdin: text (UTF-8 encoded) or bytes fed to the program's standard input.
        timeout_s: wall-clock limit in seconds (> 0); the whole process tree is killed after it.
        memory_mb: address-space limit per process in MiB (>= 64).
        max_output_chars: characters kept from each of stdout and stderr (> 0).
        max_file_mb: largest file the program may write, its output included (> 0).
        python: interpreter to run; defaults to ``sys.executable`` (its base interpreter).
        extra_env: variables added to the otherwise empty environment.
        isolation: ``"bwrap"`` (default; refuses when bubblewrap is not usable) or ``"rlimits"``.
        max_processes: ``RLIMIT_NPROC`` (>= 1; threads count).
        max_open_files: ``RLIMIT_NOFILE`` (>= 16).
        tmp_mb: size of the writable ``/tmp`` under bubblewrap, in MiB (> 0).
        max_stderr_chars: characters kept from stderr (> 0); defaults to ``max_output_chars``.
        pool: a ``SandboxPool`` (opt-in, root trainers): run in one of its warm workers, a fresh fork of an
            interpreter already started inside bubblewrap, with fresh namespaces, tmpfs, uid, rlimits and
            seccomp per run (``crf_core.rewards._pool`` says what differs); needs ``isolation="bwrap"`` and
            ``python`` None or the pool's.

    Returns:
        ``SandboxResult``; never raises for anything the program does.

    Raises:
        TypeError, ValueError: an invalid argument.
        SandboxUnavailableError: ``isolation="bwrap"`` and bubblewrap is not usable here.
    """
    limits = _Limits.checked(
        timeout_s, memory_mb, max_output_chars, max_file_mb, max_processes, max_open_files, tmp_mb, max_stderr_chars
    )
    if not isinstance(code, str):
        raise TypeError(f"code must be a str of Python source, got {type(code).__name__}")
    if not isinstance(stdin, (str, bytes)):
        raise TypeError(f"stdin must be a str or bytes, got {type(stdin).__name__}")
    if extra_env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in extra_env.items()):
        raise TypeError("extra_env must map str to str")
    if pool is not None:
        return _in_pool(pool, code, stdin, limits, isolation, python, dict(extra_env or {}))
    require_isolation(isolation, python)
    try:
        interp = interpreter(python)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"python={python!r} cannot be run: {exc}") from exc
    return _execute(code, stdin, limits, interp, isolation, dict(extra_env or {}))


def _in_pool(
    pool: SandboxPool,
    code: str,
    stdin: str | bytes,
    limits: _Limits,
    isolation: str,
    python: str | None,
    extra_env: dict[str, str],
) -> SandboxResult:
    from crf_core.rewards._pool import SandboxPool

    if not isinstance(pool, SandboxPool):
        raise TypeError(f"pool must be a SandboxPool, got {type(pool).__name__}")
    if isolation != "bwrap":
        raise ValueError(f"a SandboxPool runs under bubblewrap: pool= needs isolation='bwrap', got {isolation!r}")
    try:
        asked = interpreter(python) if python is not None else pool.interpreter
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"python={python!r} cannot be run: {exc}") from exc
    if asked != pool.interpreter:
        raise ValueError(f"python={python!r} is not the pool's interpreter {pool.interpreter.path!r}")
    data = stdin if isinstance(stdin, bytes) else stdin.encode("utf-8", errors="surrogatepass")
    return pool.execute(code, data, limits, extra_env)


def require_isolation(isolation: str, python: str | None = None) -> None:
    """Refuse early: raise unless ``isolation`` can be provided here; warn once when it is ``"rlimits"``."""
    if isolation == "rlimits":
        _warn_rlimits_once()
        return
    if isolation != "bwrap":
        raise ValueError(f"isolation must be 'bwrap' or 'rlimits', got {isolation!r}")
    problem = bubblewrap_problem(python)
    if problem is not None:
        raise SandboxUnavailableError(
            f"the sandbox needs bubblewrap, which is not usable here ({problem}); {_INSTALL_HINT}"
        )


def bubblewrap_usable(python: str | None = None) -> bool:
    """Whether ``run_python(isolation="bwrap")`` works here (checked once per interpreter by running a program)."""
    return bubblewrap_problem(python) is None


def bubblewrap_problem(python: str | None = None) -> str | None:
    """Why bubblewrap cannot isolate programs here, or None when it can.

    The check runs a small program under bubblewrap; a success is remembered per (bwrap, interpreter, user),
    a failure is checked again on the next call.
    """
    bwrap = find_bwrap()
    if bwrap is None:
        return f"bwrap is not installed (Debian/Ubuntu package `{BWRAP_PACKAGE}`)"
    try:
        interp = interpreter(python)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run the interpreter {python!r}: {exc}"
    key = (bwrap, interp, os.geteuid())
    if key in _WORKING:
        return None
    limits = _Limits.checked(30.0, 512, 4000, 16, 16, 64, 64)
    result = _execute("import sys; sys.stdout.write('ok')", "", limits, interp, "bwrap", {})
    if result.error is not None:
        return result.error
    if not result.ok or result.stdout != "ok":
        return f"a test program failed under bubblewrap: {result.describe()[:500]}"
    _WORKING.add(key)
    return None


_WORKING: set[tuple[str, Interpreter, int]] = set()


_warned = threading.Event()


def _warn_rlimits_once() -> None:
    if not _warned.is_set():
        _warned.set()
        _log.warning(
            "crf sandbox: isolation='rlimits' runs untrusted code with resource limits only: no namespaces, so it "
            "can read other processes' /proc files, use the network, signal your processes and write where you "
            "can. Use isolation='bwrap' (package `%s`) for a real sandbox.",
            BWRAP_PACKAGE,
        )


@dataclass(frozen=True)
class _Limits:
    timeout_s: float
    memory_bytes: int
    max_output_chars: int
    file_bytes: int
    processes: int
    open_files: int
    tmp_bytes: int
    stderr_chars: int

    @classmethod
    def checked(
        cls,
        timeout_s: float,
        memory_mb: int,
        max_output_chars: int,
        max_file_mb: int,
        max_processes: int,
        max_open_files: int,
        tmp_mb: int,
        max_stderr_chars: int | None = None,
    ) -> _Limits:
        if not (is_number(timeout_s) and 0 < timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
        if not (is_int(memory_mb) and memory_mb >= 64):
            raise ValueError(
                f"memory_mb must be an int >= 64 (the interpreter itself needs ~30 MiB), got {memory_mb!r}"
            )
        for name, value, low in (
            ("max_output_chars", max_output_chars, 1),
            ("max_file_mb", max_file_mb, 1),
            ("max_processes", max_processes, 1),
            ("max_open_files", max_open_files, 16),
            ("tmp_mb", tmp_mb, 1),
            ("max_stderr_chars", max_output_chars if max_stderr_chars is None else max_stderr_chars, 1),
        ):
            if not (is_int(value) and value >= low):
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        mib = 1 << 20
        return cls(
            float(timeout_s), memory_mb * mib, max_output_chars, max_file_mb * mib, max_processes, max_open_files,
            tmp_mb * mib, max_output_chars if max_stderr_chars is None else max_stderr_chars,
        )  # fmt: skip


def _execute(
    code: str, stdin: str | bytes, limits: _Limits, interp: Interpreter, isolation: str, extra_env: dict[str, str]
) -> SandboxResult:
    """One run; never raises (an OS failure becomes ``SandboxResult.error``)."""
    start = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            try:
                run = _Run(stack, code, stdin, limits, interp, isolation, extra_env)
            except (OSError, subprocess.SubprocessError, ValueError) as exc:
                return _failed(start, isolation, f"{type(exc).__name__}: {exc}")
            return run.finish(start)
    except Exception as exc:  # the contract: nothing the program does makes run_python raise
        _log.exception("crf sandbox: the run failed")
        return _failed(start, isolation, f"{type(exc).__name__}: {exc}")
    raise AssertionError("unreachable")  # pragma: no cover


def _failed(start: float, isolation: str, error: str) -> SandboxResult:
    return SandboxResult(None, False, "", "", time.monotonic() - start, isolation, error)


class _Stream:
    """One end of a pipe the trainer holds (non-blocking): data to write into the program, or output read from it.

    The program only ever holds the other end, a pipe of its own: no host file, nothing it can grow with
    ``fallocate`` or whose shared flags (``O_DIRECT``, ``O_NONBLOCK``) change what the trainer reads.
    """

    def __init__(self, stack: contextlib.ExitStack, *, data: bytes | None = None, cap: int = 0) -> None:
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        self.child_fd, self.fd = (read_fd, write_fd) if data is not None else (write_fd, read_fd)
        os.set_blocking(self.fd, False)
        self.data, self.cap = memoryview(data) if data is not None else None, cap
        self.chunks: list[bytes] = []
        self.kept = 0
        self.open = True
        stack.callback(self.close)
        stack.callback(self.close_child)

    def close_child(self) -> None:
        if self.child_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.child_fd)
            self.child_fd = -1

    def close(self) -> None:
        if self.open:
            self.open = False
            with contextlib.suppress(OSError):
                os.close(self.fd)

    def pump(self) -> None:
        """Move what can move now without blocking; closes the end at EOF (output) or when all is written (input)."""
        try:
            if self.data is not None:
                while self.data:
                    self.data = self.data[os.write(self.fd, self.data[: 1 << 16]) :]
                self.close()
                return
            while True:
                chunk = os.read(self.fd, 1 << 16)
                if not chunk:
                    self.close()
                    return
                room = self.cap - self.kept
                if room > 0:  # beyond the cap the output is read and dropped, so the program never blocks on it
                    self.chunks.append(chunk[:room])
                    self.kept += min(len(chunk), room)
        except BlockingIOError:
            return
        except OSError:  # EPIPE: the program closed its end; anything else: give up on this stream
            self.close()

    def text(self, limit: int) -> str:
        text = b"".join(self.chunks).decode("utf-8", errors="replace")
        return text if len(text) <= limit else text[:limit] + "\n[... output truncated ...]"


def pump_streams(streams: list[_Stream], watch: list[int], timeout: float) -> None:
    """Wait up to ``timeout`` for any of ``streams`` or the extra ``watch`` fds, then move what is ready."""
    readers = [s.fd for s in streams if s.open and s.data is None]
    writers = [s.fd for s in streams if s.open and s.data is not None]
    try:
        ready_r, ready_w, _ = select.select(readers + watch, writers, [], timeout)
    except (OSError, ValueError):
        return
    ready = set(ready_r) | set(ready_w)
    for stream in streams:
        if stream.open and stream.fd in ready:
            stream.pump()


def drain_streams(streams: list[_Stream], until: float) -> None:
    """Close the input pipes and read what is left in the output ones (their writers are dead) until ``until``."""
    for stream in streams:
        if stream.data is not None:
            stream.close()
    while any(s.open for s in streams) and time.monotonic() < until:
        pump_streams(streams, [], max(0.0, min(until - time.monotonic(), 0.5)))


class _Run:
    """A started sandboxed process and everything that must be released with it (registered on ``stack``)."""

    def __init__(
        self,
        stack: contextlib.ExitStack,
        code: str,
        stdin: str | bytes,
        limits: _Limits,
        interp: Interpreter,
        isolation: str,
        extra_env: dict[str, str],
    ) -> None:
        self.limits, self.isolation = limits, isolation
        self.deadline = time.monotonic() + limits.timeout_s
        self.out = _Stream(stack, cap=limits.max_output_chars * 4 + 4)
        self.err = _Stream(stack, cap=limits.stderr_chars * 4 + 4)
        source = _Stream(stack, data=code.encode("utf-8", errors="surrogatepass"))
        feed = _Stream(stack, data=stdin if isinstance(stdin, bytes) else stdin.encode("utf-8", errors="surrogatepass"))
        self.streams = [self.out, self.err, source, feed]
        self.status_fd: int | None = None
        self.pid1: int | None = None
        self.pid1_gone = False
        self.started = False
        self.status_text = ""
        drop_uid, pass_fds = -1, [source.child_fd]
        if isolation == "bwrap":
            bwrap = find_bwrap()
            if bwrap is None:
                raise OSError("bwrap disappeared from PATH")
            env = {"PATH": _PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", **extra_env}
            status_r, status_w = os.pipe()
            self.status_fd = status_r
            stack.callback(os.close, status_r)
            seccomp_fd = _seccomp_pipe(stack)
            try:
                prefix, fds, drop_uid = bwrap_command(
                    bwrap, interp, tmp_bytes=limits.tmp_bytes, env=env, status_fd=status_w, seccomp_fd=seccomp_fd
                )
            except BaseException:
                os.close(status_w)
                raise
            if drop_uid >= 0:
                stack.callback(lambda: release_uid(drop_uid, reusable=self.pid1_gone or not self.started))
            pass_fds += fds
            popen_env, cwd = {"PATH": _PATH}, "/"
        else:
            workdir = tempfile.mkdtemp(prefix="crf-sandbox-")
            stack.callback(remove_tree, workdir)
            prefix, status_w = [], -1
            popen_env = {"PATH": _PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", **extra_env}
            cwd = workdir
        cpu_s = math.ceil(limits.timeout_s) + 1
        numbers = (source.child_fd, limits.memory_bytes, cpu_s, limits.file_bytes, limits.open_files, limits.processes)
        argv = [
            *prefix,
            interp.path,
            "-I",
            "-S",
            "-B",
            "-X",
            "utf8",
            "-c",
            _BOOTSTRAP,
            *map(str, numbers),
            str(drop_uid),
            "1" if isolation == "bwrap" else "0",
        ]
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=feed.child_fd,
                stdout=self.out.child_fd,
                stderr=self.err.child_fd,
                pass_fds=pass_fds,
                cwd=cwd,
                env=popen_env,
                start_new_session=True,
            )
        finally:
            if status_w >= 0:
                os.close(status_w)
            for stream in self.streams:
                stream.close_child()
        self.started = True
        stack.callback(self._reap)
        self.pidfd = _pidfd(self.proc.pid)
        if self.pidfd is not None:
            stack.callback(os.close, self.pidfd)
        self.pid1fd: int | None = None
        if self.status_fd is not None:
            self._read_status(until_pid=True)
            self.pid1fd = _child_pidfd(self.pid1, self.proc.pid) if self.pid1 is not None else None
            if self.pid1fd is not None:
                stack.callback(os.close, self.pid1fd)

    def finish(self, start: float) -> SandboxResult:
        """Wait for the program within the limit (moving its input and output), kill the whole tree, collect."""
        timed_out = not self._pump_until_exit()
        self._kill_tree()
        self._drain(time.monotonic() + _KILL_GRACE_S)
        returncode: int | None = None if timed_out else self.proc.returncode
        error = None
        if self.status_fd is not None:
            self._read_status(until_pid=False)
            exit_code = re.search(r'"exit-code"\s*:\s*(\d+)', self.status_text)
            if exit_code is None and not timed_out:  # bubblewrap failed before the program started
                error = "bubblewrap could not set up the sandbox: " + (self.err.text(600).strip() or "no message")
                returncode = None
            elif returncode is not None and 128 < returncode < 128 + 65:  # bwrap reports signal N as 128 + N
                returncode = -(returncode - 128)
        return SandboxResult(
            returncode=returncode,
            timed_out=timed_out,
            stdout="" if error else self.out.text(self.limits.max_output_chars),
            stderr="" if error else self.err.text(self.limits.stderr_chars),
            duration_s=time.monotonic() - start,
            isolation=self.isolation,
            error=error,
        )

    def _pump_until_exit(self) -> bool:
        """Move the pipes until the started process exits (True) or the deadline passes (False)."""
        while True:
            if self._exited():
                return True
            wait = self.deadline - time.monotonic()
            if wait <= 0:
                return False
            self._select(min(wait, 0.5))

    def _drain(self, until: float) -> None:
        drain_streams(self.streams, until)

    def _select(self, timeout: float) -> None:
        pump_streams(self.streams, [self.pidfd] if self.pidfd is not None else [], timeout)

    def _exited(self) -> bool:
        if self.pidfd is not None:
            return bool(select.select([self.pidfd], [], [], 0)[0])
        return self.proc.poll() is not None

    def _read_status(self, *, until_pid: bool) -> None:
        """Read bubblewrap's JSON status stream (its own fd; the sandboxed program cannot write to it)."""
        assert self.status_fd is not None
        limit = time.monotonic() + (min(self.limits.timeout_s, 10.0) if until_pid else _KILL_GRACE_S)
        while len(self.status_text) < 65536:
            if until_pid and '"child-pid"' in self.status_text:
                break
            wait = limit - time.monotonic()
            if wait <= 0:
                break
            if until_pid:  # the program may already be writing: keep its pipes moving meanwhile
                self._select(0)
            if not select.select([self.status_fd], [], [], min(wait, 0.05 if until_pid else wait))[0]:
                continue
            chunk = os.read(self.status_fd, 4096)
            if not chunk:
                break
            self.status_text += chunk.decode("ascii", errors="replace")
        found = re.search(r'"child-pid"\s*:\s*(\d+)', self.status_text)
        if found and self.pid1 is None:
            self.pid1 = int(found.group(1))

    def _kill_tree(self) -> None:
        """Kill everything the program started and wait until it is gone (each wait bounded).

        Under bubblewrap, killing its pid 1 makes the kernel kill every process of the pid namespace
        (``setsid`` and double-forked ones included); pid 1 exits only once they are all gone. bubblewrap
        (the started process) is then left to reap its pid 1 and exit by itself, so no zombie is handed to
        the host's init; only if it does not is its process group killed. The started process is not reaped
        yet here, so its process-group id cannot have been reused.
        """
        if self.pid1fd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pid1fd, signal.SIGKILL)
            self.pid1_gone = bool(select.select([self.pid1fd], [], [], _KILL_GRACE_S)[0])
            if self.pidfd is not None:
                select.select([self.pidfd], [], [], _KILL_GRACE_S)
        elif self.isolation == "bwrap" and self._exited():
            self.pid1_gone = True  # bubblewrap exits only after its pid 1 (so the whole namespace) is gone
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=_KILL_GRACE_S)

    def _reap(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=_KILL_GRACE_S)


def _pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (Linux >= 5.3), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _child_pidfd(pid: int, parent: int) -> int | None:
    """A pidfd for ``pid`` if it is (still) a child of ``parent``; None otherwise (then it is already gone)."""
    fd = _pidfd(pid)
    if fd is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == parent:
            return fd
    except (OSError, ValueError):
        pass
    os.close(fd)
    return None


def _seccomp_pipe(stack: contextlib.ExitStack) -> int | None:
    blob = seccomp_filter()
    if blob is None:
        return None
    read_fd, write_fd = os.pipe()
    stack.callback(os.close, read_fd)
    try:
        os.write(write_fd, blob)  # a few hundred bytes: fits the pipe buffer
    finally:
        os.close(write_fd)
    return read_fd
