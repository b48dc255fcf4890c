"""The agentic main job (``--agent``): the tiny policy drafts, calls ``run_tests``, reads the result and submits.

The same task family, split, DiLoCo replicas and report as the single-completion job; what changes is the rollout.
Each rollout is an episode in a `crf_core.rewards.CodingEnvironment` (one per rollout, TRL's
``environment_factory``): the policy writes tool calls in the character tokenizer's tool format
(``build_char_tokenizer(tool_calling=True)``), TRL runs them in the sandbox, appends the (bounded) result and samples
the next turn, up to `MAX_TOOL_CALLS` programs per episode. A task is a row (`agent_row`)::

    {"prompt": [{"role": "user", "content": "def or_17(x):\\n    return"}], "entry_point": "f",
     "tests": ["assert candidate(40) == 57, '40 | 17'"],                    # run_tests: the task's first assert
     "hidden_tests": ["assert candidate(3) == 19, '3 | 17'", ...]}         # graded at submit only

The tests call ``candidate`` (HumanEval's convention, ``CodingEnvConfig.entry_point_key``) and the policy defines
it as ``f``: what it must read off the task is the operation and the constant, as in the single-completion job, not
a name to copy ~70 characters later (which a 2-layer character model does not learn in a short warm start).
``run_tests`` judges the visible test; ``submit`` is graded on the visible and the hidden ones, and that grade is
the reward. A good episode on a hard task, as the tiny policy writes it::

    @tools:run_python,run_tests,submit
    @U:def or_17(x):
        return
    @A:<call>{"name": "run_tests", "arguments": {"code": "def f(x):\\n    return x + 57"}}</call><eos>@T:1 of 1 tests
    failed.
    Test `assert candidate(40) == 57, '40 | 17'` failed: candidate(40) returned 97; expected 57.
    @A:<call>{"name": "submit", "arguments": {"code": "def f(x):\\n    return x | 17"}}</call><eos>@T:Submitted.
    @A:<eos>

What each part does (train tasks and drills only; `check_unseen` covers every text below):

* **warm start** (`warm_start_episodes`, trained by `warm_start_agent`: ``warm_start_on_episodes``' recipe, the
  assistant turns only, with the code's body weighted up): episodes played in the sandbox with ``demonstration_episode``, so every tool result is the
  environment's own: *pass first time* on easy train tasks (draft right, ``run_tests`` says so, submit); *repairs*,
  a weak draft and its failing ``run_tests`` result in the context and the fix submitted (easy train tasks and the
  drills ``def f_57(x)``, whose name says nothing: only the failing test's message gives the fix); and SDPO's
  reprompt (`TEMPLATE_FIELDS`: the failing result or a peer's correct episode above the task) followed by a
  pass-first-time episode, so the self-teacher can read what it is shown. Hard (bitwise) train tasks never appear.
* **trace-replay DPO** (`write_agent_pairs`): on the weak student's recorded train tasks (``data/traces.jsonl``),
  chosen = the recorded draft tested, its result read and the reference fix submitted, rejected = the draft
  submitted as is; crf-replaysim ``DPOPair`` records with the tool schemas, rendered as conversations
  (``trace_replay_render="auto"``): only assistant turns are scored.
* **RL** (`agent_trainer`): ``ComposerReplicationTrainer`` with ``environment_factory`` (no reward function: the
  environment's grade is the reward); SDPO's teacher reads the episode's failing ``run_tests`` result.
* **evaluation** (`evaluate_agent`): held-out rows through TRL's own multi-turn generation (a plain
  ``GRPOTrainer``, the rollouts' sampler, tool loop and parser), episodes snapshot after each generation batch
  (TRL reuses environment instances): pass rate per task, tool calls per episode and the share of episodes with a
  failing ``run_tests`` whose submission then passes (`crf_core.rewards.summarize_episodes`).
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from main_job.evaluate import PassRate
from main_job.tasks import CodingTask, weak_answer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental in TRL 1.16

__all__ = [
    "MAX_COMPLETION_LENGTH",
    "MAX_TOOL_CALLS",
    "REPROMPT_LEN",
    "TEMPLATE_FIELDS",
    "AgentEval",
    "agent_row",
    "agent_trainer",
    "build_agent_policy",
    "env_config",
    "episode_texts",
    "evaluate_agent",
    "tool_schemas",
    "warm_start_agent",
    "warm_start_episodes",
    "write_agent_pairs",
]

MAX_TOOL_CALLS = 3
"""Programs (``run_tests``/``run_python``) an episode may run, and TRL's ``max_tool_calling_iterations``."""
RESULT_CHARS = 300
"""Bound on each tool result the policy reads (``CodingEnvConfig.max_result_chars``)."""
MAX_COMPLETION_LENGTH = 640
"""Tokens per episode (the policy's turns and the tool results): a failing draft, its result and a fix take ~400."""
REPROMPT_LEN = 1024
"""``sdpo_max_reprompt_len``: the teacher's context (the reprompt with a tool result) in tokens."""
POSITIONS = 2048
"""The tiny model's context (rotary, no parameters): a teacher reprompt plus a whole episode."""
VISIBLE_TESTS = 1
"""The first of a task's three asserts is ``run_tests``'s; the other two are graded at ``submit`` only (a draft that
happens to pass one test still fails there)."""
ENTRY_POINT = "f"
"""The function the policy defines; the tests call it as ``candidate``."""

REPROMPT_TEMPLATE = "{solution}{feedback}{prompt}"
SOLUTION_TEMPLATE = "# A correct episode:\n{successful_previous_attempt}\n"
FEEDBACK_TEMPLATE = "# An earlier draft failed:\n{feedback_raw}\n"
TEMPLATE_FIELDS = {
    "reprompt_template": REPROMPT_TEMPLATE,
    "solution_template": SOLUTION_TEMPLATE,
    "feedback_template": FEEDBACK_TEMPLATE,
}
"""SDPO's reprompt in the agentic job: what the teacher knows more (a failing ``run_tests`` result, or a peer's
correct episode as its tool calls) in comment lines right above the task, as in `main_job.templates`."""

Messages = list[dict[str, Any]]
Episode = tuple[Messages, Messages]


# --------------------------------------------------------------------------- rows, environment, policy
def agent_row(task: CodingTask) -> dict[str, Any]:
    """The dataset row of ``task`` (see the module docstring): a chat prompt, the entry point, visible and hidden
    tests (the task's asserts, calling ``candidate``)."""
    tests = [test.replace(f"assert {task.name}(", "assert candidate(", 1) for test in task.tests]
    return {
        "prompt": [{"role": "user", "content": task.prompt}],
        "entry_point": ENTRY_POINT,
        "tests": tests[:VISIBLE_TESTS],
        "hidden_tests": tests[VISIBLE_TESTS:],
    }


def code(body: str) -> str:
    """The function the policy writes with ``body``: ``"def f(x):\\n    return x + 17"``."""
    return f"def {ENTRY_POINT}(x):\n    return{body}"


def env_config(tokenizer: Any, *, isolation: str, timeout_s: float) -> Any:
    """The episodes' `CodingEnvConfig`: hidden tests at submit, `MAX_TOOL_CALLS`, results within `RESULT_CHARS` with
    the tokenizer's special tokens stripped (a program cannot forge ``<eos>``)."""
    from crf_core.rewards import CodingEnvConfig

    return CodingEnvConfig(
        hidden_tests_key="hidden_tests",
        max_tool_calls=MAX_TOOL_CALLS,
        timeout_s=timeout_s,
        memory_mb=256,
        isolation=isolation,  # type: ignore[arg-type]
        max_result_chars=RESULT_CHARS,
        strip_strings=tuple(tokenizer.all_special_tokens),
    )


def tool_schemas() -> list[dict[str, Any]]:
    """The JSON schemas of the environment's tools, as TRL renders them into the prompt."""
    from transformers.utils import get_json_schema

    from crf_core.rewards import CodingEnvironment

    return [
        get_json_schema(t)
        for t in (CodingEnvironment.run_python, CodingEnvironment.run_tests, CodingEnvironment.submit)
    ]


def build_agent_policy(seed: int) -> tuple[Any, Any]:
    """The job's tiny Llama (2 layers, hidden 64) with the character tokenizer's tool-calling format."""
    from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm

    tokenizer = build_char_tokenizer(tool_calling=True)
    model = build_tiny_causal_lm(
        tokenizer, hidden_size=64, num_layers=2, num_heads=4, seed=seed, max_position_embeddings=POSITIONS
    )
    return model, tokenizer


# --------------------------------------------------------------------------- warm start and pairs
def _split(context: Messages, response: Messages, turns: int) -> Episode:
    """Move the first ``turns`` messages of ``response`` into the context (seen, not trained)."""
    return [*context, *response[:turns]], response[turns:]


def _reprompted(context: Messages, *, feedback: str | None = None, demonstration: Messages | None = None) -> Messages:
    """``context`` with its user message rewritten as SDPO's teacher sees it (``crf_core.trainer.reprompt``)."""
    from crf_core.trainer.reprompt import RepromptConfig, build_reprompts

    config = RepromptConfig(**TEMPLATE_FIELDS)
    if demonstration is not None:
        batch = build_reprompts([context] * 2, [demonstration, []], [1.0, 0.0], None, 2, config)
        return list(batch.reprompts[1].prompt)  # type: ignore[arg-type]
    batch = build_reprompts([context] * 2, [[], []], [0.0, 0.0], [feedback, None], 2, config)
    return list(batch.reprompts[0].prompt)  # type: ignore[arg-type]


def warm_start_episodes(
    easy: Sequence[CodingTask], drills: Sequence[CodingTask], *, config: Any, seed: int, workers: int = 2
) -> list[Episode]:
    """The warm start's ``(context, response)`` episodes (module docstring), played in the sandbox (``workers``
    episodes at a time).

    ``easy`` are easy *train* tasks, ``drills`` the feedback drills (`tasks.build_drills`); nothing else is read.
    """
    from concurrent.futures import ThreadPoolExecutor

    from crf_core.rewards import demonstration_episode

    rng = random.Random(seed)
    tasks = [*easy, *drills]
    drafts = [code(weak_answer(task, rng)) for task in tasks]
    choices = [rng.random() < 0.5 for _ in tasks]

    def play(index: int) -> tuple[Any, ...]:
        task, row = tasks[index], agent_row(tasks[index])
        right = code(task.solution)
        context, passed, _ = demonstration_episode(row, [("run_tests", right), ("submit", right)], config=config)
        _, repaired, episode = demonstration_episode(
            row, [("run_tests", drafts[index]), ("submit", right)], config=config
        )
        return context, passed, repaired, episode

    with ThreadPoolExecutor(max_workers=workers) as pool:
        played = list(pool.map(play, range(len(tasks))))
    first: list[Episode] = []
    repairs: list[Episode] = []
    reading: list[Episode] = []
    for index, (context, passed, repaired, episode) in enumerate(played):
        if not episode.calls[0].failed_tests:  # a weak draft that passes the visible tests teaches no reading
            continue
        if index < len(easy):
            first.append((context, passed))
        repairs.append(_split(context, repaired, 2))
        reading.append((_reprompted(context, feedback=episode.calls[0].result), passed))
        if choices[index]:
            reading.append((_reprompted(context, demonstration=passed), passed))
    return first * 2 + repairs + reading


BODY_WEIGHT = 30.0
"""Weight of the function body's tokens in the warm start's cross-entropy (the rest of the assistant turns: 1)."""
_BODY = re.compile(r'return(.*?)"\}\}</call>')


def _weighted_rows(tokenizer: Any, episodes: Sequence[Episode]) -> list[tuple[list[int], list[float]]]:
    """Each episode rendered as the rollouts are (``crf_core.trainer.conversation.render_conversation``, the tools
    in the prompt), with a weight per token: 0 off the assistant turns, `BODY_WEIGHT` on the code's body (what
    follows ``return`` up to the call's closing ``"}}``), 1 on the rest of the assistant turns."""
    from crf_core.trainer.conversation import render_conversation

    schemas = tool_schemas()
    rows = []
    for context, response in episodes:
        rendered = render_conversation(tokenizer, context, response, tools=schemas)
        pieces = tokenizer.convert_ids_to_tokens(list(rendered.input_ids))
        starts = [0]
        for piece in pieces:
            starts.append(starts[-1] + len(piece))
        weights = [float(t) for t in rendered.trained]
        text = "".join(pieces)
        for match in _BODY.finditer(text):
            low, high = match.start(1), match.end(1) + 3
            for i in range(len(pieces)):
                if rendered.trained[i] and low <= starts[i] < high:
                    weights[i] = BODY_WEIGHT
        rows.append((list(rendered.input_ids), weights))
    return rows


def warm_start_agent(
    model: Any,
    tokenizer: Any,
    episodes: Sequence[Episode],
    *,
    steps: int,
    learning_rate: float,
    seed: int,
    batch_size: int = 16,
) -> tuple[float, float]:
    """Supervised warm start on ``episodes``: ``crf_core.trainer.warm_start.warm_start_on_episodes``' recipe (the
    assistant turns of each rendered episode, tool results and context untrained; AdamW; batches drawn without
    replacement, reshuffled each pass, seeded) with one change: the code's body weighs `BODY_WEIGHT`.

    Why: a body (``" x | 17"``) is ~8 of the ~90 tokens of a tool call, the rest a fixed JSON format the policy
    learns in ~100 steps. Under the uniform cross-entropy that format holds most of the signal, and 800 steps left
    the 2-layer policy writing a correct first draft on 0% of the held-out tasks (measured on seed 0); with the
    body weighted, 57%, and 31% of its fixes after a failing ``run_tests`` right. Returns the weighted loss of the
    first and the last step (the mean over a batch's trained tokens, each counted by its weight)."""
    import torch

    rows = _weighted_rows(tokenizer, episodes)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    optimiser = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    rng = random.Random(seed)
    order: list[int] = []
    losses: list[float] = []
    was_training = model.training
    model.train()
    try:
        for _ in range(steps):
            batch = []
            while len(batch) < min(batch_size, len(rows)):
                if not order:
                    order = list(range(len(rows)))
                    rng.shuffle(order)
                batch.append(rows[order.pop()])
            width = max(len(ids) for ids, _ in batch)
            ids = torch.full((len(batch), width), int(pad), dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            weight = torch.zeros((len(batch), width))
            for i, (row, row_weight) in enumerate(batch):
                ids[i, : len(row)] = torch.tensor(row)
                attention[i, : len(row)] = 1
                weight[i, : len(row)] = torch.tensor(row_weight)
            ids, attention, weight = ids.to(device), attention.to(device), weight.to(device)
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
            token_loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            ).view(len(batch), -1)
            loss = (token_loss * weight[:, 1:]).sum() / weight[:, 1:].sum()
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            losses.append(float(loss.detach()))
    finally:
        model.train(was_training)
    return losses[0], losses[-1]


def episode_texts(episodes: Iterable[Episode]) -> Iterator[str]:
    """Every text of ``episodes``: message contents and tool-call code (for `tasks.check_unseen`)."""
    for context, response in episodes:
        for message in [*context, *response]:
            if isinstance(message.get("content"), str):
                yield message["content"]
            for call in message.get("tool_calls") or []:
                arguments = call["function"]["arguments"]
                yield arguments["code"] if isinstance(arguments, dict) else str(arguments)


def write_agent_pairs(
    path: Path, train: Sequence[CodingTask], traces: Path, *, config: Any, workers: int = 2
) -> tuple[Path, list[Episode]]:
    """DPO pairs from the weak student's recorded drafts on train tasks (``traces``): chosen = the draft tested, its
    result read and the reference fix submitted, rejected = the draft submitted as is (each up to the submit's
    result: crf-replaysim refuses an empty closing turn), each played in the sandbox
    (``demonstration_episode``, ``workers`` at a time). Writes crf-replaysim ``DPOPair`` records to ``path``; returns
    it and the episodes played (for `check_unseen`)."""
    from concurrent.futures import ThreadPoolExecutor

    from crf_core.rewards import demonstration_episode
    from crf_replaysim import DPOPair

    by_name = {t.name: t for t in train}
    recorded = []
    for line in traces.read_text(encoding="utf-8").splitlines():
        trace = json.loads(line)
        task = by_name[trace["meta"]["task"]]  # a KeyError here is a trace of no train task: a data error
        recorded.append((task, code(trace["messages"][-1]["content"])))

    def play(item: tuple[CodingTask, str]) -> tuple[Any, ...]:
        task, draft = item
        row = agent_row(task)
        fix = [("run_tests", draft), ("submit", code(task.solution))]
        context, chosen, tested = demonstration_episode(row, fix, config=config)  # type: ignore[arg-type]
        _, rejected, _ = demonstration_episode(row, [("submit", draft)], config=config)
        return task, context, chosen, rejected, tested

    def openai(messages: Messages) -> Messages:
        """crf-replaysim's record shape: arguments as JSON text, no empty closing assistant turn."""
        if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
            messages = messages[:-1]
        return [
            {
                **m,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ],
            }
            if m.get("tool_calls")
            else m
            for m in messages
        ]

    schemas = tool_schemas()
    lines, played = [], []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for task, context, chosen, rejected, tested in pool.map(play, recorded):
            if not tested.calls[0].failed_tests:  # a recorded draft that passes is no rejected answer
                continue
            pair = DPOPair(
                context, openai(chosen), openai(rejected), f"agent-{task.name}", turn=1, meta={"tools": schemas}
            )
            lines.append(json.dumps(pair.to_dj_record()))
            played += [(context, chosen), (context, rejected)]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path, played


# --------------------------------------------------------------------------- RL
def agent_trainer(spec: Any, common: dict[str, Any], model: Any, tokenizer: Any, dataset: Any) -> Any:
    """The replica's ``ComposerReplicationTrainer`` on multi-turn rollouts: ``common`` (the job's settings, as
    ``replica.build_trainer`` makes them) plus a `CodingEnvironment` per rollout instead of a reward function."""
    from crf_core.rewards import CodingEnvironment
    from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer

    config = ComposerConfig(
        **common,
        max_tool_calling_iterations=MAX_TOOL_CALLS,
        grpo_weight=spec.weights["grpo"],
        sdpo_weight=spec.weights["sdpo_jsd"],
        trace_replay_dpo_weight=spec.weights["trace_replay_dpo"],
        trace_replay_path=spec.pairs if spec.weights["trace_replay_dpo"] > 0 else None,
        trace_replay_batch_size=4,
        trace_replay_render="auto",
        trace_replay_max_length=MAX_COMPLETION_LENGTH + 128,
        sdpo_alpha=spec.sdpo_alpha,
        sdpo_top_k=spec.sdpo_top_k,
        sdpo_truncate_below=spec.sdpo_truncate_below,
        sdpo_teacher_update_rate=spec.sdpo_teacher_update_rate,
        sdpo_include_environment_feedback=spec.sdpo_feedback,
        sdpo_routing=spec.sdpo_routing,
        sdpo_group_weight=spec.sdpo_group_weight,
        sdpo_max_reprompt_len=REPROMPT_LEN,
        **{f"sdpo_{name}": text for name, text in TEMPLATE_FIELDS.items()},
    )
    factory = CodingEnvironment.factory(env_config(tokenizer, isolation=spec.isolation, timeout_s=spec.sandbox_timeout))
    return ComposerReplicationTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, environment_factory=factory
    )


# --------------------------------------------------------------------------- evaluation
@dataclass(frozen=True)
class AgentEval:
    """One evaluation of the agent on held-out tasks: the pass rate per task (`PassRate`, a sample passes when its
    submission passes every visible and hidden test) and the episodes' statistics, on all tasks and on the hard
    subset: ``{"all"|"hard"|"easy": {"tool_calls": ..., "repair": ..., "failed_drafts": ..., "submitted": ...}}``."""

    rate: PassRate
    episodes: dict[str, dict[str, float | None]]

    def text(self, subset: str = "all") -> str:
        stats = self.episodes[subset]
        repair = stats["repair"]
        return (
            f"{stats['tool_calls']:.2f} tool calls per episode, {stats['submitted']:.0%} submitted, "
            f"{stats['failed_drafts']:.0%} saw a failing run_tests, of which "
            + ("none" if repair is None else f"{repair:.0%}")
            + " were fixed"
        )


def _stats(episodes: Sequence[Any]) -> dict[str, float | None]:
    from crf_core.rewards import summarize_episodes

    summary = summarize_episodes(list(episodes))
    return {
        "tool_calls": summary.mean_tool_calls,
        "submitted": summary.submitted,
        "failed_drafts": sum(e.saw_failure for e in episodes) / len(episodes),
        "repair": summary.repair_rate,
        "pass_rate": summary.pass_rate,
    }


def evaluate_agent(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[CodingTask],
    *,
    samples: int,
    temperature: float,
    seed: int,
    isolation: str,
    timeout_s: float,
    max_completion_length: int = MAX_COMPLETION_LENGTH,
    batch_episodes: int = 128,
    on_batch: Callable[[int, int], None] | None = None,
) -> AgentEval:
    """``samples`` episodes per task through TRL's multi-turn generation (a plain ``GRPOTrainer`` in eval mode with
    a `CodingEnvironment` per rollout), each judged by its environment; seeded, so before and after RL draw alike."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from crf_core.rewards import CodingEnvironment

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    # TRL calls transformers' gradient-checkpointing helpers under their pre-v6 names; nothing a user can act on.
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated", category=FutureWarning)
    per_batch = max(1, batch_episodes // samples)
    rows = [agent_row(t) for t in tasks]
    device = next(model.parameters()).device
    with tempfile.TemporaryDirectory(prefix="crf-agent-eval-") as scratch:
        trainer = GRPOTrainer(
            model=model,
            args=GRPOConfig(
                output_dir=scratch,
                per_device_train_batch_size=max(2, samples),  # unused (no training) but checked by GRPOConfig
                per_device_eval_batch_size=samples,
                num_generations=max(2, samples),
                num_generations_eval=samples,
                max_completion_length=max_completion_length,
                max_tool_calling_iterations=MAX_TOOL_CALLS,
                temperature=temperature,
                report_to=[],
                use_cpu=device.type == "cpu",
                bf16=False,
                disable_tqdm=True,
                save_strategy="no",
            ),
            train_dataset=Dataset.from_list(rows[:1]),
            processing_class=tokenizer,
            environment_factory=CodingEnvironment.factory(
                env_config(tokenizer, isolation=isolation, timeout_s=timeout_s)
            ),
        )
        episodes: list[Any] = []
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                torch.manual_seed(seed)
                for start in range(0, len(rows), per_batch):
                    batch = [row for row in rows[start : start + per_batch] for _ in range(samples)]
                    trainer._generate_and_score_completions(batch)
                    episodes += [env.episode for env in trainer.environments]  # snapshot: instances are reused
                    if on_batch is not None:
                        on_batch(min(start + per_batch, len(rows)), len(rows))
        finally:
            model.train(was_training)
    passed = [e.outcome is not None and e.outcome.passed == e.outcome.total for e in episodes]
    per_task = tuple(sum(passed[i * samples : (i + 1) * samples]) / samples for i in range(len(tasks)))
    groups = {"all": episodes}
    hard = [e for i, e in enumerate(episodes) if tasks[i // samples].hard]
    easy = [e for i, e in enumerate(episodes) if not tasks[i // samples].hard]
    if hard and easy:
        groups.update(easy=easy, hard=hard)
    return AgentEval(
        PassRate(tuple(t.name for t in tasks), per_task, samples), {k: _stats(v) for k, v in groups.items()}
    )
