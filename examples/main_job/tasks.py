"""The main job's task family: parametric one-line Python functions, split into train and held-out tasks.

Each task is one instance ``(template, k)`` of a few templates, e.g. ``add`` with ``k = 17``::

    prompt    "def add_17(x):\\n    return"
    solution  " x + 17"
    tests     ("assert add_17(31) == 48, '31 + 17'", "assert add_17(-4) == 13, '-4 + 17'", ...)

Each test carries the expected expression as its message, as hand-written test suites often do, so the
sandbox's feedback on a failing test says what was wanted ("Test `assert or_17(40) == 57, '40 | 17'`
failed: or_17(40) returned 40; expected 57.").

Two subsets. **Easy** tasks (``add``, ``sub``, ``mul``, ``mod``, ``div``, ``max``) are what the warm start
teaches. **Hard** tasks (the bitwise ``or``, ``and``, ``xor``) never appear in it: the warm-started
policy writes an arithmetic body there and fails, so a GRPO group on a hard task is all zeros and its
advantage is 0. The skill is still in reach: the teacher's recorded traces answer hard train tasks
correctly (trace-replay DPO), and the sandbox's feedback shows the wanted expression (SDPO with feedback).

The split is by instance: every ``(template, k)`` lands in exactly one of train and held-out (a quarter
of each template's instances are held out), so no held-out name, prompt, solution or test occurs in
anything training reads (the train tasks, the warm start's demonstrations and feedback drills, the
recorded traces and the DPO pairs replayed from them). What carries over is the skill, reading the
operation and the constant off the name and writing the expression, which is what the held-out pass
rate measures. `check_unseen` enforces it at run time.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DATA",
    "DRILL_K_RANGE",
    "HARD_TEMPLATES",
    "K_RANGE",
    "TEMPLATES",
    "CodingTask",
    "Demonstration",
    "Template",
    "build_drills",
    "build_family",
    "check_unseen",
    "load_demonstrations",
    "load_tasks",
    "split_family",
    "weak_answer",
    "write_data",
]

DATA = Path(__file__).resolve().parents[1] / "data"


@dataclass(frozen=True)
class Template:
    """One template: the name stem, the body it asks for (``{k}`` placeholder) and its semantics ``f(x, k)``."""

    stem: str
    body: str
    apply: Callable[[int, int], int]


TEMPLATES: tuple[Template, ...] = (
    Template("add", " x + {k}", lambda x, k: x + k),
    Template("sub", " x - {k}", lambda x, k: x - k),
    Template("mul", " x * {k}", lambda x, k: x * k),
    Template("mod", " x % {k}", lambda x, k: x % k),
    Template("div", " x // {k}", lambda x, k: x // k),
    Template("max", " max(x, {k})", lambda x, k: max(x, k)),
    Template("or", " x | {k}", lambda x, k: x | k),
    Template("and", " x & {k}", lambda x, k: x & k),
    Template("xor", " x ^ {k}", lambda x, k: x ^ k),
)
HARD_TEMPLATES = ("or", "and", "xor")
"""Templates of the hard subset: absent from the warm start, so the warm-started policy fails them."""
K_RANGE = range(2, 40)
"""The constants ``k``: 2 to 39, so 9 × 38 − 4 = 338 instances (110 hard; see `_in_family`)."""
DRILL_K_RANGE = range(40, 80)
"""The constants of the warm start's feedback drills (`build_drills`), disjoint from every task's."""


@dataclass(frozen=True)
class CodingTask:
    """One instance: ``name`` (``add_17``), ``prompt`` (signature), ``solution`` (reference body), ``tests``."""

    name: str
    template: str
    k: int
    prompt: str
    solution: str
    tests: tuple[str, ...]

    @property
    def hard(self) -> bool:
        """Whether the task is in the hard subset (a template of `HARD_TEMPLATES`)."""
        return self.template in HARD_TEMPLATES

    def row(self) -> dict[str, Any]:
        """The dataset row the trainer and the reward read: ``prompt`` and ``tests`` (a list)."""
        return {"prompt": self.prompt, "tests": list(self.tests)}


@dataclass(frozen=True)
class Demonstration:
    """One warm-start example: an easy train task's prompt and a correct completion."""

    task: str
    prompt: str
    completion: str


def _in_family(template: Template, k: int) -> bool:
    """Every ``(template, k)`` but ``x & k`` with ``k + 1`` a power of two, which is ``x % (k + 1)`` exactly."""
    return not (template.stem == "and" and (k + 1) & k == 0)


def _decisive(template: Template, k: int, xs: Sequence[int]) -> bool:
    """Whether the arguments ``xs`` tell ``(template, k)`` apart from every other instance of the family."""
    want = [template.apply(x, k) for x in xs]
    return all(
        [other.apply(x, j) for x in xs] != want
        for other in TEMPLATES
        for j in K_RANGE
        if (other, j) != (template, k) and _in_family(other, j)
    )


def _instance(template: Template, k: int, rng: random.Random, name: str | None = None) -> CodingTask:
    name = name or f"{template.stem}_{k}"
    for _ in range(1000):  # three arguments on which no other body of the family gives the same answers
        xs = rng.sample(range(-20, 100), 3)
        if _decisive(template, k, xs):
            break
    else:
        raise RuntimeError(f"found no three arguments that single out {name}; widen the argument range")
    body = template.body.format(k=k)
    wanted = [re.sub(r"\bx\b", str(x), body).strip() for x in xs]  # "31 + 17": the test's message
    tests = tuple(f"assert {name}({x}) == {template.apply(x, k)!r}, {w!r}" for x, w in zip(xs, wanted, strict=True))
    return CodingTask(name, template.stem, k, f"def {name}(x):\n    return", body, tests)


def build_family(seed: int = 0) -> list[CodingTask]:
    """Every instance of every template; the tests' arguments are drawn under ``seed``."""
    rng = random.Random(seed)
    return [_instance(t, k, rng) for t in TEMPLATES for k in K_RANGE if _in_family(t, k)]


def build_drills(seed: int = 0) -> list[CodingTask]:
    """Feedback drills for the warm start: ``def f_<k>(x)`` whose body is any template's (constants from
    `DRILL_K_RANGE`, so no drill shares a body with a task). The name does not say the operation; only the
    failing test's message does, so a drill is solved by reading the feedback, which is the skill it teaches."""
    rng = random.Random(seed + 2)
    return [_instance(t, k, rng, name=f"f_{k}") for t in TEMPLATES for k in DRILL_K_RANGE]


def split_family(
    tasks: Sequence[CodingTask], heldout_fraction: float = 0.25, seed: int = 0
) -> tuple[list[CodingTask], list[CodingTask]]:
    """(train, held-out): ``heldout_fraction`` of each template's instances, drawn under ``seed``, are held out."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
    rng = random.Random(seed)
    train: list[CodingTask] = []
    heldout: list[CodingTask] = []
    for stem in dict.fromkeys(t.template for t in tasks):
        group = [t for t in tasks if t.template == stem]
        rng.shuffle(group)
        n = max(1, round(len(group) * heldout_fraction))
        heldout += sorted(group[:n], key=lambda t: t.k)
        train += sorted(group[n:], key=lambda t: t.k)
    return train, heldout


def weak_answer(task: CodingTask, rng: random.Random) -> str:
    """A plausible wrong body, as a weak student writes it: an arithmetic operation where a bitwise one is wanted
    (the only kind it knows), otherwise the wrong operation or the wrong constant. Its constants lie past every
    task's (`K_RANGE`), so a wrong answer is never another task's solution."""
    arithmetic = [t for t in TEMPLATES if t.stem not in HARD_TEMPLATES and t.stem != task.template]
    if task.hard or rng.random() < 0.5:
        return rng.choice(arithmetic).body.format(k=task.k + 40)
    template = next(t for t in TEMPLATES if t.stem == task.template)
    return template.body.format(k=rng.choice([k for k in DRILL_K_RANGE if k != task.k]))


def write_data(folder: Path = DATA, *, seed: int = 0, traces: int = 64, hard_traces: int = 48) -> None:
    """Write the shipped data: ``tasks_train.jsonl``, ``tasks_heldout.jsonl``, ``demonstrations.jsonl`` (one
    per easy train task) and ``traces.jsonl`` (a weak student's wrong answers to ``traces`` easy and
    ``hard_traces`` hard train tasks)."""
    train, heldout = split_family(build_family(seed), seed=seed)
    rng = random.Random(seed + 1)
    easy, hard = [t for t in train if not t.hard], [t for t in train if t.hard]
    recorded = sorted(rng.sample(easy, traces) + rng.sample(hard, hard_traces), key=train.index)
    files = {
        "tasks_train.jsonl": [_task_json(t) for t in train],
        "tasks_heldout.jsonl": [_task_json(t) for t in heldout],
        "demonstrations.jsonl": [asdict(Demonstration(t.name, t.prompt, t.solution)) for t in easy],
        "traces.jsonl": [
            {
                "trace_id": f"weak-{t.name}",
                "messages": [
                    {"role": "user", "content": t.prompt},
                    {"role": "assistant", "content": weak_answer(t, rng)},
                ],
                "meta": {"task": t.name, "recorded_by": "a weak student policy"},
            }
            for t in recorded
        ],
    }
    for name, rows in files.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _task_json(task: CodingTask) -> dict[str, Any]:
    return {**asdict(task), "tests": list(task.tests)}


def _rows(path: Path) -> Iterable[tuple[int, dict[str, Any]]]:
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number} is not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number} is not a JSON object")
            yield number, row


def load_tasks(path: Path) -> list[CodingTask]:
    """Tasks from a JSONL file of `CodingTask` fields; errors name the file, line and missing field."""
    tasks = []
    for number, row in _rows(path):
        missing = sorted({"name", "template", "k", "prompt", "solution", "tests"} - set(row))
        if missing:
            raise ValueError(f"{path}:{number}: task {row.get('name', '?')!r} lacks {missing}")
        if not isinstance(row["tests"], list) or not row["tests"]:
            raise ValueError(f"{path}:{number}: 'tests' must be a non-empty list of assert statements")
        tasks.append(CodingTask(**{**row, "tests": tuple(row["tests"])}))
    if not tasks:
        raise ValueError(f"{path} holds no tasks")
    return tasks


def load_demonstrations(path: Path) -> list[Demonstration]:
    """Warm-start demonstrations from JSONL (``task``, ``prompt``, ``completion``)."""
    demos = []
    for number, row in _rows(path):
        missing = sorted({"task", "prompt", "completion"} - set(row))
        if missing:
            raise ValueError(f"{path}:{number}: demonstration lacks {missing}")
        demos.append(Demonstration(row["task"], row["prompt"], row["completion"]))
    if not demos:
        raise ValueError(f"{path} holds no demonstrations")
    return demos


def check_unseen(heldout: Sequence[CodingTask], seen: Mapping[str, Iterable[str]]) -> None:
    """Raise ``ValueError`` if any held-out task's name, prompt, solution or test occurs in what training reads.

    ``seen`` maps a source ("train tasks", "demonstrations", "DPO pairs", ...) to its texts (prompts,
    completions, test lines, feedback). A held-out task is seen when its prompt, its solution or one of its
    tests is one of the texts (solutions compared without surrounding blanks), or its name occurs as a word in
    one (``add_17`` in ``"assert add_17(3) == 20"``, not in ``add_170``).
    """
    for source, texts in seen.items():
        pool = list(texts)
        exact = set(pool) | {text.strip() for text in pool}
        for task in heldout:
            word = re.compile(rf"\b{re.escape(task.name)}\b")
            whole = [task.prompt, task.solution.strip(), *task.tests]
            if any(text in exact for text in whole) or any(word.search(text) for text in pool):
                raise ValueError(
                    f"held-out task {task.name!r} occurs in the {source}; the evaluation would measure "
                    "memorisation. Regenerate the data with examples/main_job/tasks.py"
                )


if __name__ == "__main__":
    write_data()
    print(f"wrote {DATA}/tasks_train.jsonl, tasks_heldout.jsonl, demonstrations.jsonl, traces.jsonl")
