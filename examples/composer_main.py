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
from pathlib import Path
from typing import Any

from main_job.numerics import cpu_numerics, pin_cpu_numerics
from main_job.records import (
    CHANNELS,
    STORAGE_OPTIONS_ENV,
    TRAINERS,
    JobSpec,
    ReplicaReport,
    compression,
    read_record,
    write_record,
)
from main_job.tasks import DATA, build_drills, load_demonstrations, load_tasks

__all__ = ["main", "parse_args"]


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


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None (those defaults depend on the model and are in the help text)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
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
    add("--codec", default="fp32",
        help="wire codec of DiLoCo's outer gradients: fp32, bf16, int8, int4[:block] or topk[:k/block] (the last two "
             "with error feedback; crf_diloco.wire)")  # fmt: skip
    add("--sandbox-timeout", type=float, default=3.0, help="seconds per unit-test run")
    add("--replica-timeout", type=float, default=3600.0, help="seconds before the replicas are stopped")
    add("--seed", type=int, default=0)
    add("--run-id", default=None, help="store prefix of this run (default: a fresh one)")
    add("--replica", default=None, metavar="JOB_JSON", help=argparse.SUPPRESS)  # internal: run one replica
    add("--agent", action="store_true",
        help="the agentic job: multi-turn episodes (draft, run_tests, read the result, fix, submit) in a sandboxed "
             "CodingEnvironment per rollout; its own defaults: 60 steps, 4 episodes per held-out task, 640 tokens "
             "(main_job.agent)")  # fmt: skip
    opts = parser.parse_args(argv)
    if opts.replica:
        return opts
    if opts.agent:  # --agent's defaults where a flag is unset, before the job's own (main_job.agent_job)
        from main_job.agent_job import apply_defaults

        apply_defaults(opts, parser)
    opts.max_completion_length = opts.max_completion_length if opts.max_completion_length is not None else 12
    tiny = opts.model == "tiny"
    opts.steps = opts.steps if opts.steps is not None else (4 if opts.quick else 300)
    opts.sync_every = opts.sync_every if opts.sync_every is not None else (2 if opts.quick else 10)
    opts.lr = opts.lr if opts.lr is not None else (1e-3 if tiny else 1e-5)
    # SmolLM2 writes Python already but not one line then EOS (held-out pass rate 0.004); 5 steps teach the format
    # (0.167) and leave RL room (30 steps at 3e-5: 1.000).
    opts.warmup_steps = (
        opts.warmup_steps if opts.warmup_steps is not None else (5 if not tiny else 20 if opts.quick else 400)
    )
    opts.warmup_lr = opts.warmup_lr if opts.warmup_lr is not None else (3e-3 if tiny else 1e-5)
    opts.eval_samples = opts.eval_samples if opts.eval_samples is not None else (2 if opts.quick else 16)
    for name in ("replicas", "steps", "sync_every", "prompts_per_step", "generations", "eval_samples",
                 "max_completion_length"):  # fmt: skip
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("lr", "warmup_lr", "temperature", "outer_lr", "sync_timeout", "sandbox_timeout", "replica_timeout"):
        if not 0 < getattr(opts, name) < float("inf"):
            parser.error(f"--{name.replace('_', '-')} must be a finite number > 0, got {getattr(opts, name)}")
    if not 0 <= opts.outer_momentum < 1:
        parser.error(f"--outer-momentum must be in [0, 1), got {opts.outer_momentum}")
    if opts.generations < 2:
        parser.error("--generations must be >= 2 (GRPO compares rollouts within a group)")
    if opts.steps % opts.sync_every:
        parser.error(
            f"--steps ({opts.steps}) must be a multiple of --sync-every ({opts.sync_every}) so the run ends on a "
            "DiLoCo round and every replica holds the same final weights"
        )
    if opts.warmup_steps < 0:
        parser.error("--warmup-steps must be >= 0")
    try:
        compression(opts.codec)
    except ValueError as exc:
        parser.error(f"--codec: {exc}")
    weights = {"grpo": opts.grpo_weight, "sdpo_jsd": opts.sdpo_weight, "trace_replay_dpo": opts.dpo_weight}
    if any(not weights[c] > 0 for c in opts.channels):
        parser.error(f"every channel in --channels needs a weight > 0, got {weights}")
    opts.weights = {c: (weights[c] if c in opts.channels else 0.0) for c in CHANNELS}
    opts.storage_options = dict(opts.storage_options)
    if opts.device == "auto":
        import torch

        opts.device = "cuda" if torch.cuda.is_available() else "cpu"
    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is visible to torch here")
    opts.run_id = opts.run_id or f"main-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"
    return opts


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

    executor: Any
    if opts.executor == "ray":
        from crf_diloco.executors import RayExecutor

        executor = RayExecutor()
    else:
        from crf_diloco.executors import LocalProcessExecutor

        executor = LocalProcessExecutor()
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
    if opts.agent:  # --agent: the agentic job (main_job.agent_job)
        from main_job.agent_job import run_agent_job

        return run_agent_job(
            opts,
            pinned=pinned,
            launch=launch_replicas,
            sandbox=describe_sandbox(),
            isolation=sandbox_isolation(),
            command=redacted_command(argv if argv is not None else sys.argv[1:]),
        )

    import torch
    from main_job.evaluate import Change, evaluate
    from main_job.feedback import feedback_examples
    from main_job.policy import build_policy, load_policy, save_policy, warm_start
    from main_job.report import JobOutcome, plot, summary_markdown, summary_table
    from main_job.tasks import check_unseen
    from main_job.teacher import build_trace_pairs

    start = time.monotonic()
    phases: dict[str, float] = {}
    mark = start

    def phase(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        phases[name] = now - mark
        mark = now

    from transformers.utils import logging as hf_logging

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
        f"{'' if opts.codec == 'fp32' else f' ({opts.codec} on the wire)'}; model {opts.model} on {opts.device}; "
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
    isolation = sandbox_isolation()

    train, heldout = load_tasks(DATA / "tasks_train.jsonl"), load_tasks(DATA / "tasks_heldout.jsonl")
    demos = load_demonstrations(DATA / "demonstrations.jsonl")
    pairs = build_trace_pairs(output, train, opts.teacher_url, opts.teacher_model)
    pair_texts = [v for line in pairs.read_text(encoding="utf-8").splitlines() for v in json.loads(line).values()]
    readable = [t for t in train if not t.hard] + build_drills()  # never a hard task: the warm start lacks them
    feedback = feedback_examples(readable, isolation=isolation, timeout_s=opts.sandbox_timeout, seed=opts.seed)
    check_unseen(
        heldout,
        {
            "train tasks": [text for t in train for text in (t.prompt, t.solution, *t.tests)],
            "warm-start demonstrations": [text for d in demos for text in (d.prompt, d.completion)],
            "warm-start feedback": [text for f in feedback for text in (f.prompt, f.attempt, f.feedback, f.completion)],
            "DPO pairs": [json.dumps(v) if not isinstance(v, str) else v for v in pair_texts],
        },
    )
    hard = sum(t.hard for t in heldout)
    print(
        f"tasks: {len(train)} train, {len(heldout)} held out ({hard} of them hard, bitwise; none of them in the train "
        "tasks, the demonstrations, the warm start's feedback or the DPO pairs)",
        flush=True,
    )
    model, tokenizer = build_policy(opts.model, seed=opts.seed)
    model.to(opts.device)
    phase("set-up")
    if opts.warmup_steps:
        loss = warm_start(
            model, tokenizer, demos, feedback=feedback, steps=opts.warmup_steps, lr=opts.warmup_lr, seed=opts.seed
        )
        print(
            f"warm start: {opts.warmup_steps} supervised steps on {len(demos)} demonstrations and the sandbox's "
            f"feedback on {len(feedback)} wrong attempts (easy train tasks and drills), loss {loss:.3f}"
        )
    save_policy(model, tokenizer, output / "warm_start")
    phase("warm start")

    def heldout_rate(policy: Any) -> Any:
        return evaluate(
            policy,
            tokenizer,
            heldout,
            samples=opts.eval_samples,
            max_new_tokens=opts.max_completion_length,
            temperature=opts.temperature,
            seed=opts.seed + 12345,  # the same draws before and after RL
            isolation=isolation,
            timeout_s=opts.sandbox_timeout,
        )

    before = heldout_rate(model)
    hard_names = [t.name for t in heldout if t.hard]
    print(
        f"held-out pass rate before RL: {before.text()} ({opts.eval_samples} samples x {len(heldout)} tasks); "
        f"hard subset {before.subset(hard_names).text()}",
        flush=True,
    )
    del model
    phase("evaluation before")

    job = output / "job.json"
    spec = JobSpec.from_options(opts, output=output, pairs=pairs, isolation=isolation)
    write_record(spec, job)
    replicas = launch_replicas(opts, job, store)
    phase("RL")

    final, _ = load_policy(output / "final", opts.device)
    after = heldout_rate(final)
    change = Change.between(before, after)
    hard_change = Change.between(before.subset(hard_names), after.subset(hard_names))
    print(
        f"held-out pass rate after RL: {after.text()}; change {change.text()}; hard subset "
        f"{after.subset(hard_names).text()}, change {hard_change.text()}",
        flush=True,
    )
    phase("evaluation after")

    outcome = JobOutcome(
        command=redacted_command(argv if argv is not None else sys.argv[1:]),
        model=opts.model,
        executor=opts.executor,
        channels=channels,
        seed=opts.seed,
        steps=opts.steps,
        sync_every=opts.sync_every,
        heldout_tasks=len(heldout),
        train_tasks=len(train),
        before=before,
        after=after,
        replicas=tuple(replicas),
        identical_weights=len({r.weights_sha256 for r in replicas}) == 1,
        seconds=time.monotonic() - start,
        phases=phases,
        load_average=" ".join(Path("/proc/loadavg").read_text().split()[:3])
        if Path("/proc/loadavg").exists()
        else "n/a",
        sandbox=sandbox,
        numerics=numerics,
        hard=tuple(hard_names),
    )
    print(summary_table(outcome), flush=True)
    plot(outcome, output / "composer_main.png")
    (output / "summary.md").write_text(summary_markdown(outcome, "composer_main.png"), encoding="utf-8")
    (output / "result.json").write_text(
        json.dumps(
            {
                "channels": list(channels),
                "seed": opts.seed,
                "before": before.mean,
                "after": after.mean,
                "change": change.mean,
                "change_interval": list(change.interval),
                "tasks": list(before.tasks),
                "before_per_task": list(before.per_task),
                "after_per_task": list(after.per_task),
                "samples": before.samples,
                "seconds": outcome.seconds,
                "numerics": numerics,
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
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    print(f"report: {output / 'summary.md'}, plot: {output / 'composer_main.png'} ({outcome.seconds:.0f} s)")
    return outcome


if __name__ == "__main__":
    main(sys.argv[1:])
