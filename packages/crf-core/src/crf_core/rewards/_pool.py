"""A warm pool of sandboxed workers: ``run_python(..., pool=SandboxPool())`` without an interpreter start per run.

Each worker is one bubblewrap sandbox (the mounts of ``crf_core.rewards._bubblewrap``) whose pid 1 is a
*zygote*: an interpreter started once with the sandbox's flags that never runs candidate code. A worker
runs one evaluation at a time. For each, the trainer passes the zygote four fresh pipes (stdin, stdout,
stderr, code) over a Unix socket, with the limits, the environment and a sandbox uid of its own
(``acquire_uid``). Ahead of each job, the zygote forks:

* ``I``, pid 1 of a new pid namespace, which unshares new mount, network, ipc and uts namespaces, brings
  the new loopback up, makes every mount private, mounts a fresh ``/proc`` (the sub-trees bubblewrap keeps
  read-only stay read-only), a fresh tmpfs at ``/tmp`` (the working directory and ``HOME``; resized to
  ``tmp_mb`` per job) and a fresh one at ``/dev/shm``, then forks the program and reaps every process until
  the program exits (exit status as in the per-run sandbox);
* ``P``, the program, which waits for its job, then: takes its pipes, reads its code, sets the same
  rlimits, drops the zygote's extra capabilities from its bounding and inheritable sets, drops to the
  evaluation's uid (no capability left), sets ``no_new_privs``, installs the same seccomp filter
  (``crf_core.rewards._seccomp``) itself, clears the environment to the one asked for, forgets the
  modules the zygote imported, then runs the code as ``__main__`` exactly as the per-run bootstrap does.

When the program exits or the trainer asks (time limit), the zygote kills every process of its sandbox
(``kill(-1, SIGKILL)`` from pid 1), reaps them all and only then reports the status; the uid is reused
only after that report. Nothing an evaluation does survives it: its files lived on its own tmpfs, its
processes in its own pid namespace, its module, environment, signal and thread state in a forked copy
that is gone; it cannot see or signal the zygote (another pid namespace, another uid, ``ptrace`` denied)
and holds no descriptor but its own three pipes. A worker that misbehaves (no answer in time, a broken
message, an exit) is killed with its whole sandbox and replaced: that evaluation fails with
``SandboxResult.error`` set (never a reward), the others are in other workers.

What differs from the per-run sandbox, and why the pool is opt-in: every evaluation of a worker is a
fork of the same interpreter, so it shares its address-space layout (ASLR) and ``str`` hash seed;
the seccomp filter is installed by the program's own bootstrap rather than by bubblewrap (the same
filter, before any candidate code runs); the zygote and its setup processes hold ``CAP_SYS_ADMIN`` and
``CAP_NET_ADMIN`` and ``CAP_SETPCAP`` in the sandbox's user namespace (they never run candidate code; the
program drops them from its bounding and inheritable sets and runs under another uid, as the per-run one); and it needs a root trainer (per-evaluation uids come from the root trainer's user
namespace; without root ``SandboxPool`` refuses).
"""

from __future__ import annotations

import contextlib
import marshal
import math
import os
import queue
import re
import select
import signal
import socket
import struct
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future

from crf_core._checks import is_int
from crf_core.rewards._bubblewrap import (
    SANDBOX_DIR,
    SHM_BYTES,
    Interpreter,
    acquire_uid,
    bwrap_command,
    find_bwrap,
    interpreter,
    release_uid,
)
from crf_core.rewards._seccomp import seccomp_filter
from crf_core.rewards.sandbox import (
    RESET_SIGNALS,
    SandboxResult,
    SandboxUnavailableError,
    _child_pidfd,
    _failed,
    _Limits,
    _Stream,
    drain_streams,
    pump_streams,
    require_isolation,
)

__all__ = ["SandboxPool"]

_START_S = 30.0  # bound on a worker's start
_REPLY_S = 10.0  # bound on the zygote's setup and on its answer after a kill
_MSG = struct.Struct("=ci")  # zygote -> trainer: kind, value
_PATH = "/usr/local/bin:/usr/bin:/bin"

# The zygote (a worker's pid 1). argv: control socket fd, seccomp filter fd. Protocol: it sends R once ready;
# per job it receives [u32 length][marshal (numbers, uid, env, tmp_bytes, shm_bytes)] with four fds (stdin,
# stdout, stderr, code), sends S once the program's namespaces are set up, F if that failed, then X + the exit
# status once every process of the evaluation is gone. A byte K from the trainer kills the evaluation.
_ZYGOTE = r"""
import sys
_FRESH = set(sys.modules)
import ctypes, fcntl, gc, marshal, os, resource, select, signal, socket, struct
from atexit import _run_exitfuncs  # bound now: the program's exit imports nothing (it may have broken importing)
_MSG = struct.Struct("=ci")
_ctl = socket.socket(fileno=int(sys.argv[1]))
with open(int(sys.argv[2]), "rb", closefd=True) as _f:
    _blob = _f.read()
os.closerange(3, _ctl.fileno())
os.closerange(_ctl.fileno() + 1, 1 << 16)
_PIDNS = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
_buf = ctypes.create_string_buffer(_blob, len(_blob))
_prog = _Prog(len(_blob) // 8, ctypes.cast(_buf, ctypes.c_void_p))
class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
_ZYGOTE_CAPS = (21, 12, 8)  # CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_SETPCAP (last: it permits the drops)
_RDONLY, _NOSUID, _NODEV, _NOEXEC, _REMOUNT, _BIND, _REC, _PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
_NEWPID = 0x20000000
_NS = 0x00020000 | 0x40000000 | 0x08000000 | 0x04000000  # NEWNS, NEWNET, NEWIPC, NEWUTS

def _ok(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, what + ": " + os.strerror(err))

def _mount(src, target, fstype, flags, data=None):
    _ok(_libc.mount(src, target, fstype, flags, data), "mount " + target.decode())

def _setup():
    _mount(b"none", b"/", None, _REC | _PRIVATE)
    _mount(b"proc", b"/proc", b"proc", _NOSUID | _NODEV | _NOEXEC)
    for sub in (b"/proc/sys", b"/proc/sysrq-trigger", b"/proc/irq", b"/proc/bus"):
        if os.path.exists(sub):
            _mount(sub, sub, None, _BIND | _REC)
            _mount(None, sub, None, _BIND | _REMOUNT | _RDONLY | _NOSUID | _NODEV | _NOEXEC)
    for target in (b"/tmp", b"/dev/shm"):
        _mount(b"tmpfs", target, b"tmpfs", _NOSUID | _NODEV, b"mode=1777,size=1048576")
    os.chdir("/tmp")

def _exit_like(status):
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)

def _recv_exact(sock, n, have):
    while len(have) < n:
        chunk = sock.recv(n - len(have))
        if not chunk:
            os._exit(0)
        have += chunk
    return have

def _recv_job(sock):
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
    if not data:
        return None, []
    if len(fds) != 4:
        os._exit(3)
    data = _recv_exact(sock, 4, data)
    size = struct.unpack("=I", data[:4])[0]
    return _recv_exact(sock, 4 + size, data), fds

def _program(sock):
    data, fds = _recv_job(sock)
    sock.close()
    if data is None:
        os._exit(0)
    numbers, uid, env, tmp_bytes, shm_bytes, compiled = marshal.loads(data[4:])
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(4, 1 << 16)
    for target, size in ((b"/tmp", tmp_bytes), (b"/dev/shm", shm_bytes)):
        _mount(b"tmpfs", target, b"tmpfs", _REMOUNT | _NOSUID | _NODEV, b"mode=1777,size=%d" % size)
    chunks = []
    while True:
        b = os.read(3, 1 << 20)
        if not b:
            break
        chunks.append(b)
    os.close(3)
    for name, value in zip(("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC"), numbers):
        res = getattr(resource, name, None)
        if res is not None:
            try:
                resource.setrlimit(res, (value, value))
            except (ValueError, OSError):
                pass
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for cap in _ZYGOTE_CAPS:  # bounding and inheritable sets as in the per-run sandbox (CAP_SETUID, CAP_SETGID)
        _ok(_libc.prctl(24, cap, None, 0, 0), "drop capability")  # PR_CAPBSET_DROP
    head, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
    _ok(_libc.capget(ctypes.byref(head), data), "capget")
    for word in data:
        word.inheritable &= ~sum(1 << cap for cap in _ZYGOTE_CAPS)
    _ok(_libc.capset(ctypes.byref(head), data), "capset")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError("could not drop to the sandbox uid")
    _ok(_libc.prctl(38, 1, None, 0, 0), "no_new_privs")
    _ok(_libc.prctl(22, 2, ctypes.cast(ctypes.pointer(_prog), ctypes.c_void_p), 0, 0), "seccomp")
    os.environ.clear()
    os.environ.update(env)
    for name in set(sys.modules) - _FRESH:
        del sys.modules[name]
    path = os.path.join(os.getcwd(), "main.py")
    with open(path, "wb") as f:
        f.write(b"".join(chunks))
    main = type(sys)("__main__")
    main.__file__ = path
    sys.argv = [path]
    return b"".join(chunks), path, main, compiled

def _evaluation(sock, w):
    # I: pid 1 of a new pid namespace; new mount, network, ipc and uts namespaces, fresh mounts; then P.
    _ctl.detach()  # its fd is closed below; the object must never close a reused number
    _libc.prctl(1, signal.SIGKILL, None, 0, 0)  # PR_SET_PDEATHSIG: gone with the zygote
    keep = sorted((sock.fileno(), w))
    os.closerange(3, keep[0])
    os.closerange(keep[0] + 1, keep[1])
    os.closerange(keep[1] + 1, 1 << 16)
    _ok(_libc.unshare(_NS), "unshare")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # SIOCSIFFLAGS lo: UP | LOOPBACK | RUNNING
        fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", 0x1 | 0x8 | 0x40))
    _setup()
    program = os.fork()
    if program == 0:
        os.close(w)
        return sock
    sock.close()
    os.write(w, b"o")
    os.closerange(0, 1 << 16)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(255)
        except InterruptedError:
            continue
        if pid == program:
            _exit_like(status)

def _reap_all():
    for _ in range(2):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue

def _spare():
    # The next evaluation's processes, forked before its job: ("spare", (E, its pidfd, setup pipe, job socket))
    # in the zygote, ("program", job socket) in P.
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    _ok(_libc.unshare(_NEWPID), "unshare")  # the next child is pid 1 of a new pid namespace
    e = -1
    try:
        e = os.fork()
    finally:
        if e != 0:  # the zygote's later children: back in its own pid namespace (so unshare works next time)
            _ok(_libc.setns(_PIDNS, _NEWPID), "setns")
    if e == 0:
        ours.detach()
        try:
            return "program", _evaluation(theirs, w)
        except BaseException as exc:
            try:
                os.write(w, ("crf sandbox pool: " + repr(exc)).encode("utf-8", "replace")[:4000])
            finally:
                os._exit(125)
    theirs.close()
    os.close(w)
    return "spare", (e, os.pidfd_open(e), r, ours)

def _one(spare, data, fds):
    e, efd, r, job = spare
    report = os.read(r, 4096)
    ready = report == b"o"
    if ready:
        try:
            socket.send_fds(job, [data], fds)
        except OSError as exc:
            ready, report = False, repr(exc).encode()
    if not ready:
        os.write(fds[2], b"crf sandbox pool: " + report)
    job.close()
    for fd in fds:
        os.close(fd)
    status = None if ready else 125
    while status is None:
        got = select.select([_ctl, efd], [], [])[0]
        if _ctl in got:
            cmd = _ctl.recv(64)
            if not cmd:
                _reap_all()
                os._exit(0)
            if b"K" in cmd:
                status = -9
        if status is None and efd in got:
            status = os.waitstatus_to_exitcode(os.waitpid(e, 0)[1])
    _reap_all()
    os.close(efd)
    os.close(r)
    _ctl.sendall(_MSG.pack(b"X" if ready else b"F", status))

def _serve():
    kind, spare = _spare()
    if kind == "program":
        return spare
    _ctl.sendall(_MSG.pack(b"R", 0))
    while True:
        data, fds = _recv_job(_ctl)
        if data is None:
            _reap_all()
            os._exit(0)
        _one(spare, data, fds)
        kind, spare = _spare()
        if kind == "program":
            return spare

def _finish(code):
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()
    _run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = 120
    os._exit(code)

def _exit_code(value):
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF if -(1 << 63) <= value < (1 << 63) else 255
    try:
        sys.stderr.write(str(value) + "\n")
    except Exception:
        pass
    return 1

gc.freeze()  # the zygote's objects: never scanned (nor copied on write) by an evaluation's collector
_sock = _serve()  # from here on: the program's own process only, as the per-run bootstrap
try:
    _source, _path, _main, _code = _program(_sock)
except BaseException as _exc:
    os.write(2, ("crf sandbox pool: " + repr(_exc) + "\n").encode("utf-8", "replace"))
    os._exit(125)
_code = compile(_source, _path, "exec") if _code is None else marshal.loads(_code)
del _ctl, _blob, _buf, _prog, _f, _source, _sock
#RESET_SIGNALS#
sys.modules["__main__"] = _main
try:
    exec(_code, _main.__dict__)
except SystemExit as _exc:
    _finish(_exit_code(_exc.code))
except BaseException:
    sys.excepthook(*sys.exc_info())
    _finish(1)
_finish(0)
""".replace("#RESET_SIGNALS#\n", RESET_SIGNALS.lstrip("\n"))


class SandboxPool:
    """Warm sandboxed workers for ``run_python(..., pool=...)`` (see the module docstring for the guarantees).

    Args:
        workers: evaluations run at once (an int in [1, 256]); a worker starts at its first use and is
            replaced when it fails. More concurrent callers wait for a free worker.
        python: interpreter the workers run (default ``sys.executable``'s base interpreter).
        preload: trusted sources run often (``UnitTestReward``'s harness): compiled once here, so an evaluation
            of one of them skips the compile (only when the workers run the trainer's own interpreter; never
            pass candidate code, which must be compiled only inside the sandbox).

    Raises:
        ValueError: an invalid argument.
        SandboxUnavailableError: bubblewrap is not usable here, or the trainer is not root.
    """

    def __init__(self, workers: int = 2, *, python: str | None = None, preload: Sequence[str] = ()) -> None:
        if not (is_int(workers) and 1 <= workers <= 256):
            raise ValueError(f"workers must be an int in [1, 256], got {workers!r}")
        if isinstance(preload, str) or not all(isinstance(source, str) for source in preload):
            raise TypeError("preload must be a sequence of str (trusted Python sources)")
        if os.geteuid() != 0:
            raise SandboxUnavailableError(
                "the warm sandbox pool needs a root trainer (each evaluation runs as a sandbox uid of its own); "
                "run without a pool (a fresh sandbox per evaluation) otherwise"
            )
        require_isolation("bwrap", python)
        self.interpreter: Interpreter = interpreter(python)
        self._preloaded: dict[str, bytes] = {}
        if self.interpreter == interpreter(None):  # marshal's format is the trainer's interpreter's
            for source in preload:
                with contextlib.suppress(SyntaxError, ValueError):
                    self._preloaded[source] = marshal.dumps(
                        compile(source, f"{SANDBOX_DIR}/main.py", "exec", dont_inherit=True, optimize=0)
                    )
        self.workers = workers
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._busy = 0
        self._closed = False
        self._all: weakref.WeakSet[_Worker] = weakref.WeakSet()
        weakref.finalize(self, _close_workers, self._all)

    def close(self) -> None:
        """Stop the idle workers now and the busy ones when their evaluation ends; later runs return an error."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def execute(self, code: str, stdin: bytes, limits: _Limits, extra_env: dict[str, str]) -> SandboxResult:
        """One evaluation in a worker (started or replaced as needed); never raises."""
        start = time.monotonic()
        try:
            worker = self._take(max(60.0, 4 * limits.timeout_s))
        except Exception as exc:
            return _failed(start, "bwrap", f"sandbox pool: {exc}")
        try:
            if worker is None:
                worker = _spawn(self.interpreter)
                self._all.add(worker)
            return worker.evaluate(code, stdin, limits, extra_env, start, self._preloaded.get(code))
        except Exception as exc:  # the contract: nothing the program does makes run_python raise
            if worker is not None:
                worker.healthy = False
            return _failed(start, "bwrap", f"sandbox pool: {type(exc).__name__}: {exc}")
        finally:
            self._give_back(worker)

    def _take(self, timeout_s: float) -> _Worker | None:
        """An idle worker, or None when a new one may be started; OSError when closed or none frees up in time."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or self._idle or self._busy < self.workers, timeout_s):
                raise OSError(f"no pool worker became free within {timeout_s:.0f} s")
            if self._closed:
                raise OSError("the sandbox pool is closed")
            self._busy += 1
            return self._idle.pop() if self._idle else None

    def _give_back(self, worker: _Worker | None) -> None:
        with self._cond:
            self._busy -= 1
            keep = worker is not None and worker.healthy and not self._closed
            if keep and worker is not None:
                self._idle.append(worker)
            self._cond.notify()
        if worker is not None and not keep:
            worker.close()


_spawn_lock = threading.Lock()
_spawn_jobs: queue.SimpleQueue[tuple[Interpreter, Future[_Worker]]] = queue.SimpleQueue()
_spawner: threading.Thread | None = None


def _spawn(interp: Interpreter) -> _Worker:
    """A new worker, started by one long-lived thread: bubblewrap's ``--die-with-parent`` is a parent-death
    signal, sent when the thread that started it exits (a reward's thread pool would kill its workers)."""
    global _spawner
    with _spawn_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_serve_spawns, name="crf-sandbox-pool-spawner", daemon=True)
            _spawner.start()
    future: Future[_Worker] = Future()
    _spawn_jobs.put((interp, future))
    return future.result(timeout=_START_S + 10.0)


def _serve_spawns() -> None:
    while True:
        interp, future = _spawn_jobs.get()
        try:
            future.set_result(_Worker(interp))
        except BaseException as exc:
            future.set_exception(exc)


def _close_workers(workers: weakref.WeakSet[_Worker]) -> None:
    for worker in list(workers):
        worker.close()


class _Worker:
    """One bubblewrap sandbox whose pid 1 is the zygote, and the trainer's end of its control socket."""

    def __init__(self, interp: Interpreter) -> None:
        bwrap = find_bwrap()
        if bwrap is None:
            raise OSError("bwrap disappeared from PATH")
        self.healthy = False
        self.pid1fd: int | None = None
        self._buffer = b""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ctl = ours
        self.status_fd, status_w = os.pipe()  # bubblewrap's JSON status (its pid 1's host pid)
        blob_r, blob_w = os.pipe()
        try:
            with open(blob_w, "wb") as fh:
                fh.write(seccomp_filter() or b"")
            env = {"PATH": _PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
            prefix, fds, _ = bwrap_command(
                bwrap, interp, tmp_bytes=1 << 20, env=env, status_fd=status_w, seccomp_fd=None, zygote=True
            )
            argv = [*prefix, interp.path, "-I", "-S", "-B", "-X", "utf8", "-c", _ZYGOTE, str(theirs.fileno())]
            self.proc = subprocess.Popen(
                [*argv, str(blob_r)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=[*fds, theirs.fileno(), blob_r],
                cwd="/",
                env={"PATH": _PATH},
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            os.close(self.status_fd)
            raise
        finally:
            theirs.close()
            os.close(status_w)
            os.close(blob_r)
        try:
            kind, _ = self._message(time.monotonic() + _START_S, [])
            if kind != b"R":
                raise OSError(f"the pool worker sent {kind!r} instead of ready")
        except OSError as exc:
            detail = self._stderr_tail()
            self.close()
            raise OSError(f"the pool worker did not start: {exc}{': ' + detail if detail else ''}") from None
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        status = b""
        while select.select([self.status_fd], [], [], 0)[0] and len(status) < 65536:
            chunk = os.read(self.status_fd, 4096)
            if not chunk:
                break
            status += chunk
        found = re.search(rb'"child-pid"\s*:\s*(\d+)', status)
        self.pid1fd = _child_pidfd(int(found.group(1)), self.proc.pid) if found else None
        self.healthy = True

    def _stderr_tail(self) -> str:
        if self.proc.stderr is None or self.proc.stderr.closed:
            return ""
        with contextlib.suppress(OSError, ValueError, TypeError):
            if select.select([self.proc.stderr], [], [], 0.5)[0]:
                return os.read(self.proc.stderr.fileno(), 2000).decode(errors="replace").strip()
        return ""

    def _message(self, deadline: float, streams: list[_Stream]) -> tuple[bytes, int]:
        """The zygote's next message, moving ``streams`` meanwhile; OSError at EOF, garbage or ``deadline``."""
        while len(self._buffer) < _MSG.size:
            wait = deadline - time.monotonic()
            if wait <= 0:
                raise TimeoutError("the pool worker did not answer in time")
            pump_streams(streams, [self.ctl.fileno()], min(wait, 0.5))
            if select.select([self.ctl], [], [], 0)[0]:
                chunk = self.ctl.recv(64)
                if not chunk:
                    raise OSError("the pool worker exited")
                self._buffer += chunk
        kind, value = _MSG.unpack(self._buffer[: _MSG.size])
        self._buffer = self._buffer[_MSG.size :]
        if kind not in (b"R", b"F", b"X"):
            raise OSError(f"the pool worker sent an unknown message {kind!r}")
        return kind, value

    def evaluate(
        self, code: str, stdin: bytes, limits: _Limits, extra_env: dict[str, str], start: float, compiled: bytes | None
    ) -> SandboxResult:
        """Run one evaluation; a worker that breaks the protocol or does not answer is closed (never reused)."""
        self.healthy = False  # until the zygote has confirmed this evaluation gone
        with contextlib.ExitStack() as stack:
            out = _Stream(stack, cap=limits.max_output_chars * 4 + 4)
            err = _Stream(stack, cap=limits.stderr_chars * 4 + 4)
            source = _Stream(stack, data=code.encode("utf-8", errors="surrogatepass"))
            feed = _Stream(stack, data=stdin)
            streams = [out, err, source, feed]
            uid = acquire_uid()
            stack.callback(lambda: release_uid(uid, reusable=self.healthy or self._gone()))
            numbers = (
                limits.memory_bytes, math.ceil(limits.timeout_s) + 1, limits.file_bytes, limits.open_files,
                limits.processes,
            )  # fmt: skip
            env = {"PATH": _PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PWD": "/tmp", **extra_env}
            job = (numbers, uid, env, limits.tmp_bytes, min(limits.tmp_bytes, SHM_BYTES), compiled)
            body = marshal.dumps(job)
            self.ctl.settimeout(_REPLY_S)
            try:
                socket.send_fds(
                    self.ctl,
                    [struct.pack("=I", len(body)) + body],
                    [feed.child_fd, out.child_fd, err.child_fd, source.child_fd],
                )
            finally:
                self.ctl.settimeout(None)
                for stream in streams:
                    stream.close_child()
            deadline = time.monotonic() + limits.timeout_s
            timed_out, kind, status = False, b"", 0
            try:
                while kind not in (b"X", b"F"):
                    try:
                        kind, status = self._message(deadline, streams)
                    except TimeoutError:
                        if timed_out:
                            raise
                        timed_out = True
                        self.ctl.sendall(b"K")
                        deadline = time.monotonic() + _REPLY_S
                self.healthy = True
            except OSError as exc:
                self.close()  # its whole sandbox dies with it
                if not timed_out:
                    return _failed(start, "bwrap", f"the sandbox pool's worker failed ({exc}); it is replaced")
            drain_streams(streams, time.monotonic() + 2.0)
            if kind == b"F" and not timed_out:
                detail = err.text(600).strip() or "no message"
                return _failed(start, "bwrap", f"the sandbox pool could not set up the evaluation: {detail}")
            returncode: int | None = None if timed_out else status
            if returncode is not None and 128 < returncode < 128 + 65:  # signal N reported as 128 + N
                returncode = -(returncode - 128)
            return SandboxResult(
                returncode=returncode,
                timed_out=timed_out,
                stdout=out.text(limits.max_output_chars),
                stderr=err.text(limits.stderr_chars),
                duration_s=time.monotonic() - start,
                isolation="bwrap",
            )
        raise AssertionError("unreachable")  # pragma: no cover

    def _gone(self) -> bool:
        """Whether the worker's whole sandbox is gone (then the ids it was given may be reused)."""
        return self.proc.poll() is not None

    def close(self) -> None:
        """End the worker's sandbox and everything in it, then reap bubblewrap (each wait bounded).

        Closing the control socket makes the zygote kill and reap every process and exit; if it does not,
        its pid 1 is killed (the kernel then kills the whole pid namespace) and only then bubblewrap, so
        bubblewrap reaps its pid 1 itself and no zombie is left to the host's init.
        """
        self.healthy = False
        with contextlib.suppress(OSError):
            self.ctl.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2.0)
        if self.proc.poll() is None and self.pid1fd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pid1fd, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=2.0)
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=2.0)
        for fd in (self.pid1fd, self.status_fd):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.pid1fd, self.status_fd = None, -1
        if self.proc.stderr is not None:
            with contextlib.suppress(OSError):
                self.proc.stderr.close()
