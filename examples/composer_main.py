"""The crf main job: SFT warm start, then GRPO + SDPO + trace-replay DPO with DiLoCo across replica processes,
measured on coding tasks the policy never trained on.

Run it from an environment with every crf package installed (``uv sync`` at the repository root)::

    python examples/composer_main.py                    # the full run, about 3 minutes on 2 quiet CPU cores
    python examples/composer_main.py --quick            # CI-sized wiring check, under a minute
    python examples/composer_main.py --channels grpo    # the ablation: GRPO alone at the same budget
    python examples/composer_main.py --agent            # the agentic job: draft, run_tests, fix, submit

What happens, with nothing to set up (the modules under ``main_job/`` hold each part):

1. **Tasks** (``main_job.tasks``): a parametric family of one-line Python functions (``def add_17(x):``
   → `` x + 17``; 9 templates × 38 constants), split by instance into 250 train and 88 held-out tasks. The
   bitwise templates (``or``, ``and``, ``xor``) are the hard subset: the warm start never shows them.
   Nothing a held-out task contains occurs in anything training reads; the job checks it.
2. **Trace replay** (``main_job.teacher``): a weak student's recorded answers to 112 train tasks (48 hard) are
   replayed against a teacher (a local endpoint answering train tasks with their reference solution, or
   ``--teacher-url``) with crf-replaysim and normalised into DPO pairs.
3. **Warm start** (``main_job.policy``, ``main_job.feedback``, ``main_job.templates``): a tiny Llama built
   offline with a character tokenizer, trained on the easy train tasks' demonstrations and on SDPO's reprompt
   format holding a correct answer or the sandbox's feedback on a wrong attempt, so its self-teacher can read.
4. **Held-out pass rate before RL** (``main_job.evaluate``): 16 sampled completions per held-out task,
   each run against its unit tests in the sandbox.
5. **RL** (``main_job.replica``): ``--replicas`` (2) separate processes started by crf-diloco's executor
   (``--executor local``, or ``ray``), each a ``ComposerReplicationTrainer`` on the train tasks inside
   ``torchft.local_sgd.DiLoCo``, synchronised through crf-diloco's ``ObjectStoreAllReduce`` on ``--store``.
6. **Held-out pass rate after RL**, on the same tasks with the same sampling seed, and the report
   (``main_job.report``): a table, ``summary.md`` and ``composer_main.png`` in ``runs/<timestamp>/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shlex
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from main_job.numerics import cpu_numerics, pin_cpu_numerics
from main_job.records import (
    CHANNELS,
    STORAGE_OPTIONS_ENV,
    TRAINERS,
    JobSpec,
    ReplicaReport,
    check_schedule,
    compression,
    read_record,
    write_record,
)
from main_job.tasks import DATA, CodingTask, Demonstration, build_drills, load_demonstrations, load_tasks

if TYPE_CHECKING:
    from main_job.evaluate import PassRate
    from main_job.feedback import FeedbackExample
    from main_job.report import JobOutcome

__all__ = ["main", "parse_args", "run_job"]


# --------------------------------------------------------------------------- sandbox
def sandbox_isolation() -> str:
    """``"bwrap"`` when bubblewrap works here, else ``"rlimits"`` (resource limits only), so a fresh machine runs."""
    from crf_core.rewards import bubblewrap_usable

    return "bwrap" if bubblewrap_usable() else "rlimits"


def describe_sandbox() -> str:
    """The line the job prints about how generated code is isolated."""
    if sandbox_isolation() == "bwrap":
        return "sandbox: bubblewrap (namespaces, read-only root, private /tmp, seccomp, rlimits)"
    from crf_core.rewards import bubblewrap_problem

    return (
        f"sandbox: rlimits only (bubblewrap is not usable here: {bubblewrap_problem()}); "
        "install the `bubblewrap` package to isolate generated code"
    )


# --------------------------------------------------------------------------- arguments
def _top_k(text: str) -> int:
    """``--sdpo-top-k``: a positive count of tokens, or 0 for the full vocabulary."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a token count >= 1, or 0 for the full vocabulary, got {text!r}")
    return value


def _number(text: str, *, open_interval: bool) -> float:
    """A float in [0, 1], or in (0, 1) when ``open_interval``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    inside = 0.0 < value < 1.0 if open_interval else 0.0 <= value <= 1.0
    if not inside:
        span = "a probability in (0, 1)" if open_interval else "a number in [0, 1]"
        raise argparse.ArgumentTypeError(f"expected {span}, got {text!r}")
    return value


def _unit(text: str) -> float:
    """A float in [0, 1] (``--sdpo-alpha``, ``--sdpo-teacher-update-rate``)."""
    return _number(text, open_interval=False)


def _probability(text: str) -> float:
    """A float in (0, 1) (``--sdpo-truncate-below``)."""
    return _number(text, open_interval=True)


def _storage_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` → ``(KEY, VALUE)``; VALUE is decoded as JSON when it is valid JSON, else kept as text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. endpoint_url=http://127.0.0.1:9000), got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def _channels(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [n for n in names if n not in CHANNELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--channels takes a comma-separated subset of {','.join(CHANNELS)}, got {text!r}"
        )
    return tuple(c for c in CHANNELS if c in names)


def _codec(text: str) -> str:
    """``--codec``: a wire codec crf-diloco knows (`records.compression`, which names the codecs there are)."""
    try:
        compression(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None (those defaults depend on the model and are in the help text)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    """The job's flags (defaults of None depend on other flags: `_fill_defaults`)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], formatter_class=_Defaults)
    add = parser.add_argument
    add("--quick", action="store_true", default=os.environ.get("CRF_QUICK") == "1",
        help="CI-sized wiring check (4 steps, 2 samples per held-out task); also CRF_QUICK=1")  # fmt: skip
    add("--channels", type=_channels, default=CHANNELS, help="comma-separated channels to train with (ablation)")
    add("--steps", type=int, default=None, help="optimizer steps per replica (default 300; quick 4)")
    add("--sync-every", type=int, default=None, help="inner steps per DiLoCo round (default 10; quick 2)")
    add("--replicas", type=int, default=2, help="DiLoCo replicas, one process each")
    add("--executor", choices=("local", "ray", "monarch"), default="local",
        help="how replica processes start: crf-diloco's local or Ray executor, or Monarch actors (torchmonarch)")  # fmt: skip
    add("--store", default=None, help="fsspec URI of the object store (default: <output-dir>/store)")
    add("--storage-option", dest="storage_options", type=_storage_option, action="append", default=[],
        metavar="KEY=VALUE", help="fsspec option of --store, repeatable; VALUE is parsed as JSON when it is JSON")  # fmt: skip
    add("--model", default="tiny", choices=("tiny", "smollm2-135m"), help="policy to train")
    add("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    add("--output-dir", default=None, help="where everything goes (default: runs/<timestamp>)")
    add("--teacher-url", default=None, help="OpenAI-compatible /v1 URL of a real replay teacher (default: local)")
    add("--teacher-model", default="reference-solutions", help="teacher model name for --teacher-url")
    add("--prompts-per-step", type=int, default=2, help="train prompts per step and replica")
    add("--generations", type=int, default=8, help="rollouts per prompt (GRPO group size)")
    add("--max-completion-length", type=int, default=None, help="tokens per rollout (default 12; --agent 640)")
    add("--lr", type=float, default=None, help="inner AdamW learning rate (default: tiny 1e-3, smollm2 1e-5)")
    add("--temperature", type=float, default=1.0, help="sampling temperature of rollouts and evaluation")
    add("--grpo-weight", type=float, default=1.0, help="weight of channel grpo when it is on")
    add("--sdpo-weight", type=float, default=1.0, help="weight of channel sdpo_jsd when it is on")
    add("--dpo-weight", type=float, default=0.2, help="weight of channel trace_replay_dpo when it is on")
    add("--sdpo-feedback", action=argparse.BooleanOptionalAction, default=True,
        help="let SDPO's teacher read the sandbox's feedback (the tiny model learns to read it in its warm start)")  # fmt: skip
    add("--sdpo-alpha", type=_unit, default=0.5,
        help="SDPO's generalised-JSD alpha: 0 forward KL, 1 reverse KL, 0.5 the paper's JSD (the job's choice: "
             "forward KL with a frozen teacher gained less in the mean over 3 seeds; docs/guide.md)")  # fmt: skip
    add("--sdpo-top-k", type=_top_k, default=20,
        help="SDPO distils on the student's top-k tokens plus a tail bucket (the paper's 20); 0: the full "
             "vocabulary")  # fmt: skip
    add("--sdpo-truncate-below", type=_probability, default=None,
        help="first-error truncation: SDPO trains each rollout up to its first token the teacher gives less than this "
             "probability, and on nothing after it (crf; off by default)")  # fmt: skip
    add("--sdpo-teacher-update-rate", type=_unit, default=0.05,
        help="EMA rate of SDPO's self-teacher after each step: 0.05 SDPO's EMA (the job's choice); 0 keeps the "
             "warm-started policy, frozen (TRL's teacher_model_kind='base'); 1 the live policy")  # fmt: skip
    add("--sdpo-routing", choices=("all", "srpo", "failures"), default="all",
        help="srpo: successful rollouts train through GRPO only, failed ones through SDPO only (arXiv 2604.02288); "
             "failures: SDPO on failed rollouts only, GRPO on all")  # fmt: skip
    add("--sdpo-group-weight", choices=("uniform", "success_variance"), default="uniform",
        help="success_variance: weigh each question's SDPO term by sqrt(p(1-p)) (SC-SDPO, arXiv 2605.27765)")  # fmt: skip
    add("--trainer", choices=TRAINERS, default="crf",
        help="crf: ComposerReplicationTrainer with --channels; trl-grpo / trl-sdpo: TRL's GRPOTrainer or "
        "SDPOTrainer at the same budget (the ablation's peers; --channels is then ignored)")  # fmt: skip
    add(
        "--warmup-steps",
        type=int,
        default=None,
        help="supervised warm-start steps (default: tiny 400, quick 20; smollm2 5)",
    )
    add("--warmup-lr", type=float, default=None, help="warm-start learning rate (default: tiny 3e-3, smollm2 1e-5)")
    add("--eval-samples", type=int, default=None, help="completions per held-out task (default 16; quick 2)")
    add("--outer-lr", type=float, default=1.0, help="DiLoCo outer SGD lr (1.0 without momentum = averaging)")
    add("--outer-momentum", type=float, default=0.0, help="DiLoCo outer Nesterov momentum (the paper: 0.9)")
    add("--sync-timeout", type=float, default=120.0, help="seconds a DiLoCo round may wait for peers")
    add("--codec", type=_codec, default="fp32",
        help="wire codec of DiLoCo's outer gradients: fp32, bf16, int8, int4[:block] or topk[:k/block] (the last two "
             "with error feedback; crf_diloco.wire)")  # fmt: skip
    add("--sync-delay", type=int, default=0,
        help="overlap: each DiLoCo round is prepared this many inner steps before it is applied and runs in the "
             "background from the next step on, so D >= 2 overlaps it with D - 1 inner steps (torchft's Streaming "
             "DiLoCo fragment_sync_delay, crf-diloco's MockManager(overlap=True)); the inner steps taken meanwhile are "
             "replaced by the round's result (fragment_update_alpha 0), so the replicas still end bit-identical; 0: "
             "the round runs at its step, as plain DiLoCo")  # fmt: skip
    add("--sandbox-timeout", type=float, default=3.0, help="seconds per unit-test run")
    add("--replica-timeout", type=float, default=3600.0, help="seconds before the replicas are stopped")
    add("--seed", type=int, default=0)
    add("--run-id", default=None, help="store prefix of this run (default: a fresh one)")
    add("--replica", default=None, metavar="JOB_JSON", help=argparse.SUPPRESS)  # internal: run one replica
    add("--agent", action="store_true",
        help="the agentic job: multi-turn episodes (draft, run_tests, read the result, fix, submit) in a sandboxed "
             "CodingEnvironment per rollout; its own defaults: 60 steps, 4 episodes per held-out task, 640 tokens "
             "(main_job.agent)")  # fmt: skip
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The job's options: flags parsed, the defaults that depend on other flags filled in, every value checked (a bad
    flag fails here, before any work, naming the flag), channel weights, device and run id resolved. With
    ``--replica`` only the parsed flags (the replica reads everything else from its ``job.json``)."""
    parser = _parser()
    opts = parser.parse_args(argv)
    if opts.replica:
        return opts
    if opts.agent:  # --agent's defaults where a flag is unset, before the job's own (main_job.agent_job)
        from main_job.agent_job import apply_defaults

        apply_defaults(opts, parser)
    _fill_defaults(opts)
    _check(opts, parser)
    opts.weights = _channel_weights(opts, parser)
    opts.storage_options = dict(opts.storage_options)
    opts.device = _device(opts.device, parser)
    opts.run_id = opts.run_id or f"main-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"
    return opts


def _fill_defaults(opts: argparse.Namespace) -> None:
    """The defaults of the flags left unset (None) that depend on ``--quick`` and ``--model``."""
    tiny = opts.model == "tiny"
    defaults = {
        "max_completion_length": 12,
        "steps": 4 if opts.quick else 300,
        "sync_every": 2 if opts.quick else 10,
        "lr": 1e-3 if tiny else 1e-5,
        # SmolLM2 writes Python already but not one line then EOS (held-out pass rate 0.004); 5 steps teach the
        # format (0.167) and leave RL room (30 steps at 3e-5: 1.000).
        "warmup_steps": 5 if not tiny else 20 if opts.quick else 400,
        "warmup_lr": 3e-3 if tiny else 1e-5,
        "eval_samples": 2 if opts.quick else 16,
    }
    for name, value in defaults.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)


def _check(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Each flag's limits, once. The schedule is `JobSpec`'s rule (`check_schedule`), asked here under the flags'
    names so that a bad ``--steps`` / ``--sync-every`` fails at once rather than when ``job.json`` is written;
    ``--codec`` is checked by its type (`_codec`)."""
    for name in ("replicas", "prompts_per_step", "eval_samples", "max_completion_length"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("lr", "warmup_lr", "temperature", "outer_lr", "sync_timeout", "sandbox_timeout", "replica_timeout"):
        if not 0 < getattr(opts, name) < float("inf"):
            parser.error(f"--{name.replace('_', '-')} must be a finite number > 0, got {getattr(opts, name)}")
    if not 0 <= opts.outer_momentum < 1:
        parser.error(f"--outer-momentum must be in [0, 1), got {opts.outer_momentum}")
    if opts.generations < 2:
        parser.error("--generations must be >= 2 (GRPO compares rollouts within a group)")
    try:
        check_schedule(opts.steps, opts.sync_every, opts.sync_delay, names=("--steps", "--sync-every", "--sync-delay"))
    except ValueError as exc:
        parser.error(str(exc))
    if opts.warmup_steps < 0:
        parser.error("--warmup-steps must be >= 0")


def _channel_weights(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, float]:
    """Each channel's weight: its flag's where ``--channels`` names it (which must be > 0), else 0."""
    weights = {"grpo": opts.grpo_weight, "sdpo_jsd": opts.sdpo_weight, "trace_replay_dpo": opts.dpo_weight}
    if any(not weights[c] > 0 for c in opts.channels):
        parser.error(f"every channel in --channels needs a weight > 0, got {weights}")
    return {c: (weights[c] if c in opts.channels else 0.0) for c in CHANNELS}


def _device(choice: str, parser: argparse.ArgumentParser) -> str:
    """``--device``: auto is cuda when torch sees a CUDA device, else cpu; cuda must be visible."""
    if choice == "cpu":
        return choice
    import torch

    visible = torch.cuda.is_available()
    if choice == "cuda" and not visible:
        parser.error("--device cuda: no CUDA device is visible to torch here")
    return "cuda" if visible else "cpu"


_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "session")


def redacted_command(argv: Sequence[str]) -> str:
    """The command line for the report, with every ``--storage-option`` whose name suggests a credential shown as
    ``NAME=***`` (``key=…``, ``secret=…``, ``token=…``, ``client_kwargs`` with a password, …)."""
    out = ["python", "examples/composer_main.py"]
    hide_next = False
    for arg in argv:
        if hide_next or arg.startswith("--storage-option="):
            prefix = "--storage-option=" if arg.startswith("--storage-option=") else ""
            name, _, value = arg.removeprefix(prefix).partition("=")
            if any(word in (name + value).lower() for word in _SECRET_WORDS):
                arg = f"{prefix}{name}=***"
        hide_next = arg == "--storage-option"
        out.append(arg)
    return shlex.join(out)


# --------------------------------------------------------------------------- replicas
class _Relay:
    """Executor output callback: a replica's stdout to the terminal, every line of it and its stderr to its log."""

    def __init__(self, output: Path, world_size: int) -> None:
        self._logs = [open(output / f"replica{r}.log", "a", encoding="utf-8") for r in range(world_size)]  # noqa: SIM115
        self._lock = threading.Lock()

    def __call__(self, rank: int, stream: str, line: str) -> None:
        with self._lock:
            self._logs[rank].write(f"{stream}: {line}\n")
            if stream == "stdout":
                print(line, flush=True)

    def close(self) -> None:
        for log in self._logs:
            log.close()


def _executor(name: str) -> Any:
    """crf-diloco's executor of ``--executor`` (local or ray)."""
    if name == "ray":
        from crf_diloco.executors import RayExecutor

        return RayExecutor()
    from crf_diloco.executors import LocalProcessExecutor

    return LocalProcessExecutor()


def launch_replicas(opts: argparse.Namespace, job: Path, store: str) -> list[ReplicaReport]:
    """Start one process per replica (``--executor``) and read their reports."""
    env = {
        "CRF_DILOCO_SECRET": secrets.token_hex(32),  # authenticates the run's store objects
        STORAGE_OPTIONS_ENV: json.dumps(opts.storage_options),  # may hold credentials: never written to disk
    }
    if opts.executor == "monarch":
        from main_job.monarch import run_monarch_replicas

        run_monarch_replicas(job, opts.replicas, store, opts.run_id, env)
        return [read_record(ReplicaReport, job.parent / f"replica{r}.json") for r in range(opts.replicas)]
    from crf_diloco.executors import raise_for_failures, run_replicas

    executor = _executor(opts.executor)
    output = job.parent
    relay = _Relay(output, opts.replicas)
    command = [sys.executable, str(Path(__file__).resolve()), "--replica", str(job)]
    try:
        results = run_replicas(
            executor,
            command,
            world_size=opts.replicas,
            uri=store,
            run_id=opts.run_id,
            env=env,
            on_output=relay,
            timeout=opts.replica_timeout,
        )
    finally:
        relay.close()
        close = getattr(executor, "close", None)
        if close is not None:
            close()
    raise_for_failures(results)
    return [read_record(ReplicaReport, output / f"replica{r}.json") for r in range(opts.replicas)]


# --------------------------------------------------------------------------- the job
def main(argv: Sequence[str] | None = None) -> Any:
    """Run the job (or, with ``--replica``, one replica); returns the `JobOutcome` (the replica's report)."""
    pinned = pin_cpu_numerics()  # before torch is imported: the same figures on every x86-64 machine
    opts = parse_args(argv)
    if opts.replica:
        from main_job.replica import run_replica

        return run_replica(Path(opts.replica))
    command = redacted_command(argv if argv is not None else sys.argv[1:])
    if opts.agent:  # --agent: the agentic job (main_job.agent_job)
        from main_job.agent_job import run_agent_job

        return run_agent_job(
            opts,
            pinned=pinned,
            launch=launch_replicas,
            sandbox=describe_sandbox(),
            isolation=sandbox_isolation(),
            command=command,
        )
    return run_job(opts, pinned=pinned, command=command)


def run_job(opts: argparse.Namespace, *, pinned: bool, command: str) -> JobOutcome:
    """The single-completion job, phase by phase (the module docstring's steps 1 to 6)."""
    run = _start(opts, pinned)
    data = _prepare_data(run)
    model, tokenizer = _warm_start(run, data)
    before = _evaluate_before(run, data, model, tokenizer)
    del model  # the replicas load the warm start from disk
    run.lap("evaluation before")
    replicas = _train_replicas(run, data)
    run.lap("RL")
    after = _evaluate_after(run, data, tokenizer, before)
    run.lap("evaluation after")
    return _report(run, data, before, after, replicas, command)


@dataclass
class _Run:
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


@dataclass(frozen=True)
class _Data:
    """The tasks and the texts the warm start and the replicas train on (none holds a held-out task)."""

    train: list[CodingTask]
    heldout: list[CodingTask]
    demos: list[Demonstration]
    feedback: list[FeedbackExample]
    pairs: Path

    @property
    def hard(self) -> list[str]:
        """Names of the held-out tasks in the hard subset."""
        return [t.name for t in self.heldout if t.hard]


def _start(opts: argparse.Namespace, pinned: bool) -> _Run:
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
        f"crf main job: {' + '.join(channels)}; {opts.replicas} replica processes ({opts.executor} executor) x "
        f"{opts.steps} steps, DiLoCo round every {opts.sync_every}"
        f"{'' if opts.codec == 'fp32' else f' ({opts.codec} on the wire)'}"
        f"{f', started {opts.sync_delay} steps early in the background' if opts.sync_delay else ''}; "
        f"model {opts.model} on {opts.device}; "
        f"store {store}; output {output}",
        flush=True,
    )
    sandbox = describe_sandbox()
    print(sandbox, flush=True)
    numerics = cpu_numerics()
    print(
        f"CPU numerics: {numerics}"
        + ("" if pinned else " (torch was imported before the job could pin them: figures may differ from the docs)"),
        flush=True,
    )
    return _Run(opts, output, store, channels, sandbox, sandbox_isolation(), numerics, start)


def _prepare_data(run: _Run) -> _Data:
    """The tasks, the trace-replay DPO pairs and the warm start's feedback, checked to hold no held-out task."""
    from main_job.feedback import feedback_examples
    from main_job.tasks import check_unseen
    from main_job.teacher import build_trace_pairs

    opts = run.opts
    train, heldout = load_tasks(DATA / "tasks_train.jsonl"), load_tasks(DATA / "tasks_heldout.jsonl")
    demos = load_demonstrations(DATA / "demonstrations.jsonl")
    pairs = build_trace_pairs(run.output, train, opts.teacher_url, opts.teacher_model)
    pair_texts = [v for line in pairs.read_text(encoding="utf-8").splitlines() for v in json.loads(line).values()]
    readable = [t for t in train if not t.hard] + build_drills()  # never a hard task: the warm start lacks them
    feedback = feedback_examples(readable, isolation=run.isolation, timeout_s=opts.sandbox_timeout, seed=opts.seed)
    check_unseen(
        heldout,
        {
            "train tasks": [text for t in train for text in (t.prompt, t.solution, *t.tests)],
            "warm-start demonstrations": [text for d in demos for text in (d.prompt, d.completion)],
            "warm-start feedback": [text for f in feedback for text in (f.prompt, f.attempt, f.feedback, f.completion)],
            "DPO pairs": [json.dumps(v) if not isinstance(v, str) else v for v in pair_texts],
        },
    )
    data = _Data(train, heldout, demos, feedback, pairs)
    print(
        f"tasks: {len(train)} train, {len(heldout)} held out ({len(data.hard)} of them hard, bitwise; none of them in "
        "the train tasks, the demonstrations, the warm start's feedback or the DPO pairs)",
        flush=True,
    )
    return data


def _warm_start(run: _Run, data: _Data) -> tuple[Any, Any]:
    """The policy, built and warm-started (supervised) on the easy train tasks and the sandbox's feedback, saved to
    ``warm_start/`` for the replicas; returns it and its tokenizer."""
    from main_job.policy import build_policy, save_policy, warm_start

    opts = run.opts
    model, tokenizer = build_policy(opts.model, seed=opts.seed)
    model.to(opts.device)
    run.lap("set-up")
    if opts.warmup_steps:
        loss = warm_start(
            model, tokenizer, data.demos, feedback=data.feedback, steps=opts.warmup_steps, lr=opts.warmup_lr,
            seed=opts.seed,
        )  # fmt: skip
        print(
            f"warm start: {opts.warmup_steps} supervised steps on {len(data.demos)} demonstrations and the sandbox's "
            f"feedback on {len(data.feedback)} wrong attempts (easy train tasks and drills), loss {loss:.3f}"
        )
    save_policy(model, tokenizer, run.output / "warm_start")
    run.lap("warm start")
    return model, tokenizer


def _heldout_rate(run: _Run, data: _Data, policy: Any, tokenizer: Any) -> PassRate:
    """The policy's pass rate on the held-out tasks, with the same sampling draws before and after RL."""
    from main_job.evaluate import evaluate

    opts = run.opts
    return evaluate(
        policy,
        tokenizer,
        data.heldout,
        samples=opts.eval_samples,
        max_new_tokens=opts.max_completion_length,
        temperature=opts.temperature,
        seed=opts.seed + 12345,  # the same draws before and after RL
        isolation=run.isolation,
        timeout_s=opts.sandbox_timeout,
    )


def _evaluate_before(run: _Run, data: _Data, model: Any, tokenizer: Any) -> PassRate:
    """The warm-started policy on the held-out tasks."""
    before = _heldout_rate(run, data, model, tokenizer)
    print(
        f"held-out pass rate before RL: {before.text()} ({run.opts.eval_samples} samples x {len(data.heldout)} tasks); "
        f"hard subset {before.subset(data.hard).text()}",
        flush=True,
    )
    return before


def _train_replicas(run: _Run, data: _Data) -> list[ReplicaReport]:
    """RL: ``job.json`` (`JobSpec`) written for the replicas, the replicas started (``--executor``), their reports."""
    job = run.output / "job.json"
    write_record(JobSpec.from_options(run.opts, output=run.output, pairs=data.pairs, isolation=run.isolation), job)
    return launch_replicas(run.opts, job, run.store)


def _evaluate_after(run: _Run, data: _Data, tokenizer: Any, before: PassRate) -> PassRate:
    """The final weights (equal on every replica after the last round) on the held-out tasks."""
    from main_job.evaluate import Change
    from main_job.policy import load_policy

    final, _ = load_policy(run.output / "final", run.opts.device)
    after = _heldout_rate(run, data, final, tokenizer)
    change = Change.between(before, after)
    hard_change = Change.between(before.subset(data.hard), after.subset(data.hard))
    print(
        f"held-out pass rate after RL: {after.text()}; change {change.text()}; hard subset "
        f"{after.subset(data.hard).text()}, change {hard_change.text()}",
        flush=True,
    )
    return after


def _report(
    run: _Run, data: _Data, before: PassRate, after: PassRate, replicas: list[ReplicaReport], command: str
) -> JobOutcome:
    """The outcome: its table on the terminal, ``summary.md``, ``composer_main.png`` and ``result.json``."""
    from main_job.report import JobOutcome, plot, summary_markdown, summary_table

    opts, output = run.opts, run.output
    outcome = JobOutcome(
        command=command,
        model=opts.model,
        executor=opts.executor,
        channels=run.channels,
        seed=opts.seed,
        steps=opts.steps,
        sync_every=opts.sync_every,
        heldout_tasks=len(data.heldout),
        train_tasks=len(data.train),
        before=before,
        after=after,
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
    )
    print(summary_table(outcome), flush=True)
    plot(outcome, output / "composer_main.png")
    (output / "summary.md").write_text(summary_markdown(outcome, "composer_main.png"), encoding="utf-8")
    (output / "result.json").write_text(json.dumps(_result(outcome), indent=1), encoding="utf-8")
    print(f"report: {output / 'summary.md'}, plot: {output / 'composer_main.png'} ({outcome.seconds:.0f} s)")
    return outcome


def _result(outcome: JobOutcome) -> dict[str, Any]:
    """``result.json``: the figures of the run (what the ablation and the docs read)."""
    from main_job.evaluate import Change

    before, after, change = outcome.before, outcome.after, outcome.change
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


if __name__ == "__main__":
    main(sys.argv[1:])
