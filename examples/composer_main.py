"""The crf main job: SFT warm start, then GRPO + SDPO + trace-replay DPO with DiLoCo across replica processes,
measured on coding tasks the policy never trained on.

Run it from an environment with every crf package installed (``uv sync`` at the repository root)::

    python examples/composer_main.py                    # the full run, about 3 minutes on 2 quiet CPU cores
    python examples/composer_main.py --quick            # CI-sized wiring check, under a minute
    python examples/composer_main.py --channels grpo    # the ablation: GRPO alone at the same budget
    python examples/composer_main.py --agent            # the agentic job: draft, run_tests, fix, submit

What happens, with nothing to set up (the modules under ``main_job/`` hold each part; ``main_job.job`` runs the
steps, for ``--agent`` with ``main_job.agent_job``'s parts):

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

from main_job.job import Kind, SingleCompletion, run_job
from main_job.numerics import pin_cpu_numerics
from main_job.records import (
    CHANNELS,
    STORAGE_OPTIONS_ENV,
    TRAINERS,
    VOTE_SCOPES,
    ReplicaReport,
    check_schedule,
    compression,
    read_record,
)

__all__ = ["launch_replicas", "main", "parse_args"]


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


def _link(text: str) -> Any:
    """``--link RTT,BANDWIDTH`` → crf-diloco's ``Link`` (e.g. ``40ms,50MB/s``)."""
    from crf_diloco.link import Link

    try:
        return Link.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    add("--link", type=_link, default=None, metavar="RTT,BANDWIDTH",
        help="the network between the replicas and --store, e.g. 40ms,50MB/s: the report then sets each DiLoCo "
             "sync's time against its floor on that link (bytes / bandwidth + sequential round trips x RTT)")  # fmt: skip
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
    add("--sdpo-weight", type=float, default=None, help="weight of channel sdpo_jsd (default 1.0; --agent 0.25)")
    add("--dpo-weight", type=float, default=None, help="weight of channel trace_replay_dpo (default 0.2; --agent 0.05)")
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
    add("--vote-scope", choices=VOTE_SCOPES, default="run",
        help="DiLoCo's should_commit (crf-diloco's MockManager(vote_scope=...)): run, a vote of every replica through "
             "the store, the same answer everywhere (a barrier of two round trips per round); replica, torchft's scope: "
             "each replica decides for itself without a request, one that disagrees heals from the store")  # fmt: skip
    add("--checkpoint-every", type=int, default=1,
        help="write DiLoCo's global state (about twice the model's fp32 bytes) after a committed round only every N "
             "rounds (crf-diloco's MockManager(checkpoint_every=N)): 1/N of the checkpoint traffic, and a replica "
             "that heals may observe up to N rounds before it is in step")  # fmt: skip
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
    """The defaults of the flags left unset (None) that depend on ``--quick`` and ``--model``, or that ``--agent`` sets
    its own way (`main_job.agent_job.DEFAULTS`, filled first)."""
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
        "sdpo_weight": 1.0,
        "dpo_weight": 0.2,
    }
    for name, value in defaults.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)


def _check(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Each flag's limits, once. The schedule is `JobSpec`'s rule (`check_schedule`), asked here under the flags'
    names so that a bad ``--steps`` / ``--sync-every`` fails at once rather than when ``job.json`` is written;
    ``--codec`` is checked by its type (`_codec`)."""
    for name in ("replicas", "prompts_per_step", "eval_samples", "max_completion_length", "checkpoint_every"):
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
    """Run the job (or, with ``--replica``, one replica); returns the `JobOutcome` (the replica's report). The job's
    phases are `main_job.job.run_job`'s; ``--agent`` runs them with the agentic parts (`main_job.agent_job`)."""
    pinned = pin_cpu_numerics()  # before torch is imported: the same figures on every x86-64 machine
    opts = parse_args(argv)
    if opts.replica:
        from main_job.replica import run_replica

        return run_replica(Path(opts.replica))
    kind: Kind[Any, Any] = SingleCompletion()
    if opts.agent:  # --agent: the agentic job (main_job.agent_job)
        from main_job.agent_job import AgentJob

        kind = AgentJob()
    return run_job(
        opts,
        kind,
        pinned=pinned,
        command=redacted_command(argv if argv is not None else sys.argv[1:]),
        sandbox=describe_sandbox(),
        isolation=sandbox_isolation(),
        launch=launch_replicas,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
