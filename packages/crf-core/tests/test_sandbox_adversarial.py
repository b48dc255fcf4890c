"""Adversarial suite for run_python under bubblewrap: every escape a program tried against the old sandbox, and more.

Each attack is a program run with ``run_python`` (default isolation). After each one the suite checks, besides
the attack's own expectation: the call returned within the time limit plus a bound, the trainer (this process)
is alive and received no signal, no process the program started is left on the host, and nothing is left in the
host's temporary folder. The ids below are the attacks; ``ATTACKS`` is counted in the docs and the report.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from crf_core.rewards import SandboxPool, SandboxResult, run_python

pytestmark = pytest.mark.usefixtures("bwrap")
TIME_BOUND_S = 5.0  # run_python returns within timeout_s + this


@dataclass(frozen=True)
class Host:
    """What the test knows of the host, given to the attack program as ``HOST`` (a dict)."""

    token: str
    tmp: Path  # the host temp folder the sandbox's own files go to
    canary: Path  # a host folder holding canary.txt and secret.txt
    secret: str  # in this process's environment and in canary/secret.txt
    port: int  # a TCP listener on 127.0.0.1
    site_dirs: list[str]

    def program_header(self) -> str:
        info = {
            "pid": os.getpid(),
            "pgid": os.getpgid(0),
            "tmp": str(self.tmp),
            "canary": str(self.canary),
            "secret_file": str(self.canary / "secret.txt"),
            "home": str(Path.home()),
            "cwd": os.getcwd(),
            "port": self.port,
            "site_dirs": self.site_dirs,
            "token": self.token,
        }
        return f"HOST = {json.dumps(info)}\n"


@dataclass(frozen=True)
class Attack:
    program: str
    check: Callable[[SandboxResult, Host], None]
    timeout_s: float = 3.0
    kwargs: tuple[tuple[str, Any], ...] = ()


def _not_in_output(text: Callable[[Host], str]) -> Callable[[SandboxResult, Host], None]:
    def check(result: SandboxResult, host: Host) -> None:
        assert text(host) not in result.stdout + result.stderr

    return check


def _no_line(marker: str) -> Callable[[SandboxResult, Host], None]:
    def check(result: SandboxResult, host: Host) -> None:
        assert marker not in result.stdout, result.stdout[-2000:]

    return check


def _canary_intact(result: SandboxResult, host: Host) -> None:
    assert sorted(p.name for p in host.canary.iterdir()) == ["canary.txt", "secret.txt"]
    assert (host.canary / "canary.txt").read_text() == "canary"


def _all(*checks: Callable[[SandboxResult, Host], None]) -> Callable[[SandboxResult, Host], None]:
    def check(result: SandboxResult, host: Host) -> None:
        for one in checks:
            one(result, host)

    return check


def _timed_out(result: SandboxResult, host: Host) -> None:
    assert result.timed_out


def _ok(result: SandboxResult, host: Host) -> None:
    assert result.ok, result


def _printed(marker: str) -> Callable[[SandboxResult, Host], None]:
    def check(result: SandboxResult, host: Host) -> None:
        assert marker in result.stdout, (result.stdout[-2000:], result.stderr[-2000:])

    return check


def _no_connection(result: SandboxResult, host: Host) -> None:
    assert _ACCEPTED.get(host.port, 0) == 0, "the sandbox reached a listener on the host's 127.0.0.1"


def _no_files_written(result: SandboxResult, host: Host) -> None:
    escaped = [line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("TARGET ")]
    assert escaped, "the attack printed no targets"
    for path in escaped:
        assert not os.path.lexists(path), f"the sandbox wrote {path} on the host"


WRITE_TARGETS = """
targets = [HOST["tmp"] + "/escape.txt", HOST["canary"] + "/escape.txt", HOST["cwd"] + "/escape-" + HOST["token"],
           HOST["home"] + "/escape-" + HOST["token"], "/etc/escape-" + HOST["token"], "/usr/escape-" + HOST["token"],
           "/escape-" + HOST["token"], "/var/tmp/escape-" + HOST["token"]]
targets += [d + "/crf_attack_" + HOST["token"] + ".pth" for d in HOST["site_dirs"]]
"""

ATTACKS: dict[str, Attack] = {
    # -- the escapes issue 11 reported against the old sandbox --------------------------------------------------
    "write-outside-temp-dir": Attack(
        WRITE_TARGETS
        + """
for t in targets:
    print("TARGET", t)
    try:
        with open(t, "w") as fh:
            fh.write("escaped")
        print("WROTE", t)
    except OSError:
        pass
""",
        _all(_no_files_written, _no_line("WROTE"), _canary_intact),
    ),
    "pth-into-site-packages": Attack(
        WRITE_TARGETS
        + """
import sys, sysconfig
dirs = set(HOST["site_dirs"]) | {sysconfig.get_paths()["purelib"], sys.prefix}
for d in sorted(dirs):
    t = d + "/crf_attack_" + HOST["token"] + ".pth"
    print("TARGET", t)
    try:
        open(t, "w").write("import os; os.environ['CRF_PWNED'] = '1'\\n")
        print("WROTE", t)
    except OSError:
        pass
""",
        _all(_no_files_written, _no_line("WROTE")),
    ),
    "network-to-host-localhost": Attack(
        """
import socket
for family, addr in ((socket.AF_INET, ("127.0.0.1", HOST["port"])), (socket.AF_INET6, ("::1", HOST["port"]))):
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(1)
        s.connect(addr)
        s.sendall(b"hello from the sandbox")
        print("CONNECTED", addr)
    except OSError as exc:
        print("refused", addr, exc)
try:
    socket.getaddrinfo("pypi.org", 443)
    print("CONNECTED dns")
except OSError:
    pass
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\\0crf-" + HOST["token"])  # an abstract unix socket the host listens on
    print("CONNECTED abstract socket")
except OSError as exc:
    print("refused abstract", exc)
""",
        _all(_no_line("CONNECTED"), _no_connection),
    ),
    "signal-parent-and-group": Attack(
        """
import os, signal
for send in (lambda: os.kill(os.getppid(), signal.SIGTERM), lambda: os.kill(HOST["pid"], signal.SIGUSR1),
             lambda: os.killpg(HOST["pgid"], signal.SIGUSR1), lambda: os.kill(1, signal.SIGKILL),
             lambda: os.killpg(os.getpgid(0), signal.SIGUSR1)):
    try:
        send()
    except OSError as exc:
        print("failed", exc)
os.kill(-1, signal.SIGKILL)
""",
        lambda result, host: None,  # the common check: this process is alive and got no SIGUSR1/SIGTERM
    ),
    "fifo-as-output-file": Attack(
        """
import os
for name in (".stdout", ".stderr", "main.py.out", HOST["tmp"] + "/fifo"):
    try:
        os.mkfifo(name)
    except OSError:
        pass
for fd in (1, 2):
    try:
        os.unlink(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        pass
print("still here")
""",
        _all(_ok, _printed("still here")),
    ),
    "symlink-output-to-host-files": Attack(
        """
import os
for name, target in ((".stdout", "/etc/shadow"), (".stderr", HOST["secret_file"]), ("link", HOST["canary"]),
                     ("root", "/")):
    try:
        os.symlink(target, name)
    except OSError:
        pass
try:
    open("link/canary.txt", "w").write("overwritten")
except OSError:
    pass
print("done")
""",
        _all(_ok, _canary_intact, _not_in_output(lambda h: h.secret)),
    ),
    "deep-directory-tree": Attack(
        """
import os
base = os.getcwd()
for i in range(1500):
    os.mkdir("d")
    os.chdir("d")
    if i % 100 == 0:
        open("f", "w").write("x")
        os.symlink("/", "up")
os.chmod(".", 0o500)
os.chdir(base)
os.chmod("d", 0)
print("built")
""",
        _all(_ok, _printed("built")),
        timeout_s=10.0,
    ),
    "setsid-double-fork-survivor": Attack(
        """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", HOST["token"]])
    os._exit(0)
time.sleep(0.2)
print("parent exits")
""",
        _printed("parent exits"),
    ),
    "unbounded-processes": Attack(  # also runs from a process that exits, leaving its children
        """
import os, sys, time
children = 0
for _ in range(1000):
    try:
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", HOST["token"]])
        children += 1
    except OSError:
        break
print("CHILDREN", children, flush=True)
""",
        lambda result, host: _assert_children_bounded(result),
    ),
    # -- resource exhaustion ----------------------------------------------------------------------------------------
    "fork-bomb": Attack(
        """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
""",
        _timed_out,
        timeout_s=2.0,
    ),
    "memory-bomb": Attack(
        """
chunks = []
try:
    while True:
        chunks.append(bytearray(64 * 1024 * 1024))
except MemoryError:
    print("stopped at", len(chunks) * 64, "MiB")
    chunks.clear()
""",
        _all(_ok, lambda result, host: _assert_below_mib(result, 256)),
        kwargs=(("memory_mb", 256),),
    ),
    "memory-outside-rlimits": Attack(  # memfd, SysV shm and a tmpfs in a nested namespace would escape RLIMIT_AS
        """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
try:
    fd = os.memfd_create("x")
    os.ftruncate(fd, 1 << 30)
    print("ESCAPED memfd")
except OSError as exc:
    print("memfd refused", exc)
if libc.shmget(0, 1 << 30, 0o1000 | 0o600) != -1:
    print("ESCAPED shmget")
if libc.msgget(0, 0o1000 | 0o600) != -1:
    print("ESCAPED msgget")
if libc.unshare(0x10000000 | 0x00020000) == 0:
    print("ESCAPED unshare")
""",
        _all(_ok, _no_line("ESCAPED")),
    ),
    "disk-filling": Attack(
        """
import errno
written = 0
try:
    with open("fill", "wb") as fh:
        while written < 4 << 30:
            fh.write(b"x" * (1 << 20))
            fh.flush()
            written += 1 << 20
except OSError as exc:
    print("STOPPED", errno.errorcode.get(exc.errno), written >> 20)
try:
    for i in range(100000):
        with open(f"small{i}", "w") as fh:
            fh.write("x" * 4096)
except OSError as exc:
    print("STOPPED small files", errno.errorcode.get(exc.errno), i)
""",
        lambda result, host: _assert_disk_bounded(result),
        timeout_s=10.0,
    ),
    "stdout-flood": Attack(
        """
import os, sys
chunk = "y" * (1 << 20)
for _ in range(200):
    try:
        sys.stdout.write(chunk)
    except OSError:
        break
""",
        lambda result, host: _assert_output_bounded(result),
        timeout_s=10.0,
    ),
    "cpu-burning-threads-ignoring-signals": Attack(
        """
import os, signal, threading
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):
    signal.signal(sig, signal.SIG_IGN)
def burn():
    while True:
        pass
for _ in range(4):
    threading.Thread(target=burn, daemon=True).start()
if os.fork() == 0:
    burn()
burn()
""",
        _timed_out,
        timeout_s=1.5,
    ),
    # -- information and privilege ------------------------------------------------------------------------------
    "read-home-and-host-files": Attack(
        """
import os
for path in (HOST["secret_file"], HOST["home"], HOST["canary"], HOST["cwd"], "/etc/shadow", "/etc/passwd",
             "/root/.ssh", "/root/.netrc", "/var/run/docker.sock", "/run"):
    try:
        if os.path.isdir(path):
            print(path, os.listdir(path))
        else:
            print(path, open(path).read())
    except OSError as exc:
        print("no", path, type(exc).__name__)
""",
        _not_in_output(lambda h: h.secret),
    ),
    "dev-shm-persistence": Attack(
        """
import os
for path in ("/dev/shm/" + HOST["token"], "/tmp/" + HOST["token"], "/var/tmp/" + HOST["token"]):
    if os.path.exists(path):
        print("PERSISTED", path)
    try:
        open(path, "w").write("left for the next run")
    except OSError:
        pass
""",
        _no_line("PERSISTED"),  # run twice by the test: the second run must find nothing
    ),
    "host-processes-invisible": Attack(
        """
import os
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print("PIDS", pids)
if os.path.exists(f"/proc/{HOST['pid']}") and HOST["pid"] > 10:
    print("VISIBLE trainer")
""",
        _all(_ok, _no_line("VISIBLE"), lambda result, host: _assert_few_pids(result)),
    ),
    "nested-namespaces-and-mounts": Attack(
        """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for flags in (0x10000000, 0x00020000, 0x40000000, 0x10000000 | 0x00020000):
    if libc.unshare(flags) == 0:
        print("ESCAPED unshare", hex(flags))
if libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) == 0:
    print("ESCAPED mount")
if libc.mount(b"/usr", b"/usr", None, 0x20 | 0x1000, None) == 0:  # MS_REMOUNT | MS_BIND, read-write
    print("ESCAPED remount")
try:
    open("/usr/crf_escape", "w")
    print("ESCAPED write /usr")
except OSError:
    pass
""",
        _all(_ok, _no_line("ESCAPED")),
    ),
    "ptrace-and-capabilities": Attack(
        """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(16, 1, None, None) == 0:  # PTRACE_ATTACH to bubblewrap's init
    print("ESCAPED ptrace")
caps = open("/proc/self/status").read().split("CapEff:")[1].split()[0]
if int(caps, 16):
    print("ESCAPED capabilities", caps)
for path in ("/proc/sysrq-trigger", "/proc/sys/kernel/hostname", "/sys/kernel/uevent_helper"):
    try:
        open(path, "w").write("x")
        print("ESCAPED", path)
    except OSError:
        pass
for dev in ("/dev/mem", "/dev/kmsg", "/dev/sda", "/dev/vda"):
    if os.path.exists(dev):
        print("ESCAPED device", dev)
""",
        _all(_ok, _no_line("ESCAPED")),
    ),
    "write-into-interpreter": Attack(
        """
import os, sys
for d in (sys.prefix, os.path.dirname(os.__file__), os.path.dirname(sys.executable)):
    try:
        open(os.path.join(d, "crf_escape.py"), "w").write("x")
        print("ESCAPED", d)
    except OSError:
        pass
""",
        _all(_ok, _no_line("ESCAPED")),
    ),
    # -- issue 21: host-backed fds, shared file descriptions, socket families, kernel memory, leaked fds ---------
    "fallocate-on-inherited-fds": Attack(
        """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for fd in (0, 1, 2, os.dup(1)):
    for mode in (1, 0):  # FALLOC_FL_KEEP_SIZE: space reserved beyond RLIMIT_FSIZE's reach; then a plain one
        if libc.fallocate(fd, mode, ctypes.c_long(0), ctypes.c_long(1 << 30)) == 0:
            print("ESCAPED fallocate", fd, mode)
    try:
        os.ftruncate(fd, 1 << 30)
        print("ESCAPED ftruncate", fd)
    except OSError:
        pass
""",
        _all(_ok, _no_line("ESCAPED")),
    ),
    "shared-file-description-flags": Attack(  # O_DIRECT on the shared output once made run_python raise
        """
import fcntl, os, sys
for fd in (0, 1, 2):
    target = os.readlink(f"/proc/self/fd/{fd}")
    if not target.startswith("pipe:"):
        print("HOSTFILE", fd, target, flush=True)
    for flags in (os.O_DIRECT, os.O_DIRECT | os.O_NONBLOCK | os.O_APPEND):
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        except OSError:
            pass
for _ in range(100):
    try:
        os.write(1, b"z" * 4097)
        os.write(2, b"q" * 4097)
    except OSError:
        pass
""",
        _all(_no_line("HOSTFILE"), lambda result, host: _assert_returned(result)),
    ),
    "vsock-and-unneeded-socket-families": Attack(
        """
import socket
tries = [(socket.AF_VSOCK, socket.SOCK_STREAM), (socket.AF_PACKET, socket.SOCK_RAW), (socket.AF_ALG, socket.SOCK_SEQPACKET),
         (socket.AF_UNIX, socket.SOCK_DGRAM), (socket.AF_UNIX, socket.SOCK_SEQPACKET), (socket.AF_NETLINK, socket.SOCK_DGRAM)]
for family, kind in tries:
    try:
        s = socket.socket(family, kind, 9 if family == socket.AF_NETLINK else 0)  # NETLINK_AUDIT
        if family == socket.AF_VSOCK:
            s.bind((socket.VMADDR_CID_ANY, 4242))
            s.listen()
        print("OPENED", family, kind)
    except OSError as exc:
        print("refused", family, kind, exc.errno)
try:
    socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    print("OPENED dgram pair")
except OSError:
    pass
a, b = socket.socketpair()  # what programs (multiprocessing) need still works
a.sendall(b"ok")
print("stream pair", b.recv(2))
""",
        _all(_ok, _no_line("OPENED"), _printed("stream pair b'ok'")),
    ),
    "unix-socket-kernel-memory-pinning": Attack(  # queued sockets sent in flight and closed hold kernel memory
        """
import array, socket
carrier, sink = socket.socketpair()
pinned = 0
try:
    for _ in range(5000):
        a, b = socket.socketpair()
        a.setblocking(False)
        try:
            while True:
                a.send(b"x" * 65536)
        except BlockingIOError:
            pass
        carrier.sendmsg([b"f"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [a.fileno(), b.fileno()]))])
        a.close()
        b.close()
        pinned += 1
except OSError as exc:
    print("stopped", exc.errno)
print("PINNED", pinned, flush=True)
""",
        lambda result, host: _assert_pinning_bounded(result),
        timeout_s=10.0,
    ),
    "user-namespace-fd-and-other-leaked-fds": Attack(
        """
import os
for fd in sorted(int(x) for x in os.listdir("/proc/self/fd")):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue  # the listing's own fd
    if fd > 2:
        print("LEAKED", fd, target)
""",
        _all(_ok, _no_line("LEAKED")),
    ),
}


def _assert_returned(result: SandboxResult) -> None:
    assert result.error is None
    assert result.returncode is not None or result.timed_out


def _assert_pinning_bounded(result: SandboxResult) -> None:
    pinned = [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("PINNED")]
    assert pinned, result
    assert pinned[0] <= 64, "sockets held in flight are bounded by RLIMIT_NOFILE (the kernel's in-flight limit)"


def _assert_children_bounded(result: SandboxResult) -> None:
    counts = [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("CHILDREN")]
    assert counts, result
    assert counts[0] < 16  # RLIMIT_NPROC (max_processes=16) counts the program itself


def _assert_below_mib(result: SandboxResult, mib: int) -> None:
    assert "stopped at" in result.stdout, result
    assert int(result.stdout.split("stopped at")[1].split()[0]) < mib


def _assert_disk_bounded(result: SandboxResult) -> None:
    stops = [line for line in result.stdout.splitlines() if line.startswith("STOPPED")]
    assert len(stops) == 2, result
    big = stops[0].split()
    assert big[1] in ("ENOSPC", "EFBIG")
    assert int(big[2]) <= 64  # tmp_mb and max_file_mb bound it
    assert stops[1].split()[3] in ("ENOSPC", "EFBIG")


def _assert_output_bounded(result: SandboxResult) -> None:
    assert len(result.stdout) < 5000
    assert "truncated" in result.stdout


def _assert_few_pids(result: SandboxResult) -> None:
    line = next(line for line in result.stdout.splitlines() if line.startswith("PIDS"))
    assert len(json.loads(line.split(" ", 1)[1])) <= 3


_ACCEPTED: dict[int, int] = {}


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP listener on the host's 127.0.0.1 that counts the connections it accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.1)
    port = server.getsockname()[1]
    _ACCEPTED[port] = 0
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            _ACCEPTED[port] += 1
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield port
    stop.set()
    thread.join()
    server.close()


@pytest.fixture
def signals_received() -> Iterator[list[int]]:
    """Record SIGUSR1/SIGTERM sent to this process (instead of dying) while an attack runs."""
    received: list[int] = []
    previous = {s: signal.signal(s, lambda n, f: received.append(n)) for s in (signal.SIGUSR1, signal.SIGTERM)}
    yield received
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@pytest.fixture
def host(tmp_path: Path, listener: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    token = "crfattack" + uuid.uuid4().hex[:12]
    private_tmp = tmp_path / "host-tmp"
    private_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "canary.txt").write_text("canary")
    secret = "sk-or-" + uuid.uuid4().hex
    (canary / "secret.txt").write_text(secret)
    monkeypatch.setenv("OPENROUTER_API_KEY", secret)
    base_purelib = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})["purelib"]
    site_dirs = sorted({*site.getsitepackages(), sysconfig.get_paths()["purelib"], base_purelib, sys.base_prefix})
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # host services listen on abstract sockets too
    abstract.bind("\0crf-" + token)
    abstract.listen()
    yield Host(token, private_tmp, canary, secret, listener, site_dirs)
    abstract.close()


def _leftovers(token: str) -> list[str]:
    """Host processes whose command line or environment holds ``token``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        for name in ("cmdline", "environ"):
            try:
                if token.encode() in Path(f"/proc/{pid}/{name}").read_bytes():
                    found.append(pid)
                    break
            except OSError:
                continue
    return found


def _cleanup_escapes(host: Host) -> None:
    """Remove anything an attack managed to write (so a failing run does not pollute the machine)."""
    base_purelib = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})["purelib"]
    folders = [os.getcwd(), str(Path.home()), "/etc", "/usr", "/", "/tmp", "/var/tmp", "/dev/shm"]
    folders += [*host.site_dirs, sys.prefix, sys.base_prefix, base_purelib]
    for folder in folders:
        for name in (f"escape-{host.token}", f"crf_attack_{host.token}.pth", host.token):
            with contextlib.suppress(OSError):
                Path(folder, name).unlink(missing_ok=True)


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_contained(name: str, host: Host, signals_received: list[int]) -> None:
    _contained(name, host, signals_received, None)


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_contained_in_the_pool(
    name: str, host: Host, signals_received: list[int], sandbox_pool: SandboxPool
) -> None:
    """The same attacks against the warm pool (``SandboxPool``), each run twice: the second run must be unaffected."""
    _contained(name, host, signals_received, sandbox_pool)


def _contained(name: str, host: Host, signals_received: list[int], pool: SandboxPool | None) -> None:
    attack = ATTACKS[name]
    runs = 2 if name == "dev-shm-persistence" or pool is not None else 1
    try:
        for _ in range(runs):
            start = time.monotonic()
            result = run_python(
                host.program_header() + attack.program,
                timeout_s=attack.timeout_s,
                extra_env={"CRF_ATTACK_TOKEN": host.token},
                pool=pool,
                **dict(attack.kwargs),
            )
            elapsed = time.monotonic() - start
            assert result.error is None, result.error
            assert elapsed < attack.timeout_s + TIME_BOUND_S, f"returned after {elapsed:.1f} s"
            attack.check(result, host)
            assert _leftovers(host.token) == [], "a process the program started is still running"
            assert list(host.tmp.iterdir()) == [], "the sandbox left files in the host's temp folder"
        assert signals_received == [], "the program signalled the trainer"
        _canary_intact(result, host)
    finally:
        _cleanup_escapes(host)


READ_TRAINER_ENVIRON = """
import os
found = []
for pid in ["TRAINER_PID", "1", "2"] + [p for p in os.listdir("/proc") if p.isdigit()]:
    for name in ("environ", "cmdline"):
        try:
            found.append(open(f"/proc/{pid}/{name}", "rb").read().decode(errors="replace"))
        except OSError:
            pass
print(os.environ)
print("\\n".join(found))
"""
TRAINER = """
import json, os, sys
from crf_core.rewards import run_python
result = run_python(sys.stdin.read().replace("TRAINER_PID", str(os.getpid())), isolation=sys.argv[1])
print(json.dumps([result.stdout, result.stderr, result.error]))
"""


def test_attack_read_trainer_environ_through_proc_is_contained() -> None:
    """The trainer's API key (in its real environment, so in /proc/<pid>/environ) is out of the program's reach."""
    secret = "sk-or-" + uuid.uuid4().hex
    trainer = subprocess.run(
        [sys.executable, "-c", TRAINER, "bwrap"],
        input=READ_TRAINER_ENVIRON,
        capture_output=True,
        text=True,
        env={**os.environ, "OPENROUTER_API_KEY": secret},
        timeout=60,
    )
    assert trainer.returncode == 0, trainer.stderr
    stdout, stderr, error = json.loads(trainer.stdout)
    assert error is None
    assert "environ(" in stdout  # the program ran and printed what it could read
    assert secret not in stdout + stderr


def test_pth_attack_did_not_reach_a_fresh_interpreter(host: Host) -> None:
    run_python(host.program_header() + ATTACKS["pth-into-site-packages"].program)
    try:
        fresh = subprocess.run(
            [sys.executable, "-c", "import os; print(os.environ.get('CRF_PWNED'))"], capture_output=True, text=True
        )
        assert fresh.stdout.strip() == "None"
    finally:
        _cleanup_escapes(host)


SEPARATE_ATTACKS = (
    "read-trainer-environ-through-proc",
    "forking-sibling-starves-an-honest-one",
    "zombie-bwrap-left-to-init",
)  # its own test above: it needs a second trainer process


def test_the_suite_counts_its_attacks() -> None:
    """The figure quoted in the docs: attacks tried against the sandbox (each must be contained above)."""
    assert len(ATTACKS) + len(SEPARATE_ATTACKS) == 29


def test_attack_forking_sibling_starves_an_honest_one(host: Host) -> None:
    """Concurrent sandboxes do not share RLIMIT_NPROC: a sibling holding all its processes does not starve another."""
    attacker = """
import os, sys, time
for _ in range(64):
    try:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
    except OSError:
        break
print("holding", flush=True)
time.sleep(5)
"""
    honest = """
import threading
from multiprocessing import Pool
out = []
threads = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
with Pool(2) as pool:
    print("HONEST", sorted(out) == list(range(8)), pool.map(abs, [-1, -2]))
"""
    with ThreadPoolExecutor(max_workers=3) as pool:
        attacks = [pool.submit(run_python, host.program_header() + attacker, timeout_s=4.0) for _ in range(2)]
        time.sleep(1.5)  # the attackers hold their processes
        result = run_python(honest, timeout_s=10.0)
        for attack in attacks:
            assert attack.result().error is None
    assert result.ok, result
    assert "HONEST True [1, 2]" in result.stdout


REAPER = """
import ctypes, json, os, time
from crf_core.rewards import run_python
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of our runs come here
for program, timeout in (("print(1)", 3.0), ("import os; os.abort()", 3.0), ("import time; time.sleep(60)", 0.5)):
    for _ in range(3):
        run_python(program, timeout_s=timeout)
time.sleep(0.3)
orphans = []
for pid in os.listdir("/proc"):
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        continue
    if int(fields[1]) == os.getpid():
        orphans.append([int(pid), fields[0], open(f"/proc/{pid}/comm").read().strip()])
print(json.dumps(orphans))
"""


def test_attack_zombie_bwrap_left_to_init_is_contained() -> None:
    """Every bubblewrap process is reaped, after a normal exit, a crash and a timeout alike (none left for init).

    The runs happen in a child subreaper, so whatever they orphan is reparented to it (not to the host's init,
    where other users' zombies also land) and counted.
    """
    done = subprocess.run([sys.executable, "-c", REAPER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_no_descriptor_of_the_trainer_leaks_across_runs() -> None:
    """Pipes, pidfds and the status stream of every run are closed again, whatever the program did."""
    run_python("print(1)")  # the one-time user namespace (root) and the bubblewrap check

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    for program, timeout in (("print(1)", 3.0), ("import time; time.sleep(60)", 0.5), ("import os; os.close(1)", 3.0)):
        for _ in range(2):
            run_python(program, timeout_s=timeout)
    assert open_fds() == before
