"""The main job's phases (``composer_main``'s steps 1 to 6), once for both of its kinds: set-up, the training data
checked against the held-out tasks, the warm start, the held-out evaluation before RL, the DiLoCo replicas, the
evaluation after RL and the report (the terminal table, ``summary.md``, ``composer_main.png``, ``result.json``), each
phase timed.

What differs between the single-completion job (`SingleCompletion`, the default) and the agentic one (``--agent``:
`main_job.agent_job.AgentJob`) is a `Kind`: the policy, the training data beside the tasks, the warm start, the
held-out evaluation and what the report adds. `run_job` runs either.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from main_job.numerics import cpu_numerics
from main_job.records import CHANNELS, JobSpec, ReplicaReport, write_record
from main_job.tasks import DATA, CodingTask, Demonstration, build_drills, load_demonstrations, load_tasks

if TYPE_CHECKING:
    from main_job.evaluate import PassRate
    from main_job.feedback import FeedbackExample
    from main_job.report import JobOutcome

__all__ = ["Data", "Kind", "Launch", "Prepared", "Run", "Section", "SingleCompletion", "WarmTexts", "run_job"]

W = TypeVar("W")  # what a kind's warm start trains on
E = TypeVar("E")  # what a kind's held-out evaluation gives

Launch = Callable[[argparse.Namespace, Path, str], list[ReplicaReport]]
"""Starts the replicas of a ``job.json`` on a store and returns their reports (``composer_main.launch_replicas``)."""


# --------------------------------------------------------------------------- what the phases pass on
@dataclass
class Run:
    """What every phase of the job reads: the options, where the run writes, how generated code is isolated, and
    the wall time of each phase so far (`lap`)."""

    opts: argparse.Namespace
    output: Path
    store: str
    channels: tuple[str, ...]
    sandbox: str
    isolation: str
    numerics: str
    start: float
    phases: dict[str, float] = field(default_factory=dict, init=False)
    _mark: float = field(init=False)

    def __post_init__(self) -> None:
        self._mark = self.start

    def lap(self, name: str) -> None:
        """Record the seconds since the last lap (or the start) as phase ``name``."""
        now = time.monotonic()
        self.phases[name] = now - self._mark
        self._mark = now

    @property
    def sampling(self) -> dict[str, Any]:
        """The held-out evaluation's sampling (a kind's `Kind.evaluate` passes it on): the same draws before and
        after RL."""
        opts = self.opts
        return {
            "samples": opts.eval_samples,
            "temperature": opts.temperature,
            "seed": opts.seed + 12345,
            "isolation": self.isolation,
            "timeout_s": opts.sandbox_timeout,
        }


@dataclass(frozen=True)
class Prepared(Generic[W]):
    """A kind's training data beside the train tasks: the DPO pairs the replicas read, what the warm start trains on,
    and every text of them by source (checked to hold no held-out task; the job names the sources)."""

    pairs: Path
    warm: W
    texts: dict[str, list[str]]


@dataclass(frozen=True)
class Data(Generic[W]):
    """The tasks and what the warm start and the replicas train on (none holds a held-out task)."""

    train: list[CodingTask]
    heldout: list[CodingTask]
    pairs: Path
    warm: W

    @property
    def hard(self) -> list[str]:
        """Names of the held-out tasks in the hard subset."""
        return [t.name for t in self.heldout if t.hard]


@dataclass(frozen=True)
class Section:
    """What a kind adds to the report: lines after the terminal table, a section at the end of ``summary.md``, and
    keys of ``result.json``."""

    terminal: str = ""
    markdown: str = ""
    result: dict[str, Any] = field(default_factory=dict)


class Kind(Protocol[W, E]):
    """The parts of the job that differ between its kinds; `run_job` runs the rest."""

    heading: str
    """``summary.md``'s heading."""
    unit: str
    """What the held-out evaluation draws per task (``"samples"``, ``"episodes"``)."""

    def headline(self, channels: Sequence[str]) -> str:
        """The first words of the job's first line: the job and what it trains with."""
        ...

    def model_name(self, opts: argparse.Namespace) -> str:
        """The policy as the report names it."""
        ...

    def policy(self, opts: argparse.Namespace) -> tuple[Any, Any]:
        """The policy to warm-start, built, and its tokenizer."""
        ...

    def prepare(self, run: Run, train: list[CodingTask], tokenizer: Any) -> Prepared[W]:
        """The DPO pairs (written under ``run.output``) and what the warm start trains on, from train tasks only."""
        ...

    def warm_start(self, run: Run, model: Any, tokenizer: Any, warm: W) -> None:
        """Train ``model`` (supervised, ``--warmup-steps``) on ``warm`` and say how it went."""
        ...

    def evaluate(self, run: Run, policy: Any, tokenizer: Any, tasks: list[CodingTask]) -> E:
        """``policy`` on the held-out ``tasks``, drawn with ``run.sampling``."""
        ...

    def rate(self, evaluation: E) -> PassRate:
        """The pass rate per task of an evaluation."""
        ...

    def detail(self, evaluation: E) -> str:
        """What the line of the evaluation before RL adds after the pass rates (``""``, or ``"; ..."``)."""
        ...

    def section(self, outcome: JobOutcome, before: E, after: E) -> Section:
        """What the report adds for this kind."""
        ...


# --------------------------------------------------------------------------- the phases
def run_job(
    opts: argparse.Namespace,
    kind: Kind[W, E],
    *,
    pinned: bool,
    command: str,
    sandbox: str,
    isolation: str,
    launch: Launch,
) -> JobOutcome:
    """The job of ``kind``, phase by phase (``composer_main``'s steps 1 to 6). ``pinned``: the CPU numerics were pinned
    before torch loaded; ``command``: the command line for the report; ``sandbox``: the line saying how generated code
    is isolated, ``isolation`` the sandbox's mode; ``launch`` starts the replicas."""
    run = _start(opts, kind, pinned, sandbox, isolation)
    model, tokenizer = kind.policy(opts)
    model.to(opts.device)
    data = _prepare_data(run, kind, tokenizer)
    run.lap("set-up")
    _warm_start(run, kind, data, model, tokenizer)
    run.lap("warm start")
    before = _evaluate_before(run, kind, data, model, tokenizer)
    del model  # the replicas load the warm start from disk
    run.lap("evaluation before")
    replicas = _train_replicas(run, data, launch)
    run.lap("RL")
    after = _evaluate_after(run, kind, data, tokenizer, before)
    run.lap("evaluation after")
    return _report(run, kind, data, before, after, replicas, command)


def _start(opts: argparse.Namespace, kind: Kind[W, E], pinned: bool, sandbox: str, isolation: str) -> Run:
    """Torch's threads, the output folder and store, and the lines saying what runs where."""
    import torch
    from transformers.utils import logging as hf_logging

    start = time.monotonic()
    hf_logging.disable_progress_bar()
    threads = 1 if opts.model == "tiny" and opts.device == "cpu" else max(1, os.cpu_count() or 1)
    torch.set_num_threads(threads)  # a tiny model runs fastest on one thread per process
    output = Path(opts.output_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    output.mkdir(parents=True, exist_ok=True)
    store = opts.store or str(output / "store")
    store = store if "://" in store else str(Path(store).resolve())  # replicas may run elsewhere than this cwd
    channels = tuple(c for c in CHANNELS if opts.weights[c] > 0) if opts.trainer == "crf" else (opts.trainer,)
    print(
        f"{kind.headline(channels)}; {opts.replicas} replica processes ({opts.executor} executor) x "
        f"{opts.steps} steps, DiLoCo round every {opts.sync_every}"
        f"{'' if opts.codec == 'fp32' else f' ({opts.codec} on the wire)'}"
        f"{f', started {opts.sync_delay} steps early in the background' if opts.sync_delay else ''}"
        f"{'' if opts.vote_scope == 'run' else f', vote scope {opts.vote_scope}'}"
        f"{f', state checkpointed every {opts.checkpoint_every} rounds' if opts.checkpoint_every > 1 else ''}; "
        f"model {opts.model} on {opts.device}; "
        f"store {store}; output {output}",
        flush=True,
    )
    print(sandbox, flush=True)
    numerics = cpu_numerics()
    print(
        f"CPU numerics: {numerics}"
        + ("" if pinned else " (torch was imported before the job could pin them: figures may differ from the docs)"),
        flush=True,
    )
    return Run(opts, output, store, channels, sandbox, isolation, numerics, start)


def _prepare_data(run: Run, kind: Kind[W, E], tokenizer: Any) -> Data[W]:
    """The tasks and the kind's training data, checked to hold no held-out task."""
    from main_job.tasks import check_unseen

    train, heldout = load_tasks(DATA / "tasks_train.jsonl"), load_tasks(DATA / "tasks_heldout.jsonl")
    prepared = kind.prepare(run, train, tokenizer)
    texts = {"train tasks": [text for t in train for text in (t.prompt, t.solution, *t.tests)], **prepared.texts}
    check_unseen(heldout, texts)
    data = Data(train, heldout, prepared.pairs, prepared.warm)
    *first, last = [f"the {source}" for source in texts]
    print(
        f"tasks: {len(train)} train, {len(heldout)} held out ({len(data.hard)} of them hard, bitwise; none of them in "
        f"{', '.join(first)} or {last})",
        flush=True,
    )
    return data


def _warm_start(run: Run, kind: Kind[W, E], data: Data[W], model: Any, tokenizer: Any) -> None:
    """The kind's warm start (``--warmup-steps``; none with 0), the policy saved to ``warm_start/`` for the
    replicas."""
    from main_job.policy import save_policy

    if run.opts.warmup_steps:
        kind.warm_start(run, model, tokenizer, data.warm)
    save_policy(model, tokenizer, run.output / "warm_start")


def _evaluate_before(run: Run, kind: Kind[W, E], data: Data[W], model: Any, tokenizer: Any) -> E:
    """The warm-started policy on the held-out tasks."""
    before = kind.evaluate(run, model, tokenizer, data.heldout)
    rate = kind.rate(before)
    print(
        f"held-out pass rate before RL: {rate.text()} ({run.opts.eval_samples} {kind.unit} x {len(data.heldout)} "
        f"tasks); hard subset {rate.subset(data.hard).text()}{kind.detail(before)}",
        flush=True,
    )
    return before


def _train_replicas(run: Run, data: Data[W], launch: Launch) -> list[ReplicaReport]:
    """RL: ``job.json`` (`JobSpec`) written for the replicas, the replicas started (``launch``), their reports."""
    job = run.output / "job.json"
    spec = JobSpec.from_options(
        run.opts, output=run.output, pairs=data.pairs, isolation=run.isolation, agent=run.opts.agent
    )
    write_record(spec, job)
    return launch(run.opts, job, run.store)


def _evaluate_after(run: Run, kind: Kind[W, E], data: Data[W], tokenizer: Any, before: E) -> E:
    """The final weights (equal on every replica after the last round) on the held-out tasks."""
    from main_job.evaluate import Change
    from main_job.policy import load_policy

    final, _ = load_policy(run.output / "final", run.opts.device)
    after = kind.evaluate(run, final, tokenizer, data.heldout)
    rate, first = kind.rate(after), kind.rate(before)
    change = Change.between(first, rate)
    hard_change = Change.between(first.subset(data.hard), rate.subset(data.hard))
    print(
        f"held-out pass rate after RL: {rate.text()}; change {change.text()}; hard subset "
        f"{rate.subset(data.hard).text()}, change {hard_change.text()}",
        flush=True,
    )
    return after


def _report(
    run: Run,
    kind: Kind[W, E],
    data: Data[W],
    before: E,
    after: E,
    replicas: list[ReplicaReport],
    command: str,
) -> JobOutcome:
    """The outcome: its table on the terminal, ``summary.md``, ``composer_main.png`` and ``result.json``, each with
    the kind's `Section`."""
    from main_job.report import JobOutcome, plot, summary_markdown, summary_table

    opts, output = run.opts, run.output
    outcome = JobOutcome(
        command=command,
        model=kind.model_name(opts),
        executor=opts.executor,
        channels=run.channels,
        seed=opts.seed,
        steps=opts.steps,
        sync_every=opts.sync_every,
        heldout_tasks=len(data.heldout),
        train_tasks=len(data.train),
        before=kind.rate(before),
        after=kind.rate(after),
        replicas=tuple(replicas),
        identical_weights=len({r.weights_sha256 for r in replicas}) == 1,
        seconds=time.monotonic() - run.start,
        phases=run.phases,
        load_average=" ".join(Path("/proc/loadavg").read_text().split()[:3])
        if Path("/proc/loadavg").exists()
        else "n/a",
        sandbox=run.sandbox,
        numerics=run.numerics,
        hard=tuple(data.hard),
        title=kind.heading,
        link=opts.link,
    )
    section = kind.section(outcome, before, after)
    print(summary_table(outcome), flush=True)
    if section.terminal:
        print(section.terminal, flush=True)
    plot(outcome, output / "composer_main.png")
    markdown = summary_markdown(outcome, "composer_main.png")
    if section.markdown:
        markdown += "\n" + section.markdown
    (output / "summary.md").write_text(markdown, encoding="utf-8")
    result = {**_result(outcome), **section.result}
    (output / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"report: {output / 'summary.md'}, plot: {output / 'composer_main.png'} ({outcome.seconds:.0f} s)")
    return outcome


def _result(outcome: JobOutcome) -> dict[str, Any]:
    """``result.json``: the figures of the run (what the ablation and the docs read); a kind's `Section` adds
    keys."""
    from main_job.evaluate import Change
    from main_job.report import SyncSummary

    before, after, change = outcome.before, outcome.after, outcome.change
    syncs = {r.rank: SyncSummary.of(r.syncs, outcome.link) for r in outcome.replicas}
    return {
        "channels": list(outcome.channels),
        "seed": outcome.seed,
        "before": before.mean,
        "after": after.mean,
        "change": change.mean,
        "change_interval": list(change.interval),
        "tasks": list(before.tasks),
        "before_per_task": list(before.per_task),
        "after_per_task": list(after.per_task),
        "samples": before.samples,
        "seconds": outcome.seconds,
        "numerics": outcome.numerics,
        "syncs": {str(rank): None if summary is None else asdict(summary) for rank, summary in syncs.items()},
        "subsets": {
            name: {
                "tasks": len(b.tasks),
                "before": b.mean,
                "after": a.mean,
                "change": Change.between(b, a).mean,
                "change_interval": list(Change.between(b, a).interval),
            }
            for name, (b, a) in outcome.subsets().items()
        },
    }


# --------------------------------------------------------------------------- the single-completion job
@dataclass(frozen=True)
class WarmTexts:
    """What the single-completion job's warm start trains on: the easy train tasks' demonstrations and the sandbox's
    feedback on wrong attempts (SDPO's reprompt format)."""

    demos: list[Demonstration]
    feedback: list[FeedbackExample]


class SingleCompletion:
    """The default job's `Kind`: one completion per prompt; trace-replay DPO pairs from the weak student's recorded
    answers, a warm start on demonstrations and the sandbox's feedback (`WarmTexts`), the held-out pass rate of
    sampled completions (`evaluate.evaluate`)."""

    heading = "crf main job"
    unit = "samples"

    def headline(self, channels: Sequence[str]) -> str:
        return f"crf main job: {' + '.join(channels)}"

    def model_name(self, opts: argparse.Namespace) -> str:
        return str(opts.model)

    def policy(self, opts: argparse.Namespace) -> tuple[Any, Any]:
        from main_job.policy import build_policy

        return build_policy(opts.model, seed=opts.seed)

    def prepare(self, run: Run, train: list[CodingTask], tokenizer: Any) -> Prepared[WarmTexts]:
        """The trace-replay DPO pairs (``main_job.teacher``), the demonstrations, and the sandbox's feedback on wrong
        attempts at easy train tasks and drills (never a hard task: the warm start lacks them)."""
        from main_job.feedback import feedback_examples
        from main_job.teacher import build_trace_pairs

        opts = run.opts
        demos = load_demonstrations(DATA / "demonstrations.jsonl")
        pairs = build_trace_pairs(run.output, train, opts.teacher_url, opts.teacher_model)
        pair_texts = [v for line in pairs.read_text(encoding="utf-8").splitlines() for v in json.loads(line).values()]
        readable = [t for t in train if not t.hard] + build_drills()
        feedback = feedback_examples(readable, isolation=run.isolation, timeout_s=opts.sandbox_timeout, seed=opts.seed)
        texts = {
            "warm-start demonstrations": [text for d in demos for text in (d.prompt, d.completion)],
            "warm-start feedback": [text for f in feedback for text in (f.prompt, f.attempt, f.feedback, f.completion)],
            "DPO pairs": [json.dumps(v) if not isinstance(v, str) else v for v in pair_texts],
        }
        return Prepared(pairs, WarmTexts(demos, feedback), texts)

    def warm_start(self, run: Run, model: Any, tokenizer: Any, warm: WarmTexts) -> None:
        from main_job.policy import warm_start

        opts = run.opts
        loss = warm_start(
            model, tokenizer, warm.demos, feedback=warm.feedback, steps=opts.warmup_steps, lr=opts.warmup_lr,
            seed=opts.seed,
        )  # fmt: skip
        print(
            f"warm start: {opts.warmup_steps} supervised steps on {len(warm.demos)} demonstrations and the sandbox's "
            f"feedback on {len(warm.feedback)} wrong attempts (easy train tasks and drills), loss {loss:.3f}"
        )

    def evaluate(self, run: Run, policy: Any, tokenizer: Any, tasks: list[CodingTask]) -> PassRate:
        from main_job.evaluate import evaluate

        return evaluate(policy, tokenizer, tasks, max_new_tokens=run.opts.max_completion_length, **run.sampling)

    def rate(self, evaluation: PassRate) -> PassRate:
        return evaluation

    def detail(self, evaluation: PassRate) -> str:
        return ""

    def section(self, outcome: JobOutcome, before: PassRate, after: PassRate) -> Section:
        return Section()
