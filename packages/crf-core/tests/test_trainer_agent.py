"""Coding-agent rollouts end to end: ``ComposerReplicationTrainer`` + TRL's ``environment_factory`` + the sandbox.

Every rollout runs through TRL 1.16's own multi-turn machinery (``_generate`` → ``parse_response`` →
``_tool_call_loop`` → the tools of a ``CodingEnvironment`` per rollout → ``tool_mask`` → ``get_reward``), then through
crf's three channels, with the character tokenizer's tool-calling format (``build_char_tokenizer(tool_calling=True)``).

What the policy writes comes from one of two places:

* a **warm-started tiny model** (``test_tiny_policy_calls_tools_through_trl``): a one-layer model taught the format
  on one demonstration episode (``crf_core.trainer.warm_start``), then sampled by TRL;
* a **script** (every other test): ``ScriptedSampler`` replaces TRL's ``_generate_single_turn`` (sampling only) so
  each rollout writes a chosen episode: a failing draft, ``run_tests``, a fix, ``submit``; or a hostile program. The
  tiny model still scores every token and takes every gradient step.

The tests: tool calls executed in the sandbox; gradients exactly zero at tool-result positions in every channel; the
SDPO teacher's reprompt carries what ``run_tests`` returned; a hostile tool argument (fork bomb, huge output, secret
reads) contained with the trainer alive; checkpoint and resume mid-run; multi-turn DPO pairs from crf-replaysim's
records into the trainer.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")
pytest.importorskip("crf_replaysim", reason="pair records come from crf-replaysim ([train] extra)")

import torch
from datasets import Dataset
from trl import GRPOTrainer

from crf_core.rewards import CodingEnvironment
from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer
from crf_core.trainer.pairs import collate_pairs
from crf_core.trainer.state import STATE_FILE
from crf_core.trainer.tiny_model import build_char_tokenizer, build_tiny_causal_lm
from crf_core.trainer.warm_start import warm_start_on_episodes
from crf_replaysim import DPOPair

pytestmark = pytest.mark.usefixtures("bwrap")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental in TRL 1.16

TOOLS = [CodingEnvironment.run_python, CodingEnvironment.run_tests, CodingEnvironment.submit]
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
MUL_TESTS = ["assert mul(2, 3) == 6"]
RIGHT_ADD, WRONG_ADD = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b"
WRONG_MUL = "def mul(a, b):\n    return a + b"
HOSTILE = """import os, glob
for path in ["SECRET_FILE", "/proc/1/environ"] + glob.glob("/proc/*/environ"):
    try:
        print(open(path).read())
    except OSError as exc:
        print("unreadable", type(exc).__name__)
print(dict(os.environ))
print("x" * 3000000)
while True:
    try:
        os.fork()
    except OSError:
        pass"""


def call(tool: str, code: str) -> str:
    """One assistant turn calling ``tool`` in the tiny format (what the policy writes, EOS included)."""
    return "<call>" + json.dumps({"name": tool, "arguments": {"code": code}}) + "</call><eos>"


#: task (the user message) -> alternatives, each the assistant turns of one episode; a group's rollouts take the
#: alternatives in turn. add: a draft fixed after feedback (reward 1) and one submitted unfixed (reward 0);
#: mul: both fail, one after reading run_tests' feedback (SDPO then has only the feedback to go on).
SCRIPTS: dict[str, list[list[str]]] = {
    "add": [
        [call("run_tests", WRONG_ADD), call("submit", RIGHT_ADD), "<eos>"],
        [call("run_python", "print(add)"), call("submit", WRONG_ADD), "<eos>"],
    ],
    "mul": [
        [call("run_tests", WRONG_MUL), call("submit", WRONG_MUL), "<eos>"],
        [call("submit", WRONG_MUL), "<eos>"],
    ],
    "evil": [[call("run_python", HOSTILE), "<eos>"]],
}


class ScriptedSampler:
    """Stands in for ``GRPOTrainer._generate_single_turn``: for each prompt (a rollout's whole context so far), the
    next assistant turn of its episode, as token ids. Everything else about the rollout is TRL's."""

    def __init__(self, tokenizer: Any, scripts: dict[str, list[list[str]]]) -> None:
        self.tokenizer, self.scripts = tokenizer, scripts
        self.turns = 0

    def __call__(self, prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> tuple[list[list[int]], None]:
        seen: Counter[str] = Counter()
        out = []
        for ids in prompt_ids:
            text = self.tokenizer.decode(ids)
            task, history = text.rsplit("@U:", 1)[1].split("\n", 1)
            step = history.count("<eos>@T:")
            episodes = self.scripts[task]
            if step == 0:
                episode = episodes[seen[task] % len(episodes)]
                seen[task] += 1
            else:
                episode = next(e for e in episodes if history.startswith("@A:" + e[0]))
            out.append(self.tokenizer(episode[step], add_special_tokens=False)["input_ids"])
            self.turns += 1
        return out, None


def _pairs() -> list[dict[str, Any]]:
    """A multi-turn trace-replay pair as crf-replaysim writes it (OpenAI tool calls, arguments as JSON text)."""
    pair = DPOPair(
        prompt_messages=[{"role": "user", "content": "add"}],
        chosen_messages=[
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "run_tests", "arguments": json.dumps({"code": RIGHT_ADD})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "All 2 tests passed."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "submit", "arguments": json.dumps({"code": RIGHT_ADD})},
                    }
                ],
            },
        ],
        rejected_messages=[
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c3",
                        "type": "function",
                        "function": {"name": "submit", "arguments": json.dumps({"code": WRONG_ADD})},
                    }
                ],
            }
        ],
        trace_id="add-1",
        turn=1,
        meta={"tools": [{"type": "function", "function": {"name": t.__name__}} for t in TOOLS]},
    )
    return [pair.to_dj_record()]


def _trainer(
    output_dir: Path,
    tasks: list[dict[str, Any]],
    *,
    sampler: bool = True,
    model: Any = None,
    **overrides: Any,
) -> ComposerReplicationTrainer:
    tokenizer = build_char_tokenizer(tool_calling=True)
    if model is None:
        model = build_tiny_causal_lm(
            tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=1024, seed=3
        )
    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 600,
        "max_tool_calling_iterations": 4,
        "max_steps": 1,
        "logging_steps": 1,
        "learning_rate": 5e-3,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "bf16": False,
        "seed": 7,
        "data_seed": 7,
        "sdpo_top_k": 8,
        "sdpo_max_reprompt_len": 1024,
        "trace_replay_dpo_weight": 0.5,
        "trace_replay_batch_size": 1,
        "trace_replay_max_length": 512,
        "lm_head_chunking": "on",
        "chunk_size": 64,
    }
    trainer = ComposerReplicationTrainer(
        model=model,
        args=ComposerConfig(**{**settings, **overrides}),
        train_dataset=Dataset.from_list(tasks * 4),
        processing_class=tokenizer,
        environment_factory=CodingEnvironment.factory(
            timeout_s=3.0, memory_mb=256, max_result_chars=300, strip_strings=tuple(tokenizer.all_special_tokens)
        ),
        trace_replay_pairs=_pairs(),
    )
    if sampler:
        trainer._generate_single_turn = ScriptedSampler(tokenizer, SCRIPTS)  # type: ignore[method-assign]
    return trainer


TASKS = [
    {"prompt": [{"role": "user", "content": "add"}], "tests": ADD_TESTS},
    {"prompt": [{"role": "user", "content": "mul"}], "tests": MUL_TESTS},
]


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[ComposerReplicationTrainer, dict[str, Any]]:
    """One generation batch (add, add, mul, mul) through TRL's multi-turn machinery, and its trainer."""
    trainer = _trainer(tmp_path_factory.mktemp("generated"), TASKS)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); the batch is scored outside it here
    batch = trainer._generate_and_score_completions([TASKS[0], TASKS[0], TASKS[1], TASKS[1]])
    return trainer, batch


def test_tool_calls_run_in_the_sandbox(generated: tuple[ComposerReplicationTrainer, dict[str, Any]]) -> None:
    trainer, batch = generated
    episodes = [env.episode for env in trainer.environments]
    assert [[c.tool for c in e.calls] for e in episodes] == [
        ["run_tests", "submit"],
        ["run_python", "submit"],
        ["run_tests", "submit"],
        ["submit"],
    ]
    assert episodes[0].calls[0].result.startswith("2 of 2 tests failed.")
    assert "add(1, 2) returned -1; expected 3" in episodes[0].calls[0].result
    assert episodes[1].calls[0].result.startswith("exit status 1")  # `add` is not defined in a fresh sandbox
    assert "NameError" in episodes[1].calls[0].result
    assert [e.reward for e in episodes] == [1.0, 0.0, 0.0, 0.0]
    assert episodes[0].repaired
    assert not episodes[2].repaired
    assert trainer._metrics["train"]["rewards/CodingEnvironment/mean"][-1] == pytest.approx(0.25)
    assert trainer._metrics["train"]["tools/call_frequency"][-1] == pytest.approx(7 / 4)
    # the tool results are in the completions, masked out of the loss
    tool_mask, completion_mask = batch["tool_mask"], batch["completion_mask"]
    assert bool(((completion_mask * (1 - tool_mask)).sum(1) > 0).all())
    text = trainer.processing_class.decode(batch["completion_ids"][0][(completion_mask[0] * (1 - tool_mask[0])) > 0])
    assert "@T:2 of 2 tests failed." in text
    assert "@T:Submitted." in text
    assert "<call>" not in text  # nothing the policy wrote is masked
    assert batch["advantages"][0] > 0 > batch["advantages"][1]


@contextmanager
def final_states(model: Any) -> Iterator[list[torch.Tensor]]:
    """The decoder's last hidden states of every forward that builds a graph (see ``test_trainer_tool_mask``)."""
    captured: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_hook(
        lambda module, args, output: captured.append(output) if output.requires_grad else None
    )
    try:
        yield captured
    finally:
        handle.remove()


def _check_zero_at_tool_results(grad: torch.Tensor, batch: dict[str, Any]) -> None:
    p = batch["prompt_ids"].shape[1]
    c = batch["completion_ids"].shape[1]
    rows = grad[:, p - 1 : p - 1 + c]
    tool = (batch["completion_mask"] * (1 - batch["tool_mask"])) > 0
    trained = (batch["completion_mask"] * batch["tool_mask"]) > 0
    assert int(tool.sum()) > 100  # run_tests' feedback, "Submitted." and the role markers
    assert bool((rows[tool] == 0).all()), "a tool-result token received a gradient"
    assert bool((rows[trained].abs().sum(-1) > 0).any())


def test_every_channel_has_zero_gradient_at_tool_results(
    generated: tuple[ComposerReplicationTrainer, dict[str, Any]],
) -> None:
    trainer, batch = generated
    model = trainer.model
    assert bool((batch["sdpo_mask"] > 0).any())
    with final_states(model) as states:
        grpo = GRPOTrainer.compute_loss(trainer, model, dict(batch))  # TRL's loss on crf's chunked scores
    (grad,) = torch.autograd.grad(grpo, [states[0]])
    _check_zero_at_tool_results(grad, batch)
    with final_states(model) as states:
        sdpo = trainer.sdpo_channel_loss(model, dict(batch))
    assert sdpo is not None
    (grad,) = torch.autograd.grad(sdpo, [states[0]])
    _check_zero_at_tool_results(grad, batch)
    with final_states(model) as states:
        composed = trainer.compute_loss(model, dict(batch))
    assert len(states) == 2  # the rollouts' shared GRPO + SDPO pass, and the DPO pairs' pass
    grad_rollouts, grad_pairs = torch.autograd.grad(composed, states)
    _check_zero_at_tool_results(grad_rollouts, batch)
    pair = collate_pairs(trainer._pairs[:1], trainer._pad_id())
    response = pair.response_mask.bool()
    predicts_scored = torch.zeros_like(response)
    predicts_scored[:, :-1] = response[:, 1:]
    chosen_tokens = len(trainer._pairs[0].prompt_ids) + len(trainer._pairs[0].chosen_ids)
    unscored = torch.zeros_like(response)
    unscored[0, len(trainer._pairs[0].prompt_ids) - 1 : chosen_tokens - 1] = True
    unscored &= ~predicts_scored
    assert bool(unscored.any())
    assert bool((grad_pairs[unscored] == 0).all()), "a tool-result token of a DPO pair received a gradient"


def test_sdpo_reprompt_carries_the_run_tests_feedback(
    generated: tuple[ComposerReplicationTrainer, dict[str, Any]],
) -> None:
    trainer, batch = generated
    decode = trainer.processing_class.decode
    prompts = [
        decode(ids[mask > 0])
        for ids, mask in zip(batch["sdpo_teacher_prompt_ids"], batch["sdpo_teacher_prompt_mask"], strict=True)
    ]
    feedback = trainer.environments[2].feedback
    assert feedback is not None
    assert "mul(2, 3) returned 5; expected 6" in feedback
    # mul, first rollout: no successful peer, so the teacher reads what run_tests returned in the episode
    assert "The following is feedback from your unsuccessful earlier attempt" in prompts[2]
    assert feedback in prompts[2]
    # add, second rollout: the successful peer's actions are the demonstration (tool calls as name(arguments))
    assert "Correct solution:" in prompts[1]
    assert 'submit({"code": "def add(a, b):\\n    return a + b"})' in prompts[1]
    assert "2 of 2 tests failed." not in prompts[1]  # tool results are not part of a demonstration
    # mul, second rollout: it never ran the tests, so there is no feedback and no teacher signal
    assert batch["sdpo_mask"][3] == 0
    assert trainer._metrics["train"]["self_distillation/feedback_used_fraction"][-1] > 0


def test_hostile_tool_argument_is_contained_with_the_trainer_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "crf-agent-" + uuid.uuid4().hex
    monkeypatch.setenv("CRF_AGENT_TEST_TOKEN", secret)
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "secret.txt").write_text(secret)
    scripts = {"evil": [[call("run_python", HOSTILE.replace("SECRET_FILE", str(canary / "secret.txt"))), "<eos>"]]}
    tasks = [{"prompt": [{"role": "user", "content": "evil"}], "tests": ADD_TESTS}]
    trainer = _trainer(tmp_path / "out", tasks, max_steps=2)
    trainer._generate_single_turn = ScriptedSampler(trainer.processing_class, scripts)  # type: ignore[method-assign]
    result = trainer.train()
    assert trainer.state.global_step == 2  # both steps ran: the trainer survived the fork bomb
    assert math.isfinite(result.training_loss)
    for env in trainer.environments:
        (hostile,) = env.episode.calls
        assert hostile.tool == "run_python"
        assert hostile.result.startswith("Timed out"), hostile.result
        assert secret not in hostile.result
        assert len(hostile.result) <= 300
    logged = json.dumps([trainer._logs["completion"], trainer.state.log_history], default=str)
    assert secret not in logged
    assert (canary / "secret.txt").read_text() == secret
    assert sorted(p.name for p in canary.iterdir()) == ["secret.txt"]


def test_checkpoint_and_resume_mid_run(tmp_path: Path) -> None:
    """Two steps straight (checkpoint after the first) against a fresh trainer resumed from that checkpoint: the
    policy, the EMA self-teacher and the pair cursor end identical."""
    straight = _trainer(tmp_path / "straight", TASKS, max_steps=2, save_strategy="steps", save_steps=1)
    straight.train()
    checkpoint = tmp_path / "straight" / "checkpoint-1"
    assert (checkpoint / STATE_FILE).exists()
    resumed = _trainer(tmp_path / "resumed", TASKS, max_steps=2, save_strategy="steps", save_steps=1)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 2
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert straight.sdpo_teacher is not None
    assert resumed.sdpo_teacher is not None
    for name, a in straight.sdpo_teacher.state_dict().items():
        assert torch.equal(a, resumed.sdpo_teacher.state_dict()[name]), name
    assert straight.pair_cursor is not None
    assert resumed.pair_cursor is not None
    assert straight.pair_cursor.state_dict() == resumed.pair_cursor.state_dict()
    assert [e.episode.reward for e in resumed.environments] == [e.episode.reward for e in straight.environments]


def test_multi_turn_pairs_round_trip_from_replaysim_records(tmp_path: Path) -> None:
    """crf-replaysim's records (its shipped agent-trace pairs and a pair written here) → pair file → trainer: the
    conversation intact, only assistant turns (tool calls included) scored, a DPO step with a finite loss."""
    from crf_replaysim import example_pairs_path

    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps(r) for r in _pairs()] + example_pairs_path("records").read_text().splitlines()
    path.write_text("\n".join(lines) + "\n")
    tokenizer = build_char_tokenizer(tool_calling=True)
    trainer = ComposerReplicationTrainer(
        model=build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, max_position_embeddings=2048),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=ComposerConfig(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=4,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            sdpo_weight=0.0,
            trace_replay_dpo_weight=1.0,
            trace_replay_path=str(path),
            trace_replay_max_length=2048,
            trace_replay_strict=True,
        ),
        train_dataset=Dataset.from_list([{"prompt": "x"}] * 4),
        processing_class=tokenizer,
    )
    assert len(trainer._pairs) == 5
    ours = trainer._pairs[0]
    assert ours.chosen_mask is not None
    assert ours.rejected_mask is not None
    text = tokenizer.decode(ours.chosen_ids)
    scored = tokenizer.decode([t for t, m in zip(ours.chosen_ids, ours.chosen_mask, strict=True) if m])
    assert "@T:All 2 tests passed.\n" in text
    assert scored == call("run_tests", RIGHT_ADD) + call("submit", RIGHT_ADD)
    shipped = trainer._pairs[1]  # run_command(...) chosen over an edit without running the tests
    shipped_scored = tokenizer.decode(
        [t for t, m in zip(shipped.chosen_ids, shipped.chosen_mask or [], strict=True) if m]
    )
    assert shipped_scored.startswith('<call>{"name": "run_command", "arguments": {"command": "python -m pytest')
    assert "@tools:read_file,run_command,edit_file,search_code\n" in tokenizer.decode(shipped.prompt_ids)
    trainer.model.train()
    loss = trainer.trace_replay_channel_loss(trainer.model, [0, 1, 2, 3, 4])
    assert math.isfinite(float(loss.detach()))
    loss.backward()
    assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in trainer.model.parameters())


@pytest.fixture(scope="module")
def warm_policy() -> Any:
    """A one-layer tiny model taught one episode (run_tests, then submit, then stop) by a short warm start."""
    tokenizer = build_char_tokenizer(tool_calling=True)
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=1024)
    code = "def f():\n    return 1"
    response = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "run_tests", "arguments": {"code": code}}}],
        },
        {"role": "tool", "name": "run_tests", "content": "All 1 tests passed."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "submit", "arguments": {"code": code}}}],
        },
        {"role": "tool", "name": "submit", "content": "Submitted."},
        {"role": "assistant", "content": ""},
    ]
    report = warm_start_on_episodes(
        model,
        tokenizer,
        [([{"role": "user", "content": "f"}], response)],
        tools=TOOLS,
        steps=100,
        learning_rate=1e-2,
        batch_size=1,
    )
    assert report.last_loss < 0.05 < report.first_loss
    return model


def test_tiny_policy_calls_tools_through_trl(tmp_path: Path, warm_policy: Any) -> None:
    """The warm-started tiny model itself, sampled by TRL, writes tool calls the environment runs in the sandbox."""
    tasks = [{"prompt": [{"role": "user", "content": "f"}], "tests": ["assert f() == 1"]}]
    trainer = _trainer(tmp_path, tasks, sampler=False, model=warm_policy, temperature=0.7)
    trainer.train()
    episodes = [env.episode for env in trainer.environments]
    ran = [c for e in episodes for c in e.calls if c.tool == "run_tests" and c.refused is None]
    assert ran, [trainer._logs["completion"][-4:]]
    assert all(c.result == "All 1 tests passed." for c in ran)
    assert any(e.reward == 1.0 for e in episodes)
    logged = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry]
    assert logged
    assert logged[-1]["tools/call_frequency"] > 0
