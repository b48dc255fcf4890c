"""The main job's task family: parametric one-line Python functions, split into train and held-out tasks.

Each task is one instance ``(template, k)`` of a few templates, e.g. ``add`` with ``k = 17``::

    prompt    "def add_17(x):\\n    return"
    solution  " x + 17"
    tests     ("assert add_17(31) == 48", "assert add_17(-4) == 13", "assert add_17(70) == 87")

The split is by instance: every ``(template, k)`` lands in exactly one of train and held-out, so no
held-out name, prompt, solution or test occurs in anything training reads (the train tasks, the
warm-start demonstrations, the recorded traces and the DPO pairs replayed from them). What carries
over is the skill, reading the operation and the constant off the name and writing the expression,
which is what the held-out pass rate measures. `check_unseen` enforces it at run time.

The shipped files under ``examples/data/`` are ``write_data()``'s output; regenerate them with
``python examples/main_job/tasks.py`` (deterministic).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DATA",
    "K_RANGE",
    "TEMPLATES",
    "CodingTask",
    "Demonstration",
    "Template",
    "build_family",
    "check_unseen",
    "load_demonstrations",
    "load_tasks",
    "split_family",
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
)
K_RANGE = range(2, 40)
"""The constants ``k``: 2 to 39, so 6 × 38 = 228 instances."""


@dataclass(frozen=True)
class CodingTask:
    """One instance: ``name`` (``add_17``), ``prompt`` (signature), ``solution`` (reference body), ``tests``."""

    name: str
    template: str
    k: int
    prompt: str
    solution: str
    tests: tuple[str, ...]

    def row(self) -> dict[str, Any]:
        """The dataset row the trainer and the reward read: ``prompt`` and ``tests`` (a list)."""
        return {"prompt": self.prompt, "tests": list(self.tests)}


@dataclass(frozen=True)
class Demonstration:
    """One warm-start example: a train task's prompt and a correct completion."""

    task: str
    prompt: str
    completion: str


def _decisive(template: Template, k: int, xs: Sequence[int]) -> bool:
    """Whether the arguments ``xs`` tell ``(template, k)`` apart from every other instance of the family."""
    want = [template.apply(x, k) for x in xs]
    return all(
        [other.apply(x, j) for x in xs] != want for other in TEMPLATES for j in K_RANGE if (other, j) != (template, k)
    )


def _instance(template: Template, k: int, rng: random.Random) -> CodingTask:
    name = f"{template.stem}_{k}"
    for _ in range(1000):  # three arguments on which no other body of the family gives the same answers
        xs = rng.sample(range(-20, 100), 3)
        if _decisive(template, k, xs):
            break
    else:
        raise RuntimeError(f"found no three arguments that single out {name}; widen the argument range")
    tests = tuple(f"assert {name}({x}) == {template.apply(x, k)!r}" for x in xs)
    return CodingTask(name, template.stem, k, f"def {name}(x):\n    return", template.body.format(k=k), tests)


def build_family(seed: int = 0) -> list[CodingTask]:
    """Every instance of every template; the tests' arguments are drawn under ``seed``."""
    rng = random.Random(seed)
    return [_instance(t, k, rng) for t in TEMPLATES for k in K_RANGE]


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


def _weak_answer(task: CodingTask, rng: random.Random) -> str:
    """A plausible wrong body, as a weak student writes it: the wrong operation or a wrong constant."""
    if rng.random() < 0.5:
        other = rng.choice([t for t in TEMPLATES if t.stem != task.template])
        return other.body.format(k=task.k)
    template = next(t for t in TEMPLATES if t.stem == task.template)
    return template.body.format(k=rng.choice([k for k in K_RANGE if k != task.k]))


def write_data(folder: Path = DATA, *, seed: int = 0, traces: int = 64) -> None:
    """Write the shipped data: ``tasks_train.jsonl``, ``tasks_heldout.jsonl``, ``demonstrations.jsonl`` (one
    per train task) and ``traces.jsonl`` (a weak student's wrong answers to ``traces`` train tasks)."""
    train, heldout = split_family(build_family(seed), seed=seed)
    rng = random.Random(seed + 1)
    recorded = sorted(rng.sample(train, traces), key=train.index)
    files = {
        "tasks_train.jsonl": [_task_json(t) for t in train],
        "tasks_heldout.jsonl": [_task_json(t) for t in heldout],
        "demonstrations.jsonl": [asdict(Demonstration(t.name, t.prompt, t.solution)) for t in train],
        "traces.jsonl": [
            {
                "trace_id": f"weak-{t.name}",
                "messages": [
                    {"role": "user", "content": t.prompt},
                    {"role": "assistant", "content": _weak_answer(t, rng)},
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
    """Raise ``ValueError`` if any held-out task's name, prompt or solution occurs in what training reads.

    ``seen`` maps a source ("train tasks", "demonstrations", "DPO pairs", ...) to its texts (prompts,
    completions, test lines). A held-out task is seen when its prompt is one of the texts, or its name
    occurs as a word in one (``add_17`` in ``"assert add_17(3) == 20"``, not in ``add_170``).
    """
    import re

    for source, texts in seen.items():
        pool = list(texts)
        prompts = set(pool)
        for task in heldout:
            word = re.compile(rf"\b{re.escape(task.name)}\b")
            if task.prompt in prompts or any(word.search(text) for text in pool):
                raise ValueError(
                    f"held-out task {task.name!r} occurs in the {source}; the evaluation would measure "
                    "memorisation. Regenerate the data with examples/main_job/tasks.py"
                )


if __name__ == "__main__":
    write_data()
    print(f"wrote {DATA}/tasks_train.jsonl, tasks_heldout.jsonl, demonstrations.jsonl, traces.jsonl")
