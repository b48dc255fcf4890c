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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from crf_core.rewards import SandboxResult, run_python

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
}


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
    attack = ATTACKS[name]
    runs = 2 if name == "dev-shm-persistence" else 1
    try:
        for _ in range(runs):
            start = time.monotonic()
            result = run_python(
                host.program_header() + attack.program,
                timeout_s=attack.timeout_s,
                extra_env={"CRF_ATTACK_TOKEN": host.token},
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


SEPARATE_ATTACKS = ("read-trainer-environ-through-proc",)  # its own test above: it needs a second trainer process


def test_the_suite_counts_its_attacks() -> None:
    """The figure quoted in the docs: attacks tried against the sandbox (each must be contained above)."""
    assert len(ATTACKS) + len(SEPARATE_ATTACKS) == 22
