"""Adversarial suite for UnitTestReward: programs that try to game the reward, and forged harness records.

Every exploit issue 11 found against the old reward (frame-read nonce, patched ``exec``, an always-equal object,
forged tallies) plus the ways a program can lie to a harness it shares a process with. Each scores 0 (or what the
honest part of the program earns), stays in [0, 1], never raises, returns within the time bound, and reports
bounded feedback. ``FORGED_RECORDS`` feeds hostile record text straight to the trainer-side parser.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from crf_core.rewards import SandboxPool, UnitTestReward
from crf_core.rewards.record import MalformedRecord, parse_record

pytestmark = pytest.mark.usefixtures("bwrap")
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(0, 5) == 5", "assert add(-1, 8) == 7"]
WRONG_ADD = "def add(a, b):\n    return 12345\n"
FIND_CHANNEL = """
import os
def channels():  # the harness's record channel: a copy of the original stdout, somewhere above fd 2
    for fd in range(3, 64):
        try:
            os.fstat(fd)
        except OSError:
            continue
        yield fd
"""


LIAR = """
import math
class Liar:
    def __sub__(self, other): return 0.0
    __rsub__ = __add__ = __radd__ = __mul__ = __rmul__ = __pow__ = __sub__
    def __truediv__(self, other): return 0.0
    __rtruediv__ = __truediv__
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    __le__ = __gt__ = __ge__ = __lt__
    def __str__(self): return "True"
    __repr__ = __format__ = __str__
    def __round__(self, n=None): return 0
    def __abs__(self): return 0.0
    def __float__(self): return 3.14159
    def __bool__(self): return True
    def __len__(self): return 3
    def __iter__(self): return iter([1, 2, 3])
    __hash__ = object.__hash__
class FloatLiar(float):
    pass
for _name in ("__sub__", "__rsub__", "__truediv__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
              "__str__", "__repr__", "__round__", "__abs__", "__pow__", "__bool__"):
    setattr(FloatLiar, _name, getattr(Liar, _name))
math.fabs = lambda x: 0.0
def area(r):
    return Liar() if r == 1 else FloatLiar(100.0)
"""
TOLERANCE_SHAPES = [
    "assert math.fabs(area({r}) - 3.14159) < 1e-6",
    "assert abs((area({r}) - 3.14159) / 3.14159) < 1e-6",
    "assert (area({r}) - 3.14159) ** 2 < 1e-9",
    "assert round(area({r}) - 3.14159, 9) == 0",
    "assert str(area({r}) == 3.14159) == 'True'",
    "assert [area({r}) == 3.14159] == [True]",
    "assert abs(area({r}) - 3.14159) <= 1e-6",
    "assert sorted([area({r})]) == [3.14159]",
    "assert len(str(area({r}))) == 4",
]

# name: (program, tests, expected reward)
REWARD_ATTACKS: dict[str, tuple[str, list[str], float]] = {
    # -- the exploits issue 11 reported -------------------------------------------------------------------------
    "frame-read-forged-pass-line-then-exit": (
        WRONG_ADD
        + """
import os, sys
frame = sys._getframe(1)
secrets = {k: repr(v)[:200] for k, v in frame.f_globals.items()}
forged = '{"load":null}\\n' + '{"value":["b",true]}\\n' * 3 + '{"end":3}\\n'
os.write(1, forged.encode())
os.write(1, ("CRF-RESULT " + str(secrets) + " 3 3\\n").encode())
os._exit(0)
""",
        ADD_TESTS,
        0.0,
    ),
    "builtins-exec-eval-compile-patched": (
        WRONG_ADD
        + """
import builtins
builtins.exec = lambda *a, **k: None
builtins.eval = lambda *a, **k: 3
builtins.compile = lambda *a, **k: None
""",
        ADD_TESTS,
        0.0,
    ),
    "always-equal-object": (
        """
class Always:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __bool__(self): return True
    __hash__ = object.__hash__
def add(a, b):
    return Always()
""",
        ADD_TESTS,
        0.0,
    ),
    "always-equal-int-subclass": (
        "class I(int):\n    def __eq__(self, other): return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return I(999)\n",
        ADD_TESTS,
        0.0,
    ),
    "forged-negative-tally": (WRONG_ADD + "print('CRF-RESULT 0000 -1000 3')\n", ADD_TESTS, 0.0),
    "forged-string-tally": (WRONG_ADD + "print('CRF-RESULT 0000 x 3')\nprint('CRF-RESULT x')\n", ADD_TESTS, 0.0),
    # -- lying to the harness it shares a process with ----------------------------------------------------------
    "claim-true-on-the-channel-then-exit": (
        WRONG_ADD
        + FIND_CHANNEL
        + """
forged = '{"load":null}\\n' + '{"value":["b",true]}\\n' * 3 + '{"end":3}\\n'
for fd in channels():
    os.write(fd, forged.encode())
os._exit(0)
""",
        ADD_TESTS,
        0.0,
    ),
    "forged-record-before-the-harness-writes": (
        WRONG_ADD
        + FIND_CHANNEL
        + """
forged = '{"load":null}\\n' + '{"value":["i","3"]}\\n' * 3 + '{"end":3}\\n'
for fd in channels():
    os.write(fd, forged.encode())
""",
        ADD_TESTS,
        0.0,
    ),
    "partial-record-then-exit": (
        'import os\ndef add(a, b):\n    os.write(3, b\'{"value": ["i", "3"]\')\n    os._exit(0)\n',
        ADD_TESTS,
        0.0,
    ),
    "close-every-descriptor": (
        WRONG_ADD + FIND_CHANNEL + "for fd in list(channels()):\n    os.close(fd)\n",
        ADD_TESTS,
        0.0,
    ),
    "fork-a-forger": (
        WRONG_ADD
        + FIND_CHANNEL
        + """
if os.fork() == 0:
    for fd in channels():
        os.write(fd, b'{"end":3}\\n')
    os._exit(0)
os.wait()
""",
        ADD_TESTS,
        0.0,
    ),
    "print-a-record-on-stdout": (
        WRONG_ADD + 'print(\'{"load":null}\')\nprint(\'{"value":["i","3"]}\')\nprint(\'{"end":3}\')\n',
        ADD_TESTS,
        0.0,
    ),
    "steal-expected-values": (  # the expected values never enter the sandbox, so nothing can be found
        """
import gc, sys
def add(a, b):
    target = 987654320 + (a - 1) + (b - 1)  # 987654321 for add(1, 2), computed so the source does not hold it
    text = str(target)
    def leaked(value):
        return value is not target and value is not text and (value == target or value == text)
    def values(obj):
        if isinstance(obj, dict):
            return list(obj.values()) + list(obj.keys())
        if isinstance(obj, (list, tuple, set, frozenset)):
            return list(obj)
        return []
    found = text in sys.stdin.read()
    for obj in gc.get_objects():
        found = found or any(leaked(v) for v in values(obj))
    frame = sys._getframe().f_back
    while frame is not None:
        found = found or any(leaked(v) for v in values(frame.f_locals) + values(frame.f_globals))
        frame = frame.f_back
    for path in ("/proc/self/cmdline", "/proc/self/environ", "/proc/1/cmdline", "main.py"):
        try:
            found = found or text in open(path, "rb").read().decode(errors="replace")
        except OSError:
            pass
    return target if found else 0
""",
        ["assert add(1, 2) == 987654321"],
        0.0,
    ),
    "patched-isinstance-for-a-type-test": (
        "import builtins\nbuiltins.isinstance = lambda *a: True\ndef to_int(s):\n    return s\n",
        ["assert isinstance(to_int('1'), int)"],
        0.0,
    ),
    "patched-abs-for-a-tolerance-test": (
        "import builtins\nbuiltins.abs = lambda x: 0\ndef area(r):\n    return 100.0\n",
        ["assert abs(area(1) - 3.14159) < 1e-3", "assert abs(3.14159 - area(1)) <= 1e-3"],
        0.0,
    ),
    # -- operators of the test applied to candidate objects (issue 21): they run on the trainer side now ---------
    "lying-operators-object-in-tolerance-shapes": (LIAR, [t.format(r=1) for t in TOLERANCE_SHAPES], 0.0),
    "lying-operators-float-subclass-in-tolerance-shapes": (LIAR, [t.format(r=2) for t in TOLERANCE_SHAPES], 0.0),
    "lying-str-subclass": (
        "class S(str):\n    def __eq__(self, o): return True\n    __hash__ = str.__hash__\n"
        "    def __len__(self): return 3\n    def lower(self): return 'abc'\n"
        "def f(x):\n    return S('zzzz')\n",
        ["assert f(1) == 'abc'", "assert len(f(1)) == 3", "assert f(1).lower() == 'abc'"],
        0.0,
    ),
    "lying-list-subclass": (
        "class L(list):\n    def __eq__(self, o): return True\n    def __iter__(self): return iter([1, 2])\n"
        "    def __len__(self): return 2\n"
        "def f(x):\n    return L([9, 9, 9])\n",
        ["assert f(1) == [1, 2]", "assert sorted(f(1)) == [1, 2]", "assert len(f(1)) == 2"],
        0.0,
    ),
    # -- crashing or flooding the harness -----------------------------------------------------------------------
    "sys-exit-at-load": (WRONG_ADD + "import sys\nsys.exit(0)\n", ADD_TESTS, 0.0),
    "os-exit-inside-the-function": ("import os\ndef add(a, b):\n    os._exit(0)\n", ADD_TESTS, 0.0),
    "base-exceptions-from-the-function": (
        "def add(a, b):\n    raise (SystemExit, KeyboardInterrupt, GeneratorExit)[a % 3]()\n",
        ADD_TESTS,
        0.0,
    ),
    "exception-with-hostile-str": (
        "class E(Exception):\n    def __str__(self): raise E()\n"
        "class F(Exception):\n    def __str__(self): return 'x' * 10**7\n"
        "def add(a, b):\n    raise (E if a > 0 else F)()\n",
        ADD_TESTS,
        0.0,
    ),
    "huge-return-value": ("def add(a, b):\n    return list(range(2_000_000))\n", ADD_TESTS, 0.0),
    "deeply-nested-return-value": (
        "def add(a, b):\n    x = []\n    for _ in range(100000):\n        x = [x]\n    return x\n",
        ADD_TESTS,
        0.0,
    ),
    "self-referential-return-value": ("def add(a, b):\n    x = [1]\n    x.append(x)\n    return x\n", ADD_TESTS, 0.0),
    "stderr-flood": (
        "import sys\ndef add(a, b):\n    sys.stderr.write('z' * 50_000_000)\n    return 0\n",
        ADD_TESTS,
        0.0,
    ),
    "time-bomb": ("import time\ndef add(a, b):\n    time.sleep(3600)\n", ADD_TESTS, 0.0),
    "null-bytes-and-surrogates": ("def add(a, b):\n    return '\\udc80\\x00'\n\x00", ADD_TESTS, 0.0),
    # -- partly honest: the honest part is what scores ----------------------------------------------------------
    "honest-function-with-harness-tampering": (
        "import builtins\nbuiltins.eval = lambda *a, **k: 3\nbuiltins.exec = lambda *a, **k: None\n"
        "def add(a, b):\n    return a + b\n",
        ADD_TESTS,
        1.0,
    ),
}


@pytest.fixture(scope="module")
def reward() -> UnitTestReward:
    return UnitTestReward(prepend_prompt=False, timeout_s=2.0)


@pytest.fixture(scope="module")
def pool_reward(sandbox_pool: SandboxPool) -> Iterator[UnitTestReward]:
    """``UnitTestReward(warm_pool=True)`` (skipped, like ``sandbox_pool``, without bubblewrap or root)."""
    scorer = UnitTestReward(prepend_prompt=False, timeout_s=2.0, warm_pool=True)
    yield scorer
    assert scorer.pool is not None
    scorer.pool.close()


@pytest.mark.parametrize("name", sorted(REWARD_ATTACKS))
def test_reward_exploit_is_contained(name: str, reward: UnitTestReward) -> None:
    _exploit_contained(name, reward)


@pytest.mark.parametrize("name", sorted(REWARD_ATTACKS))
def test_reward_exploit_is_contained_in_the_pool(name: str, pool_reward: UnitTestReward) -> None:
    _exploit_contained(name, pool_reward)
    _exploit_contained(name, pool_reward)  # and the next evaluation of the same worker is unaffected


def _exploit_contained(name: str, reward: UnitTestReward) -> None:
    program, tests, expected = REWARD_ATTACKS[name]
    logged: dict[str, list[object]] = {}
    start = time.monotonic()
    scores = reward([""], [program], tests=[tests], log_extra=lambda k, v: logged.update({k: v}))
    assert time.monotonic() - start < reward.timeout_s + 30.0  # the exploits run for an hour or forever otherwise
    assert scores == [expected], logged["feedback"]
    assert all(0.0 <= s <= 1.0 for s in scores)
    (feedback,) = logged["feedback"]
    assert isinstance(feedback, str)
    assert len(feedback) <= reward.max_feedback_chars
    assert (feedback == "") is (expected == 1.0)


# Honest programs that must score what they would earn under `python file.py` (issue 21): name: (program, tests, reward)
BIG_LIST = "def big(i):\n    return list(range(i, i + 30_000))\n"
HONEST_PROGRAMS: dict[str, tuple[str, list[str], float]] = {
    "dataclass": (
        "from dataclasses import dataclass, field\n@dataclass(frozen=True)\nclass P:\n    x: int\n"
        "    tags: list = field(default_factory=list)\ndef make(x):\n    return P(x).x\n",
        ["assert make(3) == 3"],
        1.0,
    ),
    "no-inherited-future-annotations": (
        "def g(x: int) -> int:\n    return x\ndef annotation():\n    return g.__annotations__['x'] is int\n",
        ["assert annotation() is True"],
        1.0,
    ),
    "pickle-of-own-class": (
        "import pickle\nclass K:\n    def __init__(self, v):\n        self.v = v\n"
        "def roundtrip(v):\n    return pickle.loads(pickle.dumps(K(v))).v\n",
        ["assert roundtrip(5) == 5"],
        1.0,
    ),
    "main-module-like-python-file": (
        "import sys\nRAN = False\nif __name__ == '__main__':\n    RAN = True\n"
        "def ran():\n    return RAN and sys.modules['__main__'].ran is ran\n",
        ["assert ran()"],
        1.0,
    ),
    "threads": (
        "import threading\nfrom concurrent.futures import ThreadPoolExecutor\ndef par(n):\n    out = []\n"
        "    ts = [threading.Thread(target=out.append, args=(i,)) for i in range(n)]\n"
        "    [t.start() for t in ts]\n    [t.join() for t in ts]\n"
        "    with ThreadPoolExecutor(4) as pool:\n        out += pool.map(lambda x: x * 10, range(n))\n"
        "    return sorted(out)\n",
        ["assert par(3) == [0, 0, 1, 2, 10, 20]"],
        1.0,
    ),
    "thread-pool-with-semaphores": (
        "from multiprocessing.pool import ThreadPool\nimport threading\nlock = threading.Semaphore(2)\n"
        "def sq(x):\n    with lock:\n        return x * x\ndef run(xs):\n    with ThreadPool(3) as pool:\n"
        "        return pool.map(sq, xs)\n",
        ["assert run([1, 2, 3]) == [1, 4, 9]"],
        1.0,
    ),
    "multiprocessing-pool": (
        "from multiprocessing import Pool\ndef sq(x):\n    return x * x\ndef run(xs):\n"
        "    with Pool(2) as pool:\n        return pool.map(sq, xs)\n",
        ["assert run([1, 2, 3]) == [1, 4, 9]"],
        1.0,
    ),
    "multiprocessing-process-and-queue": (
        "import multiprocessing as mp\ndef work(q, x):\n    q.put(x + 1)\ndef run(x):\n    q = mp.Queue()\n"
        "    p = mp.Process(target=work, args=(q, x))\n    p.start()\n    got = q.get(timeout=10)\n    p.join()\n"
        "    return got\n",
        ["assert run(41) == 42"],
        1.0,
    ),
    "big-int-factorial": (
        "import math\ndef fact(n):\n    return math.factorial(n)\n",
        ["assert fact(20000) % 1000 == 0", "assert fact(20000) > 1e300", "assert fact(5) == 120"],
        1.0,
    ),
    "too-big-int-costs-only-its-test": (
        "def power(n):\n    return 3 ** n\n",
        ["assert power(1_000_000) > 0", "assert power(4) == 81"],
        0.5,
    ),
    "decimal": (
        "from decimal import Decimal, getcontext\ngetcontext().prec = 200\ndef third():\n"
        "    return Decimal(1) / Decimal(3)\n",
        ["assert third() > 0.333", "assert str(third())[:6] == '0.3333'", "assert len(str(third())) == 202"],
        1.0,
    ),
    "many-large-values": (BIG_LIST, [f"assert len(big({i})) == 30_000" for i in range(17)], 1.0),
    "every-comparison-shape": (
        "def f(x):\n    return [x, x + 1]\n",
        [
            "assert f(1) == [1, 2]",
            "assert f(1) != [2, 1]",
            "assert f(1) < [1, 3]",
            "assert f(1) <= [1, 2]",
            "assert f(1) > [0]",
            "assert f(1) >= [1, 2]",
            "assert 2 in f(1)",
            "assert 5 not in f(1)",
            "assert f(1) in [[1, 2], [3]]",
            "assert f(1) not in [[2, 1]]",
            "assert (f(1) == [1, 2]) is True",
            "assert f(1)[0] is not None",
            "assert [1, 2] == f(1)",
            "assert 3 > len(f(1))",
            "assert f(1) is not None",
        ],
        1.0,
    ),
    "tolerance-shapes": (
        "def area(r):\n    return 3.14159 * r * r\n",
        [t.format(r=1) for t in TOLERANCE_SHAPES[:4]],
        1.0,
    ),
    "operators-on-the-result": (
        "def f(xs):\n    return sorted(set(xs))\n",
        [
            "assert sorted(f([3, 1, 2]), reverse=True)[0] == 3",
            "assert sum(f([1, 2, 2])) == 3",
            "assert set(f([1, 1, 2])) == {1, 2}",
            "assert max(f([4, 5])) - min(f([4, 5])) == 1",
            "assert str(f([1])) == '[1]'",
            "assert f([1, 2])[::-1] == [2, 1]",
            "assert tuple(f([2, 1])) == (1, 2)",
            "assert isinstance(f([1]), list) and len(f([1])) == 1",
        ],
        1.0,
    ),
    "counter-and-namedtuple-are-their-data": (
        "from collections import Counter, namedtuple\nP = namedtuple('P', 'a b')\ndef count(s):\n"
        "    return Counter(s)\ndef pair():\n    return P(1, 2)\n",
        ["assert count('aab') == {'a': 2, 'b': 1}", "assert pair() == (1, 2)", "assert pair()[1] == 2"],
        1.0,
    ),
    "setup-imports-and-entry-point-style": (
        "def add(a, b):\n    return a + b\n",
        ["import math\nassert math.isclose(add(0.1, 0.2), 0.3)", "assert math.floor(add(1.5, 1.0)) == 2"],
        1.0,
    ),
}


@pytest.mark.parametrize("name", sorted(HONEST_PROGRAMS))
def test_honest_program_scores_right(name: str) -> None:
    program, tests, expected = HONEST_PROGRAMS[name]
    logged: dict[str, list[object]] = {}
    reward = UnitTestReward(prepend_prompt=False, timeout_s=20.0)  # generous: 2 shared cores under load
    scores = reward([""], [program], tests=[tests], log_extra=lambda k, v: logged.update({k: v}))
    assert scores == [expected], logged["feedback"]


@pytest.mark.parametrize("name", sorted(HONEST_PROGRAMS))
def test_honest_program_scores_the_same_in_the_pool(name: str, sandbox_pool: SandboxPool) -> None:
    program, tests, expected = HONEST_PROGRAMS[name]
    logged: dict[str, list[object]] = {}
    reward = UnitTestReward(prepend_prompt=False, timeout_s=20.0)
    reward.pool = sandbox_pool  # the shared pool (a fresh one per test would start new workers)
    scores = reward([""], [program], tests=[tests], log_extra=lambda k, v: logged.update({k: v}))
    assert scores == [expected], logged["feedback"]


# Hostile record texts for the trainer-side parser (one probe expected unless noted): each must be refused.
COLLIDING = ",".join(f'["i","{format(7 + k * ((1 << 61) - 1), "x")}"]' for k in range(2000))
FORGED_RECORDS: dict[str, str] = {
    "empty": "",
    "no-trailing-newline": '{"load":null}\n{"value":["N"]}\n{"end":1}',
    "missing-result": '{"load":null}\n{"end":1}\n',
    "extra-result": '{"load":null}\n{"value":["N"]}\n{"value":["N"]}\n{"end":1}\n',
    "wrong-end-count": '{"load":null}\n{"value":["N"]}\n{"end":2}\n',
    "end-first": '{"end":1}\n{"value":["N"]}\n{"load":null}\n',
    "two-keys": '{"load":null,"x":1}\n{"value":["N"]}\n{"end":1}\n',
    "not-an-object": '["load"]\n{"value":["N"]}\n{"end":1}\n',
    "nan-constant": '{"load":null}\n{"value":["f",NaN]}\n{"end":1}\n',
    "json-float": '{"load":null}\n{"value":1.5}\n{"end":1}\n',
    "huge-json-int": '{"load":null}\n{"value":["N"]}\n{"end":' + "9" * 100_000 + "}\n",
    "int-with-prefix": '{"load":null}\n{"value":["i","0x10"]}\n{"end":1}\n',
    "int-with-underscores": '{"load":null}\n{"value":["i","1_0"]}\n{"end":1}\n',
    "int-too-long": '{"load":null}\n{"value":["i","' + "f" * 70_000 + '"]}\n{"end":1}\n',
    "float-text-too-long": '{"load":null}\n{"value":["f","' + "1" * 1000 + '"]}\n{"end":1}\n',
    "unknown-tag": '{"load":null}\n{"value":["Z","x"]}\n{"end":1}\n',
    "bool-not-bool": '{"load":null}\n{"value":["b","true"]}\n{"end":1}\n',
    "unhashable-set-element": '{"load":null}\n{"value":["S",[["l",[]]]]}\n{"end":1}\n',
    "colliding-set": '{"load":null}\n{"value":["S",[' + COLLIDING + ']]}\n{"end":1}\n',
    "colliding-dict-keys": '{"load":null}\n{"value":["d",['
    + ",".join(f'[["i","{format(7 + k * ((1 << 61) - 1), "x")}"],["N"]]' for k in range(2000))
    + ']]}\n{"end":1}\n',
    "nested-too-deep": '{"load":null}\n{"value":' + '["l",[' * 200 + '["N"]' + "]]" * 200 + '}\n{"end":1}\n',
    "json-nesting-bomb": '{"load":null}\n{"value":' + "[" * 100_000 + "]" * 100_000 + '}\n{"end":1}\n',
    "fraction-zero-denominator": '{"load":null}\n{"value":["q","1","0"]}\n{"end":1}\n',
    "bytes-not-hex": '{"load":null}\n{"value":["y","zz"]}\n{"end":1}\n',
    "malformed-exception": '{"load":null}\n{"raised":{"type":"E"}}\n{"end":1}\n',
    "result-of-unknown-kind": '{"load":null}\n{"verdict":"pass"}\n{"end":1}\n',
    "load-error-with-results": '{"load":{"type":"E","message":"","traceback":""}}\n{"value":["N"]}\n{"end":1}\n',
    "truncated-marker": '{"load":null}\n{"value":["N"]}\n[... output truncated ...]\n',
}


@pytest.mark.parametrize("name", sorted(FORGED_RECORDS))
def test_forged_record_is_refused(name: str) -> None:
    with pytest.raises(MalformedRecord):
        parse_record(FORGED_RECORDS[name], 1)


def test_well_formed_record_is_read() -> None:
    text = '{"load":null}\n{"value":["t",[["i","-ff"],["s","\\udc80"],["S",[["f","nan"]]]]]}\n{"raised":'
    text += '{"type":"E","message":"m","traceback":""}}\n{"end":2}\n'
    record = parse_record(text, 2)
    value = record.results[0].value  # type: ignore[union-attr]
    assert value[0] == -255
    assert value[1] == "\udc80"
    assert record.results[1].describe() == "E: m"  # type: ignore[union-attr]


def test_the_suite_counts_its_attacks() -> None:
    """The figures quoted in the docs: exploit programs and forged records (each must be contained above)."""
    assert (len(REWARD_ATTACKS), len(FORGED_RECORDS)) == (30, 28)
    assert len(HONEST_PROGRAMS) == 17
