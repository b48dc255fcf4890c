"""The launcher's side of ``--agent`` (``python examples/composer_main.py --agent``): the job of ``composer_main`` with
multi-turn, tool-using episodes (`main_job.agent`).

The job's phases are `main_job.job`'s; `AgentJob` is the `Kind` that swaps the agentic parts in: the tiny policy
with the tool-call format, the agent's DPO pairs and warm-start episodes played in the sandbox, the held-out
evaluation (`agent.evaluate_agent`), and a section of the report on the episodes: tool calls per episode and the
share of failing drafts fixed after ``run_tests``' feedback, before → after. The replicas train on episodes through
``JobSpec.agent``. Here also: ``--agent``'s defaults (`apply_defaults`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from main_job import agent
from main_job.agent import AgentEval, Episode
from main_job.job import Prepared, Run, Section
from main_job.tasks import DATA, CodingTask, build_drills

if TYPE_CHECKING:
    from main_job.evaluate import PassRate
    from main_job.report import JobOutcome

__all__ = ["DEFAULTS", "QUICK", "AgentJob", "apply_defaults"]

DEFAULTS = {
    "steps": 60,
    "sync_every": 10,
    "warmup_steps": 800,
    "eval_samples": 4,
    "max_completion_length": 640,
    "lr": 1e-4,
    "sdpo_weight": 0.25,
    "dpo_weight": 0.05,
}
"""``--agent``'s defaults for the flags the user leaves unset (``--quick``: `QUICK`). The inner lr is 10× below the
single-completion job's: a 640-token episode's DPO log-ratio sums over hundreds of tokens, and at 1e-3 one step
collapsed the agent. SDPO and DPO weigh a quarter of theirs: at the single-completion weights both cost the agent
its repairs after feedback; at a quarter the composed recipe is level with GRPO alone (the measured arms:
docs/guide.md, "A coding agent")."""
QUICK = {
    **DEFAULTS,
    "steps": 2,
    "sync_every": 1,
    "warmup_steps": 20,
    "eval_samples": 1,
}
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


def _report_lines(before: AgentEval, after: AgentEval) -> list[str]:
    lines = ["episodes on the held-out tasks (tool calls, failing drafts fixed after run_tests' feedback):"]
    for subset in before.episodes:
        lines.append(f"  {subset:<4}: before RL {before.text(subset)}")
        lines.append(f"        after RL  {after.text(subset)}")
    return lines


def _markdown(before: AgentEval, after: AgentEval) -> str:
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


class AgentJob:
    """``--agent``'s `Kind` (`main_job.job`): multi-turn episodes (`main_job.agent`) in place of single
    completions."""

    heading = "crf main job (--agent)"
    unit = "episodes"

    def headline(self, channels: Sequence[str]) -> str:
        return (
            f"crf main job, agentic (--agent): {' + '.join(channels)} on multi-turn episodes (run_tests / submit in a "
            f"sandboxed CodingEnvironment, up to {agent.MAX_TOOL_CALLS} programs each)"
        )

    def model_name(self, opts: argparse.Namespace) -> str:
        return "tiny (agent)"

    def policy(self, opts: argparse.Namespace) -> tuple[Any, Any]:
        return agent.build_agent_policy(opts.seed)

    def prepare(self, run: Run, train: list[CodingTask], tokenizer: Any) -> Prepared[list[Episode]]:
        """The multi-turn DPO pairs (``agent_pairs.jsonl``) and the warm-start episodes, played in the sandbox on
        train tasks and drills (``--quick``: fewer, a wiring check)."""
        opts = run.opts
        config = agent.env_config(tokenizer, isolation=run.isolation, timeout_s=opts.sandbox_timeout)
        pairs, pair_episodes = agent.write_agent_pairs(
            run.output / "agent_pairs.jsonl", train, DATA / "traces.jsonl", config=config
        )
        print(
            f"trace-replay DPO: {len(pair_episodes) // 2} multi-turn pairs (draft tested and fixed > draft submitted)"
        )
        per_template, every = (2, 8) if opts.quick else (DRILLS_PER_TEMPLATE, 1)
        drills = [d for i, d in enumerate(build_drills()) if i % 40 < per_template]
        easy = [t for t in train if not t.hard][::every]
        episodes = agent.warm_start_episodes(easy, drills, config=config, seed=opts.seed)
        texts = {
            "agent's task rows": [json.dumps(agent.agent_row(t)) for t in train],
            "warm-start episodes": list(agent.episode_texts(episodes)),
            "DPO pairs": [*agent.episode_texts(pair_episodes), *pairs.read_text(encoding="utf-8").splitlines()],
        }
        return Prepared(pairs, episodes, texts)

    def warm_start(self, run: Run, model: Any, tokenizer: Any, warm: list[Episode]) -> None:
        opts = run.opts
        first, last = agent.warm_start_agent(
            model, tokenizer, warm, steps=opts.warmup_steps, learning_rate=opts.warmup_lr, seed=opts.seed
        )
        print(
            f"warm start: {opts.warmup_steps} supervised steps on {len(warm)} episodes (easy train tasks and "
            f"drills: pass first time, repairs after run_tests, SDPO's reprompt), loss {first:.3f} -> {last:.3f}",
            flush=True,
        )

    def evaluate(self, run: Run, policy: Any, tokenizer: Any, tasks: list[CodingTask]) -> AgentEval:
        return agent.evaluate_agent(
            policy, tokenizer, tasks, max_completion_length=run.opts.max_completion_length, **run.sampling
        )

    def rate(self, evaluation: AgentEval) -> PassRate:
        return evaluation.rate

    def detail(self, evaluation: AgentEval) -> str:
        return f"; {evaluation.text()}"

    def section(self, outcome: JobOutcome, before: AgentEval, after: AgentEval) -> Section:
        return Section(
            terminal="\n".join(_report_lines(before, after)),
            markdown=_markdown(before, after),
            result={
                "agent": True,
                "episodes": {"before": before.episodes, "after": after.episodes},
                "phases": outcome.phases,
                "load_average": outcome.load_average,
            },
        )
