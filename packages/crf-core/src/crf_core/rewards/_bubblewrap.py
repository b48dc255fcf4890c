"""The bubblewrap command line of one sandboxed run, and whether bubblewrap works on this machine.

Layout inside the sandbox: new user, pid, network, ipc, uts and cgroup namespaces; ``/usr`` (with
the merged-usr links ``/bin``, ``/lib``, ``/lib64``, ``/sbin``), ``/etc/ld.so.cache`` and the
interpreter's own prefix bound read-only at their host paths; a private ``/proc`` (only the
sandbox's processes) and ``/dev`` (null, zero, full, random, urandom, tty), both read-only where
they are filesystems; one writable size-limited tmpfs at ``/tmp``, the working directory and
``HOME``, and a private one of at most ``SHM_BYTES`` at ``/dev/shm`` (``multiprocessing``'s
semaphores); the root itself read-only. Nothing else of the host (its home directories, its ``/tmp``,
site-packages, sockets) exists inside. The environment is cleared; bubblewrap puts the program in
a new session and kills it when the caller dies (``--die-with-parent``); the program's bootstrap,
not bubblewrap, is the pid namespace's init (``--as-pid-1``; bubblewrap 0.8's own init is left for
the host's init to reap once bubblewrap exits). All capabilities are
dropped and the seccomp filter of :mod:`crf_core.rewards._seccomp` is applied.

User ids: run by a normal user, the sandbox's user is that user in a new user namespace of its own
(nested user namespaces disabled), so ``RLIMIT_NPROC`` counts only the sandbox's processes. Run by
root, the kernel ignores ``RLIMIT_NPROC`` for uid 0, so the sandbox joins a user namespace created
once per trainer process that maps its uid 0 to root (bubblewrap sets up the mounts as root, so it
can read an interpreter under ``/root``) and ``SANDBOX_UIDS`` ids from ``SANDBOX_UID_BASE`` to the
same host ids; each running sandbox takes one of them (``acquire_uid``), so no two concurrent
sandboxes share a process count, in-flight socket or pipe-buffer quota, and the bootstrap drops to
it (``CAP_SETUID``/``CAP_SETGID`` are the only capabilities kept, and only until that drop). An id
is reused only once every process of its sandbox is gone.
"""

from __future__ import annotations

import collections
import functools
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BWRAP_PACKAGE", "SANDBOX_UIDS", "SANDBOX_UID_BASE", "Interpreter", "acquire_uid", "bwrap_command", "interpreter",
    "release_uid",
]  # fmt: skip

BWRAP_PACKAGE = "bubblewrap"
SANDBOX_UID_BASE = 1_900_000_000  # host ids no account uses: what untrusted code runs as when the trainer is root
SANDBOX_UIDS = 1024  # concurrent sandboxes of one root trainer process
SHM_BYTES = 16 << 20  # the private /dev/shm (POSIX semaphores and shared memory of multiprocessing)
SANDBOX_DIR = "/tmp"  # inside the sandbox: its writable tmpfs and working directory (the program is main.py there)
_USR_LINKS = ("/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin")
_CLONE_NEWUSER = 0x10000000
_USERNS_HELPER = f"""
import ctypes, sys
if ctypes.CDLL(None, use_errno=True).unshare({_CLONE_NEWUSER}) != 0:
    sys.stderr.write("unshare(CLONE_NEWUSER) failed: errno " + str(ctypes.get_errno()))
    sys.exit(1)
sys.stdout.write("r")
sys.stdout.flush()
sys.stdin.read(1)
"""


@dataclass(frozen=True)
class Interpreter:
    """A Python interpreter as the sandbox runs it: its resolved path and the host directories it needs."""

    path: str
    binds: tuple[str, ...]


@functools.lru_cache(maxsize=16)
def interpreter(python: str | None = None) -> Interpreter:
    """Resolve ``python`` (default ``sys.executable``) and the directories outside ``/usr`` it runs from.

    A virtual environment's ``python`` is a link to its base interpreter; with ``-I -S`` the base
    interpreter alone is run, so only its prefix (standard library, ``libpython``) is bound.
    """
    path = os.path.realpath(python or sys.executable)
    if python is None or path == os.path.realpath(sys.executable):
        prefixes = [sys.base_prefix, sys.base_exec_prefix]
    else:
        out = subprocess.run(
            [path, "-I", "-S", "-c", "import sys; print(sys.base_prefix); print(sys.base_exec_prefix)"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        prefixes = out.stdout.split("\n")[:2]
    dirs = {os.path.realpath(p) for p in [*prefixes, os.path.dirname(path)] if p}
    outside = sorted(d for d in dirs if d != "/" and not _under(d, "/usr"))
    binds = tuple(d for d in outside if not any(_under(d, other) for other in outside if other != d))
    return Interpreter(path, binds)


def _ancestors(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/a", "/a/b"]``."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


_userns_lock = threading.Lock()
_userns_fd: int | None = None


def _root_userns() -> int:
    """A user namespace fd mapping 0 -> root and the sandbox ids to themselves (created once; root only).

    Raises OSError when the kernel refuses (no user namespaces, or a container without the rights).
    """
    global _userns_fd
    with _userns_lock:
        if _userns_fd is not None:
            return _userns_fd
        helper = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _USERNS_HELPER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert helper.stdout is not None
            if helper.stdout.read(1) != b"r":
                err = helper.stderr.read().decode(errors="replace") if helper.stderr else ""
                raise OSError(f"cannot create a user namespace: {err.strip() or 'helper failed'}")
            mapping = f"0 0 1\n{SANDBOX_UID_BASE} {SANDBOX_UID_BASE} {SANDBOX_UIDS}\n"
            for name in ("uid_map", "gid_map"):
                Path(f"/proc/{helper.pid}/{name}").write_text(mapping, encoding="ascii")
            _userns_fd = os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            return _userns_fd
        finally:
            if helper.stdin is not None:
                helper.stdin.close()
            helper.kill()
            helper.wait()
            for stream in (helper.stdout, helper.stderr):
                if stream is not None:
                    stream.close()


_uids = threading.Condition()
_free_uids = collections.deque(range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + SANDBOX_UIDS))  # FIFO: an id rests


def acquire_uid(timeout_s: float = 60.0) -> int:
    """A sandbox id no running sandbox has (waits while all ``SANDBOX_UIDS`` are taken); OSError after ``timeout_s``."""
    with _uids:
        if not _uids.wait_for(lambda: bool(_free_uids), timeout_s):
            raise OSError(f"all {SANDBOX_UIDS} sandbox user ids are in use")
        return _free_uids.popleft()


def release_uid(uid: int, *, reusable: bool) -> None:
    """Give ``uid`` back once its sandbox is gone; one whose processes may survive is never handed out again."""
    with _uids:
        if reusable:
            _free_uids.append(uid)
            _uids.notify()


def bwrap_command(
    bwrap: str,
    python: Interpreter,
    *,
    tmp_bytes: int,
    env: dict[str, str],
    status_fd: int,
    seccomp_fd: int | None,
    zygote: bool = False,
) -> tuple[list[str], list[int], int]:
    """``(argv prefix up to and including '--', fds bwrap must inherit, uid the bootstrap drops to or -1)``.

    ``zygote=True`` (root only) is the warm pool's worker (``crf_core.rewards._pool``): it also keeps
    ``CAP_SYS_ADMIN``, ``CAP_NET_ADMIN`` and ``CAP_SETPCAP`` (in the sandbox's user namespace) to set up each
    evaluation's namespaces and mounts and drop them again, and takes no uid (each evaluation takes its own).

    Raises OSError when the trainer is root and no user namespace can be created.
    """
    argv = [bwrap]
    fds = [status_fd]
    if os.geteuid() == 0:
        userns = _root_userns()
        argv += ["--userns", str(userns), "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        if zygote:
            argv += ["--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_NET_ADMIN", "--cap-add", "CAP_SETPCAP"]
        fds.append(userns)
        drop_uid = -1 if zygote else acquire_uid()
    elif zygote:
        raise OSError("the warm pool needs a root trainer (each evaluation runs as a sandbox uid of its own)")
    else:
        argv += ["--unshare-user", "--disable-userns"]
        drop_uid = -1
    argv += [
        "--unshare-pid", "--as-pid-1", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv",
        *_filesystem(python, tmp_bytes),
    ]  # fmt: skip
    for key, value in env.items():
        argv += ["--setenv", key, value]
    argv += ["--json-status-fd", str(status_fd)]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
        fds.append(seccomp_fd)
    argv.append("--")
    return argv, fds, drop_uid


@functools.lru_cache(maxsize=16)
def _filesystem(python: Interpreter, tmp_bytes: int) -> tuple[str, ...]:
    """The mount arguments (see the module docstring); computed once per interpreter and tmpfs size."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for link in _USR_LINKS:
        if os.path.islink(link):
            argv += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link) and not _under(os.path.realpath(link), "/usr"):
            argv += ["--ro-bind", link, link]
    binds = list(python.binds)
    cache = ["/etc/ld.so.cache"] if os.path.isfile("/etc/ld.so.cache") else []
    for parent in sorted({a for path in [*binds, *cache] for a in _ancestors(path)}):
        argv += ["--perms", "0755", "--dir", parent]  # bubblewrap would otherwise create them 0700
    for path in [*cache, *binds]:
        argv += ["--ro-bind", path, path]
    argv += [
        "--proc", "/proc", "--dev", "/dev",
        "--perms", "1777", "--size", str(min(tmp_bytes, SHM_BYTES)), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
        "--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", SANDBOX_DIR,
        "--remount-ro", "/", "--chdir", SANDBOX_DIR,
    ]  # fmt: skip
    return tuple(argv)


def find_bwrap() -> str | None:
    """The ``bwrap`` executable on ``PATH`` (or in /usr/bin), if any; a hit is remembered per ``PATH``."""
    path = os.environ.get("PATH", "")
    found = _FOUND.get(path) or shutil.which("bwrap", path=path) or shutil.which("bwrap", path="/usr/bin:/bin")
    if found:
        _FOUND[path] = found
    return found


_FOUND: dict[str, str] = {}
