"""The main job's data and plumbing (``examples/main_job``), without training: training never sees a held-out
task, task files and job records are checked, intervals are right, bad arguments are refused, credentials stay
out of the report. Needs only crf-core, so it runs in every crf-core session."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture
def tasks(composer_main: ModuleType) -> ModuleType:
    import main_job.tasks

    return main_job.tasks


# --------------------------------------------------------------------------- training never sees held-out tasks
def test_heldout_tasks_share_no_instance_with_anything_training_reads(tasks: ModuleType) -> None:
    """Structural: no held-out (template, k), name, prompt or solution occurs in the train tasks, the warm-start
    demonstrations or the recorded traces; every split side covers every template."""
    train = tasks.load_tasks(tasks.DATA / "tasks_train.jsonl")
    heldout = tasks.load_tasks(tasks.DATA / "tasks_heldout.jsonl")
    demos = tasks.load_demonstrations(tasks.DATA / "demonstrations.jsonl")
    traces = [json.loads(line) for line in (tasks.DATA / "traces.jsonl").read_text().splitlines()]
    assert (len(train), len(heldout)) == (250, 88)
    assert (sum(t.hard for t in train), sum(t.hard for t in heldout)) == (82, 28)
    assert {(t.template, t.k) for t in train}.isdisjoint({(t.template, t.k) for t in heldout})
    assert {t.template for t in train} == {t.template for t in heldout} == {t.stem for t in tasks.TEMPLATES}
    assert {t.template for t in train if t.hard} == {t.template for t in heldout if t.hard} == set(tasks.HARD_TEMPLATES)
    assert not {d.task for d in demos} & {t.name for t in train if t.hard}  # the warm start lacks the hard tasks
    assert {t.prompt for t in heldout}.isdisjoint({t.prompt for t in train} | {d.prompt for d in demos})
    assert {t.solution for t in heldout}.isdisjoint({d.completion for d in demos})
    assert {d.task for d in demos} <= {t.name for t in train}
    assert all(d.completion == next(t.solution for t in train if t.name == d.task) for d in demos)
    assert {tr["meta"]["task"] for tr in traces} <= {t.name for t in train}
    trace_texts = [m["content"] for tr in traces for m in tr["messages"]]
    rng = random.Random(0)
    drills = tasks.build_drills()
    tasks.check_unseen(
        heldout,
        {
            "train tasks": [x for t in train for x in (t.prompt, t.solution, *t.tests)],
            "demonstrations": [x for d in demos for x in (d.prompt, d.completion)],
            "warm-start drills": [x for d in drills for x in (d.prompt, d.solution, *d.tests)],
            "weak attempts": [tasks.weak_answer(t, rng) for t in [*train, *drills] for _ in range(5)],
            "traces": trace_texts,
        },
    )


def test_shipped_data_is_what_the_generator_writes(tasks: ModuleType, tmp_path: Path) -> None:
    """The files under examples/data are ``write_data()``'s output, so the split above is the documented one."""
    tasks.write_data(tmp_path)
    for name in ("tasks_train.jsonl", "tasks_heldout.jsonl", "demonstrations.jsonl", "traces.jsonl"):
        assert (tmp_path / name).read_bytes() == (tasks.DATA / name).read_bytes(), name


def test_each_task_is_passed_by_its_reference_and_by_no_other_body_of_the_family(tasks: ModuleType) -> None:
    """The tests decide: each reference solution passes all of its task's tests, and the body of every other
    instance (another operation, another constant) fails at least one (checked in-process: the bodies are ours)."""
    family = tasks.build_family()
    for task in family:
        scope: dict[str, Any] = {}
        calls = [compile(test.removeprefix("assert ").split(" == ")[0], "<test>", "eval") for test in task.tests]
        expected = [eval(test.split(" == ")[1].split(", ")[0]) for test in task.tests]
        passing = []
        for body in {t.solution for t in family}:
            exec(task.prompt + body, scope)
            if [eval(call, scope) for call in calls] == expected:
                passing.append(body)
        assert passing == [task.solution], (task.name, passing)


def test_hard_tasks_are_absent_from_the_warm_start_and_drills_share_no_body_with_a_task(tasks: ModuleType) -> None:
    """The mechanism the hard subset exists for: no warm-start batch holds a hard task or its operation's answer to
    one, and the feedback drills (whose operation only the test's message tells) share no body with any task."""
    import random

    from main_job.feedback import FeedbackExample
    from main_job.policy import warm_start_examples

    family = tasks.build_family()
    drills = tasks.build_drills()
    assert {d.solution for d in drills}.isdisjoint({t.solution for t in family})
    assert {d.template for d in drills} == {t.stem for t in tasks.TEMPLATES}  # reading every operator
    demos = tasks.load_demonstrations(tasks.DATA / "demonstrations.jsonl")
    feedback = [FeedbackExample(d.name, d.prompt, " x + 1", "1 of 3 tests failed.", d.solution) for d in drills]
    rng = random.Random(0)
    batches = [warm_start_examples(demos, feedback, rng, 16) for _ in range(20)]
    hard = [t for t in family if t.hard]
    texts = [text for batch in batches for pair in batch for text in pair]
    tasks.check_unseen(hard, {"warm-start batches": texts})
    assert any("A correct answer" in c for batch in batches for c, _ in batch)
    assert any("An earlier answer failed" in c for batch in batches for c, _ in batch)
    for task in family:  # every test's message is the wanted expression at the test's argument
        for test in task.tests:
            call, rest = test.removeprefix("assert ").split(" == ")
            value, message = rest.split(", ", 1)
            x = call[call.index("(") + 1 : -1]
            assert eval(message) == re.sub(r"\bx\b", x, task.solution.strip())
            assert eval(eval(message)) == eval(value)


def test_check_unseen_catches_a_leak_by_name_or_prompt(tasks: ModuleType) -> None:
    heldout = tasks.load_tasks(tasks.DATA / "tasks_heldout.jsonl")
    leaked = heldout[3]
    with pytest.raises(ValueError, match=rf"held-out task '{leaked.name}' occurs in the DPO pairs"):
        tasks.check_unseen(heldout, {"DPO pairs": ["x", f"assert {leaked.name}(1) == 2"]})
    with pytest.raises(ValueError, match="occurs in the demonstrations"):
        tasks.check_unseen(heldout, {"demonstrations": [leaked.prompt]})
    longer = f"{leaked.name}0"  # add_17 must not match add_170
    tasks.check_unseen([leaked], {"train tasks": [f"def {longer}(x):"]})


def test_bad_task_files_are_refused_naming_the_line(tasks: ModuleType, tmp_path: Path) -> None:
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"name": "add_2", "prompt": "p"}\n')
    with pytest.raises(ValueError, match=r"tasks.jsonl:1: task 'add_2' lacks \['k', 'solution', 'template', 'tests'\]"):
        tasks.load_tasks(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match=r"tasks\.jsonl:1 is not valid JSON"):
        tasks.load_tasks(bad)
    bad.write_text("")
    with pytest.raises(ValueError, match="holds no tasks"):
        tasks.load_tasks(bad)


SPEC: dict[str, Any] = dict(
    output_dir="out", model_dir="m", train_tasks="t.jsonl", pairs=None, steps=20, sync_every=10,
    prompts_per_step=2, generations=8, max_completion_length=12, lr=1e-3, temperature=1.0,
    weights={"grpo": 1.0, "sdpo_jsd": 0.0, "trace_replay_dpo": 0.0}, sdpo_feedback=False, sdpo_alpha=0.5,
    sdpo_top_k=20, sdpo_truncate_below=None, sdpo_teacher_update_rate=0.05, sdpo_routing="all", sdpo_group_weight="uniform", trainer="crf", outer_lr=1.0,
    outer_momentum=0.0, sync_timeout=60.0, codec="fp32", isolation="bwrap", sandbox_timeout=3.0, seed=0,
    threads=1, device="cpu",
)  # fmt: skip
"""A valid `JobSpec`'s fields."""


def test_job_records_round_trip_and_refuse_wrong_fields(composer_main: ModuleType, tmp_path: Path) -> None:
    """``job.json`` is what a replica trusts: a missing or unknown field, or a schedule that does not end on a DiLoCo
    round, is refused naming the problem."""
    from main_job.records import JobSpec, read_record, write_record

    spec = JobSpec(**SPEC)
    path = tmp_path / "job.json"
    write_record(spec, path)
    assert read_record(JobSpec, path) == spec
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "heldout_tasks": "tasks_heldout.jsonl"}))
    with pytest.raises(ValueError, match="expected the fields"):
        read_record(JobSpec, path)
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "seed"}))
    with pytest.raises(ValueError, match="expected the fields"):
        read_record(JobSpec, path)
    with pytest.raises(ValueError, match="multiple of sync_every"):
        JobSpec(**{**data, "steps": 15})
    for delay in (-1, data["sync_every"]):
        with pytest.raises(ValueError, match=r"sync_delay must be in \[0, sync_every\)"):
            JobSpec(**{**data, "sync_delay": delay})
    with pytest.raises(ValueError, match="exactly the channels"):
        JobSpec(**{**data, "weights": {"grpo": 1.0}})
    with pytest.raises(ValueError, match="vote_scope must be 'run' or 'replica', got 'group'"):
        JobSpec(**{**data, "vote_scope": "group"})
    for every in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="checkpoint_every must be an int >= 1"):
            JobSpec(**{**data, "checkpoint_every": every})


# --------------------------------------------------------------------------- evaluation arithmetic
def test_pass_rate_and_change_intervals(composer_main: ModuleType) -> None:
    from main_job.evaluate import Z95, Change, PassRate

    before = PassRate(("a", "b", "c", "d"), (0.0, 0.5, 0.5, 1.0), samples=2)
    after = PassRate(("a", "b", "c", "d"), (0.5, 1.0, 0.5, 1.0), samples=2)
    assert before.mean == 0.5
    assert before.se == pytest.approx(math.sqrt(1 / 6 / 4))
    change = Change.between(before, after)
    assert change.mean == pytest.approx(0.25)
    assert change.se == pytest.approx(math.sqrt(1 / 12 / 4))  # differences 0.5, 0.5, 0, 0
    assert change.interval == pytest.approx((0.25 - Z95 * change.se, 0.25 + Z95 * change.se))
    with pytest.raises(ValueError, match="same tasks"):
        Change.between(before, PassRate(("a", "b", "c", "e"), after.per_task, samples=2))
    with pytest.raises(ValueError, match="one rate per task"):
        PassRate(("a",), (0.1, 0.2), samples=1)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        PassRate(("a",), (1.5,), samples=1)


# --------------------------------------------------------------------------- arguments
def test_channels_flag_and_bad_arguments(composer_main: ModuleType) -> None:
    main = composer_main
    assert main.parse_args([]).weights == {"grpo": 1.0, "sdpo_jsd": 1.0, "trace_replay_dpo": 0.2}
    opts = main.parse_args(["--channels", "grpo"])
    assert opts.weights == {"grpo": 1.0, "sdpo_jsd": 0.0, "trace_replay_dpo": 0.0}
    assert main.parse_args(["--channels", "trace_replay_dpo, grpo"]).channels == ("grpo", "trace_replay_dpo")
    for argv in (
        ["--channels", "ppo"],
        ["--channels", ","],
        ["--steps", "15", "--sync-every", "10"],
        ["--sync-delay", "10"],
        ["--sync-delay", "-1"],
        ["--vote-scope", "group"],
        ["--checkpoint-every", "0"],
        ["--channels", "grpo", "--grpo-weight", "0"],
        ["--generations", "1"],
        ["--replicas", "0"],
        ["--storage-option", "no-equals-sign"],
        ["--steps", "0"],
        ["--lr", "0"],
        ["--temperature", "nan"],
        ["--outer-momentum", "1"],
        ["--max-completion-length", "0"],
    ):
        with pytest.raises(SystemExit):
            main.parse_args(argv)


def test_codec_flag_takes_crf_diloco_codecs_and_refuses_others(composer_main: ModuleType) -> None:
    pytest.importorskip("crf_diloco", reason="the wire codecs are crf-diloco's (pip install crf-diloco)")
    from main_job.records import JobSpec

    main = composer_main
    assert main.parse_args(["--codec", "topk:41/4096"]).codec == "topk:41/4096"
    for argv in (["--codec", "zip"], ["--codec", "topk:0/4096"], ["--codec", "int4:7"]):
        with pytest.raises(SystemExit):
            main.parse_args(argv)
    spec = main.parse_args([])
    assert spec.codec == "fp32"
    assert JobSpec(**{**SPEC, "codec": "int4:64"}).codec == "int4:64"
    with pytest.raises(ValueError, match="codec must be one of"):
        JobSpec(**{**SPEC, "codec": "zip"})


def test_report_command_hides_credentials(composer_main: ModuleType) -> None:
    main = composer_main
    argv = ["--store", "s3://b/p", "--storage-option", "endpoint_url=http://127.0.0.1:9", "--storage-option",
            "secret=hunter2", "--storage-option=key=AKIA123", "--storage-option", 'client_kwargs={"aws_session_token": "t"}']  # fmt: skip
    text = main.redacted_command(argv)
    assert "endpoint_url=http://127.0.0.1:9" in text
    for hidden in ("hunter2", "AKIA123", '"t"'):
        assert hidden not in text
    for shown in ("secret=***", "--storage-option=key=***", "client_kwargs=***"):
        assert shown in text


def test_storage_option_parsing(composer_main: ModuleType) -> None:
    main = composer_main
    opts = main.parse_args(
        ["--storage-option", "endpoint_url=http://127.0.0.1:9", "--storage-option", 'client_kwargs={"a": 1}']
    )
    assert opts.storage_options == {"endpoint_url": "http://127.0.0.1:9", "client_kwargs": {"a": 1}}


def test_main_job_falls_back_to_rlimits_and_says_so(
    composer_main: ModuleType, tasks: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine without bubblewrap the job still runs, isolating with resource limits only, and prints that."""
    import crf_core.rewards.sandbox as sandbox

    main = composer_main
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    assert main.sandbox_isolation() == "rlimits"
    line = main.describe_sandbox()
    assert line.startswith("sandbox: rlimits only")
    assert "`bubblewrap`" in line
    task = tasks.load_tasks(tasks.DATA / "tasks_train.jsonl")[0]
    from crf_core.rewards import UnitTestReward

    reward = UnitTestReward(isolation=main.sandbox_isolation())
    assert reward([task.prompt], [task.solution], tests=[list(task.tests)]) == [1.0]


def test_warm_start_feedback_is_the_sandboxs_account_of_wrong_attempts(tasks: ModuleType) -> None:
    """The feedback the warm start shows is `UnitTestReward`'s own on the weak student's attempts: which test failed,
    its message (the wanted expression), expected vs got, within the RL bound and cut at a line."""
    from main_job.feedback import FEEDBACK_CHARS, feedback_examples

    train = tasks.load_tasks(tasks.DATA / "tasks_train.jsonl")
    pick = [next(t for t in train if not t.hard), tasks.build_drills()[-1]]
    examples = feedback_examples(pick, isolation="rlimits", timeout_s=10.0, seed=0)
    assert [e.task for e in examples] == [t.name for t in pick]
    for example, task in zip(examples, pick, strict=True):
        assert "failed" in example.feedback
        assert "expected" in example.feedback
        assert "returned" in example.feedback
        assert any(test in example.feedback for test in task.tests)
        assert example.completion == task.solution
        assert example.prompt == task.prompt
        assert len(example.feedback) <= FEEDBACK_CHARS
        assert example.attempt != task.solution


# --------------------------------------------------------------------------- --agent
def test_agent_flag_sets_its_defaults_and_refuses_what_it_cannot_run(composer_main: ModuleType, tmp_path: Path) -> None:
    """``--agent`` fills its own defaults only where a flag is unset (``--quick`` its quick ones), leaves the default
    job as it was, refuses a trainer or model it cannot run, and reaches the replicas through ``JobSpec.agent``."""
    from main_job.agent_job import DEFAULTS, QUICK
    from main_job.records import JobSpec, read_record, write_record

    main = composer_main
    plain = main.parse_args([])
    assert not plain.agent
    assert (plain.steps, plain.max_completion_length, plain.eval_samples, plain.warmup_steps) == (300, 12, 16, 400)
    opts = main.parse_args(["--agent"])
    assert opts.agent
    assert {name: getattr(opts, name) for name in DEFAULTS} == DEFAULTS
    assert opts.steps % opts.sync_every == 0
    quick = main.parse_args(["--agent", "--quick"])
    assert {name: getattr(quick, name) for name in QUICK} == QUICK
    mine = main.parse_args(["--agent", "--steps", "20", "--max-completion-length", "512", "--eval-samples", "2"])
    assert (mine.steps, mine.max_completion_length, mine.eval_samples) == (20, 512, 2)
    assert mine.sync_every == DEFAULTS["sync_every"]
    assert plain.weights == {"grpo": 1.0, "sdpo_jsd": 1.0, "trace_replay_dpo": 0.2}
    assert opts.weights == {"grpo": 1.0, "sdpo_jsd": 0.25, "trace_replay_dpo": 0.05}  # measured: docs/guide.md
    assert main.parse_args(["--agent", "--sdpo-weight", "1", "--dpo-weight", "0.2"]).weights == plain.weights
    assert main.parse_args(["--agent", "--channels", "grpo"]).weights == {
        "grpo": 1.0,
        "sdpo_jsd": 0.0,
        "trace_replay_dpo": 0.0,
    }
    for argv in (
        ["--agent", "--trainer", "trl-grpo"],
        ["--agent", "--model", "smollm2-135m"],
        ["--agent", "--steps", "15"],  # not a multiple of the agent's --sync-every 10
        ["--agent", "--max-completion-length", "0"],
    ):
        with pytest.raises(SystemExit):
            main.parse_args(argv)
    assert JobSpec(**SPEC).agent is False  # a job.json without the flag is the single-completion job
    path = tmp_path / "job.json"
    write_record(JobSpec(**{**SPEC, "agent": True}), path)
    assert read_record(JobSpec, path).agent is True


def test_agent_warm_start_and_pairs_are_played_in_the_sandbox_on_train_tasks_only(tasks: ModuleType) -> None:
    """The agent's warm-start episodes and DPO pairs (``main_job.agent``): played in a `CodingEnvironment`, so every
    tool result is the environment's own; rendered in the tiny tool format with only the assistant turns trained;
    built from train tasks and drills only, and `check_unseen` holds over every text they contain."""
    pytest.importorskip("transformers", reason="the tool-call format is a tokenizer's chat template ([train] extra)")
    pytest.importorskip("crf_replaysim", reason="the pairs are crf-replaysim records")
    import tempfile

    from main_job import agent

    from crf_core._testing.tiny_model import build_char_tokenizer
    from crf_core.trainer.conversation import render_conversation
    from crf_core.trainer.pair_files import read_pair_file

    tokenizer = build_char_tokenizer(tool_calling=True)
    config = agent.env_config(tokenizer, isolation="rlimits", timeout_s=10.0)
    train = tasks.load_tasks(tasks.DATA / "tasks_train.jsonl")
    heldout = tasks.load_tasks(tasks.DATA / "tasks_heldout.jsonl")
    easy = [t for t in train if not t.hard][:2]
    drills = tasks.build_drills()[::60]  # one drill of several templates
    episodes = agent.warm_start_episodes(easy, drills, config=config, seed=0)
    texts = {json.dumps(e) for e in episodes}
    assert all(t.name not in text for t in train if t.hard for text in texts)
    schemas = agent.tool_schemas()
    kinds = set()
    for context, response in episodes:
        rendered = render_conversation(tokenizer, context, response, tools=schemas)
        trained = tokenizer.decode([i for i, m in zip(rendered.input_ids, rendered.trained, strict=True) if m])
        whole = tokenizer.decode(rendered.input_ids)
        assert whole.startswith("@tools:run_python,run_tests,submit\n@U:")
        assert trained.endswith("</call><eos><eos>")  # the submit call, then the policy stops
        assert "@T:" not in trained  # tool results are context, never trained
        if "failed" in whole and "# An earlier draft failed" not in whole:
            kinds.add("repair")
            assert trained.startswith('<call>{"name": "submit"')  # the failing draft is context, the fix trained
        elif "# An earlier draft failed" in whole:
            kinds.add("reading feedback")
        elif "# A correct episode" in whole:
            kinds.add("reading a demonstration")
        else:
            kinds.add("pass first time")
            assert "@T:All 1 tests passed.\n" in whole  # run_tests judges the one visible test
    assert kinds == {"repair", "reading feedback", "reading a demonstration", "pass first time"}
    with tempfile.TemporaryDirectory() as folder:
        traces = Path(folder) / "traces.jsonl"
        shipped = (tasks.DATA / "traces.jsonl").read_text().splitlines()
        traces.write_text("\n".join(shipped[:3] + shipped[-3:]) + "\n")  # easy and hard recorded tasks
        path, played = agent.write_agent_pairs(Path(folder) / "pairs.jsonl", train, traces, config=config)
        records = read_pair_file(path, strict=True)
        pair_lines = path.read_text().splitlines()
    assert len(records) == 6
    record = records[0]
    assert [m["role"] for m in record["chosen_messages"]] == ["assistant", "tool", "assistant", "tool"]
    assert [m["role"] for m in record["rejected_messages"]] == ["assistant", "tool"]
    assert "tests failed" in record["chosen_messages"][1]["content"]
    assert [t["function"]["name"] for t in record["tools"]] == ["run_python", "run_tests", "submit"]
    tasks.check_unseen(
        heldout,
        {
            "agent warm-start episodes": list(agent.episode_texts(episodes)),
            "agent DPO pairs": [*agent.episode_texts(played), *pair_lines],
        },
    )
