"""The warm sandbox pool (``SandboxPool``, ``run_python(pool=...)``): same results as a fresh sandbox, nothing kept.

Honest programs give the per-run sandbox's result; the attacks are aimed at what a warm pool could share between
evaluations (files, processes, modules, environment, descriptors, the zygote itself, concurrent evaluations).
``POOL_ATTACKS`` counts them for the docs and the report.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from crf_core.rewards import SandboxPool, SandboxResult, UnitTestReward, run_python

HONEST = {
    "print": "print('hello', 42)",
    "stdin": "import sys; data = sys.stdin.read(); print(len(data), data[:5])",
    "exit-code": "raise SystemExit(7)",
    "exit-message": "import sys; sys.exit('bye')",
    "exception": "def f():\n    raise ValueError('x')\nf()",
    "syntax-error": "def f(:\n    pass",
    "killed-by-signal": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    "name-and-argv": "import sys; print(__name__, sys.argv, __file__)",
    "cwd-home-env": "import os; print(os.getcwd(), os.environ['HOME'], os.environ.get('EXTRA'), sorted(os.environ))",
    "non-daemon-thread-finishes": (
        "import threading, time\n"
        "def late():\n    time.sleep(0.2)\n    print('late', flush=True)\n"
        "threading.Thread(target=late).start()\nprint('main')"
    ),
    "atexit": "import atexit; atexit.register(lambda: print('bye'))\nprint('hi')",
    "unflushed-output": "import sys; sys.stdout.write('no newline')",
    "multiprocessing-pool": (
        "from multiprocessing import Pool\n"
        "if __name__ == '__main__':\n    with Pool(2) as p:\n        print(p.map(abs, [-1, -2, 3]))"
    ),
    "tmp-files": "open('x.txt', 'w').write('a' * 1000); import os; print(os.listdir('.'))",
    "exit-with-broken-builtins": "import builtins\nprint('x')\nbuiltins.len = lambda x: 0",
    "modules": "import sys; print('json' in sys.modules, 'ctypes' in sys.modules, 'socket' in sys.modules)",
}


def _comparable(result: SandboxResult) -> tuple[object, ...]:
    last = result.stderr.strip().splitlines()[-1:] if result.stderr.strip() else []
    return result.returncode, result.timed_out, result.stdout, last, result.error


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_program_same_result_as_a_fresh_sandbox(name: str, sandbox_pool: SandboxPool) -> None:
    code = HONEST[name]
    kwargs = {"stdin": "abcdefgh", "extra_env": {"EXTRA": "1"}, "timeout_s": 20.0}
    fresh = run_python(code, **kwargs)  # type: ignore[arg-type]
    pooled = run_python(code, pool=sandbox_pool, **kwargs)  # type: ignore[arg-type]
    assert _comparable(pooled) == _comparable(fresh), (pooled, fresh)


PRIVILEGES = """
import os
keys = ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb', 'NoNewPrivs', 'Seccomp', 'Seccomp_filters', 'Groups')
print(''.join(line for line in open('/proc/self/status') if line.split(':')[0] in keys))
print(os.getuid() != 0, os.getuid() == os.geteuid(), sorted(os.listdir('/proc/self/fd')))
"""


def test_pool_program_has_the_fresh_sandboxs_privileges(sandbox_pool: SandboxPool) -> None:
    """Capabilities (bounding and inheritable sets too), no_new_privs, seccomp, groups and uid as in a fresh sandbox."""
    fresh = run_python(PRIVILEGES)
    pooled = run_python(PRIVILEGES, pool=sandbox_pool)
    assert fresh.ok, fresh
    assert pooled.stdout == fresh.stdout


def test_unit_test_reward_pool_scores_like_the_fresh_sandbox() -> None:
    tests = ["assert add(1, 2) == 3", "assert add(0, 5) == 5", "assert add(-1, 8) == 7"]
    programs = ["def add(a, b):\n    return a + b\n", "def add(a, b):\n    return 3\n", "def add(a, b):\n    1/0\n"]
    pooled = _pool_reward()
    try:
        fresh = UnitTestReward(prepend_prompt=False, timeout_s=10.0)
        args = (["", "", ""], programs)
        assert pooled(*args, tests=[tests] * 3) == fresh(*args, tests=[tests] * 3) == [1.0, 1 / 3, 0.0]
    finally:
        assert pooled.pool is not None
        pooled.pool.close()


def _pool_reward() -> UnitTestReward:
    if os.geteuid() != 0:
        pytest.skip("the warm sandbox pool needs a root trainer (it refuses otherwise)")
    return UnitTestReward(prepend_prompt=False, timeout_s=10.0, warm_pool=True)


# Each attack: (program run first, program run next in the same worker, what the second must print).
LEAVE_STATE = """
import builtins, json, os, signal, subprocess, sys, threading, time
open('/tmp/left.txt', 'w').write('x')
open('/dev/shm/left', 'w').write('x')
open('left-in-cwd.txt', 'w').write('x')
os.environ['LEFT'] = '1'
os.putenv('LEFT_C', '1')
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
if os.fork() == 0:
    os.setsid()
    time.sleep(30)
    os._exit(0)
subprocess.Popen(['sleep', '30'], start_new_session=True)
kept = [os.open('/tmp/left.txt', os.O_RDONLY) for _ in range(5)]
os.dup2(kept[0], 40)
sys.setrecursionlimit(50)
sys.path.insert(0, '/tmp')
os.umask(0o777)
os.chdir('/proc')
json.dumps = lambda *a, **k: 'forged'
sys.modules['math'] = 'forged'
builtins.print = lambda *a, **k: None
builtins.len = lambda x: 0
"""
CHECK_STATE = """
import builtins, json, os, signal, sys, threading
checks = {
    'tmp': os.listdir('/tmp') == ['main.py'],
    'shm': os.listdir('/dev/shm') == [],
    'cwd': os.getcwd() == '/tmp',
    'print': builtins.print.__module__ == 'builtins' and builtins.len([1]) == 1,
    'json': json.dumps(1) == '1',
    'math': 'math' not in sys.modules or not isinstance(sys.modules['math'], str),
    'environ': 'LEFT' not in os.environ and os.getenv('LEFT_C') is None,
    'signals': signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    'threads': threading.active_count() == 1,
    'processes': sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == [1, os.getpid()],
    'fds': sorted(int(f) for f in os.listdir('/proc/self/fd')) == [0, 1, 2, 3],
    'recursion': sys.getrecursionlimit() == 1000,
    'path': '/tmp' not in sys.path,
    'umask': os.umask(0o22) == 0o22,
}
print(sorted(name for name, ok in checks.items() if not ok))
"""


def test_attack_state_left_for_the_next_evaluation(sandbox_pool: SandboxPool) -> None:
    with SandboxPool(1) as pool:  # one worker: the next evaluation is certainly forked by the same zygote
        first = run_python(LEAVE_STATE, pool=pool, timeout_s=10.0)
        assert first.ok, first
        second = run_python(CHECK_STATE, pool=pool, timeout_s=10.0)
        fresh = run_python(CHECK_STATE, timeout_s=10.0)
    assert fresh.stdout.strip() == "[]", fresh  # the check itself holds in a fresh sandbox
    assert second.stdout.strip() == "[]", second


ZYGOTE_KILLERS = {
    "kill-parent": "import os, signal\nfor s in (signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV):\n    try: os.kill(os.getppid(), s)\n    except OSError as e: print(e)\n",
    "kill-everything": "import os, signal\nfor pid in (-1, 0, 1, 2):\n    try: os.kill(pid, signal.SIGKILL)\n    except OSError as e: print(e)\n",
    "kill-proc-listed": (
        "import os, signal\nfor p in os.listdir('/proc'):\n    if p.isdigit() and int(p) != os.getpid():\n"
        "        try: os.kill(int(p), signal.SIGKILL)\n        except OSError as e: print(e)\n"
    ),
    "close-every-fd": "import os\nos.closerange(0, 1 << 16)\nos._exit(0)\n",
    "write-to-parent-fds": (
        "import os\nfor fd in range(3, 64):\n    try: os.write(fd, b'X\\x00\\x00\\x00\\x00' * 100)\n    except OSError: pass\n"
    ),
}


@pytest.mark.parametrize("name", sorted(ZYGOTE_KILLERS))
def test_attack_on_the_zygote_costs_nothing_to_the_next_evaluation(name: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("the warm sandbox pool needs a root trainer (it refuses otherwise)")
    with SandboxPool(1) as pool:
        run_python("pass", pool=pool)
        (worker,) = pool._idle
        attacked = run_python(ZYGOTE_KILLERS[name], pool=pool, timeout_s=5.0)
        assert attacked.error is None, attacked
        assert not attacked.timed_out, attacked
        after = run_python("print(6 * 7)", pool=pool, timeout_s=10.0)
        assert after.ok, after
        assert after.stdout == "42\n", after
        assert pool._idle == [worker], "the zygote survived (it was never reachable)"


def test_a_zygote_killed_from_outside_costs_one_evaluation_and_a_restart() -> None:
    """Simulates a corrupted zygote: the running evaluation fails with an error (never a reward), the next runs."""
    if os.geteuid() != 0:
        pytest.skip("the warm sandbox pool needs a root trainer (it refuses otherwise)")
    with SandboxPool(1) as pool:
        run_python("pass", pool=pool)
        (worker,) = pool._idle
        assert worker.pid1fd is not None
        threading.Timer(0.5, lambda: signal.pidfd_send_signal(worker.pid1fd, signal.SIGKILL)).start()  # type: ignore[arg-type]
        start = time.monotonic()
        hit = run_python("import time; time.sleep(3); print('done')", pool=pool, timeout_s=10.0)
        assert time.monotonic() - start < 5.0
        assert hit.error is not None, hit
        assert "replaced" in hit.error, hit
        assert hit.stdout == ""
        after = run_python("print(1)", pool=pool, timeout_s=10.0)
        assert after.ok, after
        assert after.stdout == "1\n", after
        assert pool._idle != [worker]


FORK_BOMB = """
import os, time
print('bombing', flush=True)
while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.01)
"""
SLEEPER = "import os, time\nif os.fork() == 0:\n    os.setsid()\nwhile True:\n    time.sleep(1)\n"
HONEST_WORK = "import os, subprocess, sys\nprint(subprocess.run([sys.executable, '-c', 'print(5)'], capture_output=True).stdout.decode().strip(), os.getuid())"


@pytest.mark.parametrize("hostile", ["fork-bomb", "sleeper"])
def test_attack_hostile_evaluation_does_not_affect_a_concurrent_one(hostile: str, sandbox_pool: SandboxPool) -> None:
    token = "crfpool" + uuid.uuid4().hex[:12]
    program = FORK_BOMB if hostile == "fork-bomb" else SLEEPER
    with ThreadPoolExecutor(2) as executor:
        bad = executor.submit(run_python, program, pool=sandbox_pool, timeout_s=3.0, extra_env={"T": token})
        time.sleep(0.5)
        good = executor.submit(run_python, HONEST_WORK, pool=sandbox_pool, timeout_s=20.0)
        honest, hostile_result = good.result(), bad.result()
    assert honest.ok, honest
    assert honest.stdout.split()[0] == "5", honest
    assert hostile_result.timed_out, hostile_result
    assert hostile_result.error is None, hostile_result
    assert _host_processes_with(token) == []
    after = run_python(HONEST_WORK, pool=sandbox_pool, timeout_s=20.0)
    assert after.ok, after


def test_attack_hanging_past_the_time_limit_returns_in_time(sandbox_pool: SandboxPool) -> None:
    for program in ("while True: pass", "import os; os.close(1); os.close(2)\nwhile True: pass", SLEEPER):
        start = time.monotonic()
        result = run_python(program, pool=sandbox_pool, timeout_s=1.0)
        assert result.timed_out, result
        assert result.returncode is None, result
        assert time.monotonic() - start < 1.0 + 5.0
    assert run_python("print(1)", pool=sandbox_pool).stdout == "1\n"


SECRET_HOLDER = """
import os, sys, time
secret = sys.stdin.read()
open('/tmp/secret.txt', 'w').write(secret)
open('/dev/shm/secret', 'w').write(secret)
os.environ['SECRET'] = secret
print(os.getuid(), flush=True)
time.sleep(4)
"""
SECRET_HUNTER = """
import os
found = []
for folder in ('/tmp', '/dev/shm'):
    for name in os.listdir(folder):
        try:
            found.append(open(os.path.join(folder, name), errors='replace').read())
        except OSError:
            pass
for pid in os.listdir('/proc'):
    if pid.isdigit():
        for name in ('environ', 'cmdline'):
            try:
                found.append(open(f'/proc/{pid}/{name}', 'rb').read().decode(errors='replace'))
            except OSError:
                pass
print(os.getuid())
print('\\n'.join(found))
"""


def test_attack_reading_another_evaluations_data(sandbox_pool: SandboxPool) -> None:
    secret = "crfsecret" + uuid.uuid4().hex
    with ThreadPoolExecutor(2) as executor:
        holder = executor.submit(run_python, SECRET_HOLDER, stdin=secret, pool=sandbox_pool, timeout_s=10.0)
        time.sleep(1.0)
        hunter = run_python(SECRET_HUNTER, pool=sandbox_pool, timeout_s=10.0)
        held = holder.result()
    assert held.ok, held
    assert hunter.ok, hunter
    assert secret not in hunter.stdout + hunter.stderr
    assert held.stdout.split()[0] != hunter.stdout.split()[0], "concurrent evaluations share a uid"


def test_no_descriptor_or_process_of_the_trainer_leaks_across_pool_runs(sandbox_pool: SandboxPool) -> None:
    for _ in range(3):
        run_python("print(1)", pool=sandbox_pool)
    before = sorted(os.listdir("/proc/self/fd"))
    for program in ("print(1)", "while True: pass", "import os; os._exit(3)"):
        run_python(program, pool=sandbox_pool, timeout_s=1.0)
    assert sorted(os.listdir("/proc/self/fd")) == before


def test_pool_options_are_validated(sandbox_pool: SandboxPool) -> None:
    with pytest.raises(ValueError, match="workers"):
        SandboxPool(0)
    with pytest.raises(ValueError, match="workers"):
        SandboxPool(True)
    with pytest.raises(TypeError, match="preload"):
        SandboxPool(1, preload="print(1)")
    with pytest.raises(ValueError, match="isolation='bwrap'"):
        run_python("pass", pool=sandbox_pool, isolation="rlimits")
    with pytest.raises(TypeError, match="SandboxPool"):
        run_python("pass", pool="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", pool=sandbox_pool, timeout_s=0)
    with pytest.raises(TypeError, match="warm_pool"):
        UnitTestReward(warm_pool=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warm_pool"):
        UnitTestReward(warm_pool=True, isolation="rlimits")


def test_closed_pool_returns_an_error() -> None:
    if os.geteuid() != 0:
        pytest.skip("the warm sandbox pool needs a root trainer (it refuses otherwise)")
    pool = SandboxPool(1)
    assert run_python("print(1)", pool=pool).ok
    pool.close()
    result = run_python("print(1)", pool=pool)
    assert result.error is not None
    assert "closed" in result.error


def _host_processes_with(token: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                if token.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                    found.append(pid)
            except OSError:
                continue
    return found


POOL_ATTACKS = 1 + len(ZYGOTE_KILLERS) + 1 + 2 + 3 + 1  # state, zygote killers, outside kill, concurrent, hangs, data


def test_the_suite_counts_its_attacks() -> None:
    assert POOL_ATTACKS == 13


SIGNAL_STATE = (
    "import signal\n"
    "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
    "signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "
    "signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN)"
)


def test_the_program_starts_with_pythons_signal_state_whatever_the_trainer_ignores() -> None:
    """A trainer run as a shell's background job ignores SIGINT and SIGQUIT, and exec hands ignored signals down:
    the program still starts as ``python file.py`` does (fresh sandbox and pool, the pool started meanwhile)."""
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM)}
    try:
        with SandboxPool(1) as pool:
            results = [run_python(SIGNAL_STATE, timeout_s=10.0), run_python(SIGNAL_STATE, pool=pool, timeout_s=10.0)]
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    for result in results:
        assert result.stdout.strip() == "True True True True", result
