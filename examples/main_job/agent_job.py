"""The launcher's side of ``--agent`` (``python examples/composer_main.py --agent``): the job of ``composer_main`` with
multi-turn, tool-using episodes (`main_job.agent`).

The same steps as the single-completion job, with the agentic parts swapped in: tasks and their split (the same
files), the agent's DPO pairs and warm-start episodes (checked against the held-out tasks with `check_unseen`), the
held-out evaluation before RL (`agent.evaluate_agent`), the DiLoCo replicas (``replica.run_replica`` with
``JobSpec.agent``), the evaluation after RL and the report (`main_job.report`, plus a section on the episodes: tool
calls per episode and the share of failing drafts fixed after ``run_tests``' feedback, before → after).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from main_job.records import CHANNELS, JobSpec, ReplicaReport, write_record
from main_job.tasks import DATA, build_drills, check_unseen, load_tasks

__all__ = ["DEFAULTS", "QUICK", "apply_defaults", "run_agent_job"]

DEFAULTS = {
    "steps": 60,
    "sync_every": 10,
    "warmup_steps": 800,
    "eval_samples": 4,
    "max_completion_length": 640,
    "lr": 1e-4,
}
"""``--agent``'s defaults for the flags the user leaves unset (``--quick``: `QUICK`). The inner lr is 10× below the
single-completion job's: a 640-token episode's DPO log-ratio sums over hundreds of tokens, and at 1e-3 one step
collapsed the agent (held-out 0.352 -> 0.000, docs/guide.md)."""
QUICK = {"steps": 2, "sync_every": 1, "warmup_steps": 20, "eval_samples": 1, "max_completion_length": 640, "lr": 1e-4}
DRILLS_PER_TEMPLATE = 16
"""Feedback drills per template in the warm start (of `tasks.build_drills`' 40): enough to teach reading, and each
costs the warm start's set-up four sandbox runs."""


def apply_defaults(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill ``--agent``'s defaults where a flag was left unset, and refuse what ``--agent`` does not support."""
    if opts.model != "tiny":
        parser.error("--agent runs the tiny policy (its tool-call format is the character tokenizer's)")
    if opts.trainer != "crf":
        parser.error("--agent trains with crf's trainer (--trainer crf)")
    for name, value in (QUICK if opts.quick else DEFAULTS).items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)


def _report_lines(before: Any, after: Any) -> list[str]:
    lines = []
    for subset in before.episodes:
        lines.append(f"  {subset:<4}: before RL {before.text(subset)}")
        lines.append(f"        after RL  {after.text(subset)}")
    return lines


def _markdown(before: Any, after: Any) -> str:
    rows = [
        "## Episodes (held-out tasks)",
        "",
        "A sample *passes* when its submission passes the visible and the hidden tests. *Failing drafts fixed*: of the "
        "episodes whose `run_tests` reported a failure, the share whose submission then passed every test.",
        "",
        "| tasks | tool calls per episode (before → after) | submitted | saw a failing run_tests | failing drafts fixed |",
        "|---|---|---|---|---|",
    ]

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    for subset, b in before.episodes.items():
        a = after.episodes[subset]
        rows.append(
            f"| {subset} | {b['tool_calls']:.2f} → {a['tool_calls']:.2f} | {pct(b['submitted'])} → {pct(a['submitted'])} "
            f"| {pct(b['failed_drafts'])} → {pct(a['failed_drafts'])} | {pct(b['repair'])} → {pct(a['repair'])} |"
        )
    return "\n".join(rows) + "\n"


def run_agent_job(
    opts: argparse.Namespace,
    *,
    pinned: bool,
    launch: Callable[[argparse.Namespace, Path, str], list[ReplicaReport]],
    sandbox: str,
    isolation: str,
    command: str,
) -> Any:
    """The agentic job (module docstring); ``launch``, ``sandbox``, ``isolation`` and ``command`` are
    ``composer_main``'s (`launch_replicas`, `describe_sandbox()`, `sandbox_isolation()`, `redacted_command`)."""
    import torch
    from transformers.utils import logging as hf_logging

    from main_job import agent
    from main_job.evaluate import Change
    from main_job.numerics import cpu_numerics
    from main_job.policy import load_policy, save_policy
    from main_job.report import JobOutcome, plot, summary_markdown, summary_table

    start = time.monotonic()
    phases: dict[str, float] = {}
    mark = start

    def phase(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        phases[name] = now - mark
        mark = now

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1 if opts.device == "cpu" else max(1, os.cpu_count() or 1))
    output = Path(opts.output_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    output.mkdir(parents=True, exist_ok=True)
    store = opts.store or str(output / "store")
    store = store if "://" in store else str(Path(store).resolve())
    channels = tuple(c for c in CHANNELS if opts.weights[c] > 0)
    print(
        f"crf main job, agentic (--agent): {' + '.join(channels)} on multi-turn episodes (run_tests / submit in a "
        f"sandboxed CodingEnvironment, up to {agent.MAX_TOOL_CALLS} programs each); {opts.replicas} replica "
        f"processes ({opts.executor} executor) x {opts.steps} steps, DiLoCo round every {opts.sync_every}; model tiny "
        f"on {opts.device}; store {store}; output {output}",
        flush=True,
    )
    print(sandbox, flush=True)
    numerics = cpu_numerics()
    print(f"CPU numerics: {numerics}" + ("" if pinned else " (torch was imported before the job could pin them)"))

    train, heldout = load_tasks(DATA / "tasks_train.jsonl"), load_tasks(DATA / "tasks_heldout.jsonl")
    model, tokenizer = agent.build_agent_policy(opts.seed)
    model.to(opts.device)
    config = agent.env_config(tokenizer, isolation=isolation, timeout_s=opts.sandbox_timeout)
    pairs, pair_episodes = agent.write_agent_pairs(
        output / "agent_pairs.jsonl", train, DATA / "traces.jsonl", config=config
    )
    print(f"trace-replay DPO: {len(pair_episodes) // 2} multi-turn pairs (draft tested and fixed > draft submitted)")
    per_template, every = (2, 8) if opts.quick else (DRILLS_PER_TEMPLATE, 1)  # --quick: a wiring check
    drills = [d for i, d in enumerate(build_drills()) if i % 40 < per_template]
    easy = [t for t in train if not t.hard][::every]
    episodes = agent.warm_start_episodes(easy, drills, config=config, seed=opts.seed)
    check_unseen(
        heldout,
        {
            "train tasks": [
                text for t in train for text in (t.prompt, t.solution, *t.tests, json.dumps(agent.agent_row(t)))
            ],
            "agent warm-start episodes": list(agent.episode_texts(episodes)),
            "agent DPO pairs": [*agent.episode_texts(pair_episodes), *pairs.read_text(encoding="utf-8").splitlines()],
        },
    )
    hard_names = [t.name for t in heldout if t.hard]
    print(
        f"tasks: {len(train)} train, {len(heldout)} held out ({len(hard_names)} hard; none of them in the train tasks, "
        "the warm-start episodes or the DPO pairs)",
        flush=True,
    )
    phase("set-up")
    if opts.warmup_steps:
        first, last = agent.warm_start_agent(
            model, tokenizer, episodes, steps=opts.warmup_steps, learning_rate=opts.warmup_lr, seed=opts.seed
        )
        print(
            f"warm start: {opts.warmup_steps} supervised steps on {len(episodes)} episodes (easy train tasks and "
            f"drills: pass first time, repairs after run_tests, SDPO's reprompt), loss {first:.3f} -> {last:.3f}",
            flush=True,
        )
    save_policy(model, tokenizer, output / "warm_start")
    phase("warm start")

    def heldout_eval(policy: Any) -> Any:
        return agent.evaluate_agent(
            policy,
            tokenizer,
            heldout,
            samples=opts.eval_samples,
            temperature=opts.temperature,
            seed=opts.seed + 12345,
            isolation=isolation,
            timeout_s=opts.sandbox_timeout,
            max_completion_length=opts.max_completion_length,
        )

    before = heldout_eval(model)
    print(
        f"held-out pass rate before RL: {before.rate.text()} ({opts.eval_samples} episodes x {len(heldout)} tasks); "
        f"hard subset {before.rate.subset(hard_names).text()}; {before.text()}",
        flush=True,
    )
    del model
    phase("evaluation before")

    job = output / "job.json"
    spec = JobSpec.from_options(opts, output=output, pairs=pairs, isolation=isolation, agent=True)
    write_record(spec, job)
    replicas = launch(opts, job, store)
    phase("RL")

    final, _ = load_policy(output / "final", opts.device)
    after = heldout_eval(final)
    change = Change.between(before.rate, after.rate)
    print(
        f"held-out pass rate after RL: {after.rate.text()}; change {change.text()}; hard subset "
        f"{after.rate.subset(hard_names).text()}",
        flush=True,
    )
    phase("evaluation after")

    outcome = JobOutcome(
        command=command,
        model="tiny (agent)",
        executor=opts.executor,
        channels=channels,
        seed=opts.seed,
        steps=opts.steps,
        sync_every=opts.sync_every,
        heldout_tasks=len(heldout),
        train_tasks=len(train),
        before=before.rate,
        after=after.rate,
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
    print("episodes on the held-out tasks (tool calls, failing drafts fixed after run_tests' feedback):", flush=True)
    print("\n".join(_report_lines(before, after)), flush=True)
    plot(outcome, output / "composer_main.png")
    markdown = summary_markdown(outcome, "composer_main.png").replace("# crf main job", "# crf main job (--agent)", 1)
    (output / "summary.md").write_text(markdown + "\n" + _markdown(before, after), encoding="utf-8")
    (output / "result.json").write_text(
        json.dumps(
            {
                "agent": True,
                "channels": list(channels),
                "seed": opts.seed,
                "before": before.rate.mean,
                "after": after.rate.mean,
                "change": change.mean,
                "change_interval": list(change.interval),
                "tasks": list(before.rate.tasks),
                "before_per_task": list(before.rate.per_task),
                "after_per_task": list(after.rate.per_task),
                "samples": before.rate.samples,
                "episodes": {"before": before.episodes, "after": after.episodes},
                "seconds": outcome.seconds,
                "phases": phases,
                "load_average": outcome.load_average,
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
