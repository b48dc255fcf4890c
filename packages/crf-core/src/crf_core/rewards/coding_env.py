"""``CodingEnvironment``: a sandboxed coding environment for TRL's ``GRPOTrainer(environment_factory=...)``.

TRL (1.16) builds one instance per concurrent rollout through the factory, calls ``reset(**row)`` with the dataset
row before the rollout, exposes every public method but ``reset``/``get_reward`` as a tool the policy may call
(their type hints and docstrings become the tool schemas), and after the rollout calls ``get_reward()``. Instances are
pooled and reused across batches, so ``reset`` clears everything an episode left.

The tools, each run in crf's sandbox (``crf_core.rewards.sandbox.run_python``: bubblewrap by default):

* ``run_python(code)``: run a program, return its exit status and (bounded) output;
* ``run_tests(code)``: judge ``code`` against the row's visible tests with ``UnitTestReward`` (the verdict is
  computed on the trainer side; the program only returns data) and return which tests failed and why;
* ``submit(code)``: the episode's final answer. It is graded once, on the visible and (optional) hidden tests, and
  ``get_reward()`` returns the fraction passed (0.0 without a submission), read from the environment's own record.

Everything the policy controls is hostile: a tool never raises (a bad argument, a spent budget or a sandbox failure
becomes the text it returns), code longer than ``max_code_chars`` is refused unrun, each episode may run at most
``max_tool_calls`` programs, every result is cut to ``max_result_chars``, control characters and ``strip_strings``
(e.g. the tokenizer's special tokens, so a program cannot forge chat-template markers) are removed, and secrets are
redacted: the values of the trainer's environment variables whose names look secret (``*KEY*``, ``*TOKEN*``,
``*SECRET*``, ``*PASSWORD*``, ...), the ``redact`` strings and common credential shapes (``sk-...``, ``hf_...``,
``ghp_...``, ``AKIA...``, private-key blocks) become ``<secret>``. The sandbox is what keeps secrets out of reach
(bubblewrap: a cleared environment, no host files but ``/usr``); the redaction catches accidental exposure (a secret
in the task data, ``isolation="rlimits"``), not a program that encodes a secret it could read.

SDPO: ``feedback`` (a property, so TRL does not expose it as a tool) is what the episode's last ``run_tests`` call
returned when it found failures; ``ComposerReplicationTrainer`` puts it in the self-teacher's reprompt.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from crf_core._checks import is_int, is_number
from crf_core.rewards.asserts import parse_tests
from crf_core.rewards.extract import extract_code
from crf_core.rewards.sandbox import Isolation, require_isolation, run_python
from crf_core.rewards.unit_tests import TestOutcome, UnitTestReward

__all__ = [
    "REDACTED",
    "CodingEnvConfig",
    "CodingEnvironment",
    "Episode",
    "EpisodeSummary",
    "ToolCall",
    "demonstration_episode",
    "redact_secrets",
    "summarize_episodes",
]

_log = logging.getLogger(__name__)

REDACTED = "<secret>"
ToolName = Literal["run_python", "run_tests", "submit"]

#: Environment variable names whose values are treated as secrets (matched case-insensitively, anywhere in the name).
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE", re.IGNORECASE)
_MIN_SECRET_CHARS = 8  # shorter values ("1", "true") would redact ordinary text
#: Credential shapes (bounded quantifiers, no nested repetition: linear on hostile text).
_CREDENTIAL_SHAPES = re.compile(
    r"sk-[A-Za-z0-9_-]{20,400}"  # OpenAI / OpenRouter / Anthropic-style keys
    r"|hf_[A-Za-z0-9]{30,100}"  # Hugging Face
    r"|gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{40,255}"  # GitHub
    r"|A(?:KIA|SIA)[0-9A-Z]{16}"  # AWS access key ids
    r"|xox[abprs]-[A-Za-z0-9-]{10,255}"  # Slack
)
_PEM_BEGIN, _PEM_END = "-----BEGIN", "-----END"
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_CUT = "\n[... cut ...]"


@dataclass(frozen=True)
class CodingEnvConfig:
    """Settings of a :class:`CodingEnvironment` (validated on construction; shared read-only by every instance).

    Attributes:
        tests_key: dataset column with each row's visible tests (a list of assert statements), run by ``run_tests``.
        hidden_tests_key: optional column of tests graded at ``submit`` only (never shown to the policy).
        entry_point_key: optional column naming the function under test (tests may call ``candidate(...)``).
        timeout_s, memory_mb: sandbox limits per tool call.
        isolation: ``"bwrap"`` (default; refused at construction when bubblewrap is not usable) or ``"rlimits"``.
        max_tool_calls: programs (``run_python`` + ``run_tests``) an episode may run; later calls are refused.
        max_code_chars: longest ``code`` argument run; longer ones are refused unrun.
        max_result_chars: longest text a tool returns (cut after the last whole line that fits).
        redact: extra strings to replace by ``<secret>`` in every result (besides the trainer's secret variables).
        strip_strings: strings removed from every result (e.g. ``tokenizer.all_special_tokens``).
        instructions: text appended to the row's last user message at ``reset`` (e.g. how to use the tools);
            ``None`` appends nothing.
    """

    tests_key: str = "tests"
    hidden_tests_key: str | None = None
    entry_point_key: str = "entry_point"
    timeout_s: float = 5.0
    memory_mb: int = 512
    isolation: Isolation = "bwrap"
    max_tool_calls: int = 8
    max_code_chars: int = 20_000
    max_result_chars: int = 2_000
    redact: tuple[str, ...] = ()
    strip_strings: tuple[str, ...] = ()
    instructions: str | None = None

    def __post_init__(self) -> None:
        for name in ("tests_key", "entry_point_key"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty column name (str), got {value!r}")
        if self.hidden_tests_key is not None and (
            not isinstance(self.hidden_tests_key, str) or not self.hidden_tests_key
        ):
            raise ValueError(f"hidden_tests_key must be a column name or None, got {self.hidden_tests_key!r}")
        if self.hidden_tests_key == self.tests_key:
            raise ValueError("hidden_tests_key names the visible tests column; use another column or None")
        timeout = self.timeout_s
        if not is_number(timeout) or not 0 < timeout < math.inf:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout!r}")
        for name, low in (("memory_mb", 64), ("max_tool_calls", 1), ("max_code_chars", 1), ("max_result_chars", 200)):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.isolation not in get_args(Isolation):
            raise ValueError(f"isolation must be 'bwrap' or 'rlimits', got {self.isolation!r}")
        for name in ("redact", "strip_strings"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Sequence):
                raise TypeError(f"{name} must be a tuple of strings, got {type(value).__name__}")
            if not all(isinstance(s, str) and s for s in value):
                raise ValueError(f"{name} must hold non-empty strings only, got {list(value)!r}")
            object.__setattr__(self, name, tuple(value))
        if self.instructions is not None and not isinstance(self.instructions, str):
            raise TypeError(f"instructions must be a str or None, got {type(self.instructions).__name__}")


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an episode, as the environment recorded it.

    Attributes:
        tool: ``"run_python"``, ``"run_tests"`` or ``"submit"``.
        code: the code argument as run (empty when it was not text).
        result: the text the policy was shown (bounded, redacted).
        passed, total: tests passed / counted (``run_tests`` and ``submit``; None otherwise or when refused).
        refused: why the call was not run (``None`` when it ran).
    """

    tool: ToolName
    code: str
    result: str
    passed: int | None = None
    total: int | None = None
    refused: str | None = None

    @property
    def failed_tests(self) -> bool:
        """A test run that counted failures."""
        return self.passed is not None and self.total is not None and self.passed < self.total


@dataclass(frozen=True)
class Episode:
    """What one rollout did in the environment: its tool calls and the graded submission.

    Attributes:
        calls: every tool call, in order.
        submission: the submitted code (``None`` when the episode did not submit).
        outcome: the submission's grade on visible + hidden tests (``None`` without a submission).
    """

    calls: tuple[ToolCall, ...] = ()
    submission: str | None = None
    outcome: TestOutcome | None = None

    @property
    def reward(self) -> float:
        """Fraction of tests the submission passed; 0.0 without a submission."""
        return 0.0 if self.outcome is None else self.outcome.reward

    @property
    def tool_calls(self) -> int:
        """Number of tool calls, refused ones and ``submit`` included."""
        return len(self.calls)

    @property
    def saw_failure(self) -> bool:
        """A ``run_tests`` call reported failing tests."""
        return any(c.tool == "run_tests" and c.failed_tests for c in self.calls)

    @property
    def repaired(self) -> bool:
        """A ``run_tests`` call failed, and the submission then passed every test (the draft was fixed)."""
        return self.saw_failure and self.outcome is not None and self.outcome.passed == self.outcome.total


@dataclass(frozen=True)
class EpisodeSummary:
    """Statistics of a set of episodes (for reports): ``pass_rate`` = share whose submission passed every test,
    ``mean_reward``, ``mean_tool_calls``, ``submitted`` share, and ``repair_rate`` = share of the episodes that saw a
    failing ``run_tests`` whose submission then passed (``None`` when no episode saw one)."""

    episodes: int
    pass_rate: float
    mean_reward: float
    mean_tool_calls: float
    submitted: float
    repair_rate: float | None


def summarize_episodes(episodes: Sequence[Episode]) -> EpisodeSummary:
    """Summarise ``episodes`` (a non-empty sequence of :class:`Episode`)."""
    if isinstance(episodes, (str, bytes)) or not isinstance(episodes, Sequence) or not episodes:
        raise ValueError("summarize_episodes needs a non-empty sequence of Episode records")
    if not all(isinstance(e, Episode) for e in episodes):
        raise TypeError("summarize_episodes takes Episode records (CodingEnvironment.episode)")
    n = len(episodes)
    passed = sum(1 for e in episodes if e.outcome is not None and e.outcome.passed == e.outcome.total)
    failing = [e for e in episodes if e.saw_failure]
    return EpisodeSummary(
        episodes=n,
        pass_rate=passed / n,
        mean_reward=sum(e.reward for e in episodes) / n,
        mean_tool_calls=sum(e.tool_calls for e in episodes) / n,
        submitted=sum(1 for e in episodes if e.submission is not None) / n,
        repair_rate=(sum(1 for e in failing if e.repaired) / len(failing)) if failing else None,
    )


def _environment_secrets(environ: Mapping[str, str]) -> tuple[str, ...]:
    values = {v for k, v in environ.items() if _SECRET_NAME.search(k) and len(v.strip()) >= _MIN_SECRET_CHARS}
    return tuple(sorted(values, key=len, reverse=True))


def redact_secrets(text: str, secrets: Sequence[str] = ()) -> str:
    """``text`` with every ``secrets`` string, credential shape (``sk-…``, ``hf_…``, ``ghp_…``, ``AKIA…``, ``xox?-…``)
    and private-key block replaced by ``<secret>``. Linear in ``len(text)`` per secret."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if isinstance(secrets, str) or not all(isinstance(s, str) for s in secrets):
        raise TypeError("secrets must be a sequence of strings")
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    text = _CREDENTIAL_SHAPES.sub(REDACTED, text)
    out, pos = [], 0
    while True:  # -----BEGIN ... PRIVATE KEY----- blocks, to their END line or the end of the text
        start = text.find(_PEM_BEGIN, pos)
        if start < 0:
            break
        end = text.find(_PEM_END, start + len(_PEM_BEGIN))
        stop = len(text) if end < 0 else text.find("-----", end + len(_PEM_END))
        stop = len(text) if stop < 0 else stop + 5
        out.append(text[pos:start] + REDACTED)
        pos = stop
    out.append(text[pos:])
    return "".join(out)


def _bounded(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, cut after the last whole line that fits."""
    if len(text) <= limit:
        return text
    head = text[: limit - len(_CUT)]
    line_end = head.rfind("\n")
    return (head[:line_end] if line_end > limit // 2 else head) + _CUT


class _ClassOnly:
    """A classmethod an instance does not show: TRL <= 1.14 offers every bound method of the environment instance
    to the policy as a tool (1.16 lists the class's functions), and ``factory`` is no tool."""

    def __init__(self, function: Callable[..., Callable[[], CodingEnvironment]]) -> None:
        self._function = function

    def __get__(self, instance: object, owner: type) -> Callable[..., Callable[[], CodingEnvironment]]:
        if instance is not None:
            raise AttributeError("factory is called on the class: CodingEnvironment.factory(...)")
        return functools.partial(self._function, owner)


class CodingEnvironment:
    """A coding task for one rollout: tools ``run_python``, ``run_tests`` and ``submit`` (see the module docstring).

    ``GRPOTrainer(environment_factory=CodingEnvironment)`` uses the defaults; ``CodingEnvironment.factory(...)``
    returns a factory with other settings. Nothing is shared between instances but the read-only config.
    """

    def __init__(self, config: CodingEnvConfig | None = None) -> None:
        if config is None:
            config = CodingEnvConfig()
        if not isinstance(config, CodingEnvConfig):
            raise TypeError(f"config must be a CodingEnvConfig, got {type(config).__name__}")
        require_isolation(config.isolation)  # refuse now, not at the first tool call
        self._config = config
        self._grader = UnitTestReward(
            prepend_prompt=False,
            timeout_s=config.timeout_s,
            memory_mb=config.memory_mb,
            max_workers=1,
            isolation=config.isolation,
            max_feedback_chars=max(200, config.max_result_chars),
        )
        self._secrets = tuple(dict.fromkeys((*config.redact, *_environment_secrets(os.environ))))
        self._tests: tuple[str, ...] | None = None
        self._hidden: tuple[str, ...] = ()
        self._entry_point: str | None = None
        self._calls: list[ToolCall] = []
        self._submission: str | None = None
        self._outcome: TestOutcome | None = None

    @_ClassOnly
    def factory(
        cls: type[CodingEnvironment], config: CodingEnvConfig | None = None, **settings: Any
    ) -> Callable[[], CodingEnvironment]:
        """A zero-argument factory for ``environment_factory``: ``config`` or ``CodingEnvConfig(**settings)``,
        validated (and the isolation checked) once, now."""
        if config is not None and settings:
            raise ValueError("pass either a CodingEnvConfig or settings, not both")
        shared = config if config is not None else CodingEnvConfig(**settings)
        if not isinstance(shared, CodingEnvConfig):
            raise TypeError(f"config must be a CodingEnvConfig, got {type(shared).__name__}")
        require_isolation(shared.isolation)

        def make() -> CodingEnvironment:
            return cls(shared)

        return make

    # ------------------------------------------------------------------ TRL's contract
    def reset(self, **row: Any) -> str | None:
        """Start an episode on a dataset row (TRL passes the whole row): read its tests, forget the last episode.

        Raises ``KeyError``/``ValueError`` for a malformed row (missing or unparsable tests): a dataset error.
        """
        cfg = self._config
        if cfg.tests_key not in row:
            raise KeyError(
                f"the dataset row has no '{cfg.tests_key}' column (keys: {sorted(row)}); add each row's unit tests "
                "or set CodingEnvConfig.tests_key to the column that holds them"
            )
        tests = row[cfg.tests_key]
        parse_tests(tests)  # a test the trainer cannot judge is a dataset error: refuse before the rollout
        hidden: tuple[str, ...] = ()
        if cfg.hidden_tests_key is not None and row.get(cfg.hidden_tests_key) is not None:
            parse_tests(row[cfg.hidden_tests_key])
            hidden = tuple(row[cfg.hidden_tests_key])
        entry_point = row.get(cfg.entry_point_key)
        if entry_point is not None and not (isinstance(entry_point, str) and entry_point.isidentifier()):
            raise ValueError(
                f"column '{cfg.entry_point_key}' must hold a Python identifier or None, got {entry_point!r}"
            )
        self._tests, self._hidden, self._entry_point = tuple(tests), hidden, entry_point
        self._calls, self._submission, self._outcome = [], None, None
        return cfg.instructions

    def get_reward(self) -> float:
        """Fraction of tests (visible and hidden) the submitted code passed; 0.0 without a submission."""
        return 0.0 if self._outcome is None else float(self._outcome.reward)

    # ------------------------------------------------------------------ tools
    def run_python(self, code: str) -> str:
        """Run a Python program in a sandbox and return its exit status and output.

        Args:
            code: The Python source to run as a script.

        Returns:
            The exit status, then the program's standard output and standard error (shortened if long).
        """
        return self._tool("run_python", code)

    def run_tests(self, code: str) -> str:
        """Run the task's unit tests against your code and return which tests fail and why.

        Args:
            code: The Python source defining the function under test.

        Returns:
            How many tests passed, and for failures the expected and returned values or the error raised.
        """
        return self._tool("run_tests", code)

    def submit(self, code: str) -> str:
        """Submit your final code for the task. Only the first submission counts; it ends the episode.

        Args:
            code: The Python source defining the function under test.

        Returns:
            A confirmation that the code was submitted.
        """
        return self._tool("submit", code)

    # ------------------------------------------------------------------ records
    @property
    def config(self) -> CodingEnvConfig:
        """The settings this environment runs with."""
        return self._config

    @property
    def episode(self) -> Episode:
        """The episode so far (an immutable snapshot of the environment's own record)."""
        return Episode(tuple(self._calls), self._submission, self._outcome)

    @property
    def feedback(self) -> str | None:
        """What the last ``run_tests`` call returned, when it counted failing tests; ``None`` otherwise (SDPO's
        environment feedback, read by ``ComposerReplicationTrainer``)."""
        for call in reversed(self._calls):
            if call.tool == "run_tests" and call.refused is None:
                return call.result if call.failed_tests else None
        return None

    # ------------------------------------------------------------------ internals
    def _tool(self, tool: ToolName, code: Any) -> str:
        """Run one tool call and record it; never raises."""
        try:
            call = self._call(tool, code)
        except Exception:  # a bug or an OS failure must not stop the rollout
            _log.exception("crf CodingEnvironment: the %s tool failed", tool)
            text = "The tool failed (an internal error; see the trainer log)."
            call = ToolCall(tool, code if isinstance(code, str) else "", text, refused=text)
        self._calls.append(call)
        return call.result

    def _call(self, tool: ToolName, code: Any) -> ToolCall:
        cfg = self._config
        refusal = self._refusal(tool, code)
        if refusal is not None:
            return ToolCall(tool, code if isinstance(code, str) else "", self._clean(refusal), refused=refusal)
        source = extract_code(code)
        if tool == "submit":
            self._submission = source
            assert self._tests is not None
            self._outcome = self._grader.score(source, (*self._tests, *self._hidden), entry_point=self._entry_point)
            return ToolCall(tool, source, "Submitted.", self._outcome.passed, self._outcome.total)
        if tool == "run_tests":
            assert self._tests is not None
            outcome = self._grader.score(source, self._tests, entry_point=self._entry_point)
            text = f"All {outcome.total} tests passed." if outcome.passed == outcome.total else outcome.feedback
            return ToolCall(tool, source, self._clean(text), outcome.passed, outcome.total)
        reserve = max((len(s) for s in self._secrets), default=0) + 64  # a secret cut at the capture edge stays hidden
        result = run_python(
            source,
            timeout_s=cfg.timeout_s,
            memory_mb=cfg.memory_mb,
            max_output_chars=cfg.max_result_chars + reserve,
            isolation=cfg.isolation,
        )
        if result.error is not None:
            _log.warning("crf CodingEnvironment: the sandbox failed: %s", result.error)
        if result.error is not None or result.timed_out or (result.returncode is not None and result.returncode < 0):
            text = result.describe()
        else:
            text = f"exit status {result.returncode}\n{result.stdout}"
            if result.stderr.strip():
                text += f"\n[stderr]\n{result.stderr}"
        return ToolCall(tool, source, self._clean(text))

    def _refusal(self, tool: ToolName, code: Any) -> str | None:
        cfg = self._config
        if self._tests is None:
            return "No task: the environment was not reset."
        if self._submission is not None:
            return "The episode is over: the answer was already submitted."
        if not isinstance(code, str):
            return f"The code must be a string, got {type(code).__name__}."
        if len(code) > cfg.max_code_chars:
            return f"The code is too long ({len(code)} characters; the limit is {cfg.max_code_chars}); not run."
        ran = sum(1 for c in self._calls if c.tool != "submit" and c.refused is None)
        if tool != "submit" and ran >= cfg.max_tool_calls:
            return f"Tool budget spent ({cfg.max_tool_calls} programs per episode); submit your answer."
        return None

    def _clean(self, text: str) -> str:
        """Without control characters or ``strip_strings``, then redacted (so nothing removed can splice a secret
        back together after redaction), within ``max_result_chars``."""
        text = _CONTROL.sub("", text)
        for needle in self._config.strip_strings:
            text = text.replace(needle, "")
        return _bounded(redact_secrets(text, self._secrets), self._config.max_result_chars)


def demonstration_episode(
    row: Mapping[str, Any],
    actions: Sequence[tuple[ToolName, str]],
    *,
    config: CodingEnvConfig | None = None,
    final_text: str = "",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Episode]:
    """Play ``actions`` (``(tool, code)`` pairs) in a fresh :class:`CodingEnvironment` on a dataset ``row`` and return
    the rollout as TRL would hold it: ``(context, response, episode)``.

    ``context`` is the row's conversational ``prompt`` with ``reset``'s instructions appended to its last message (as
    TRL does); ``response`` alternates an assistant turn calling each tool (arguments as a dict) and the tool's
    result, as run in the sandbox, and ends with an assistant turn of ``final_text`` (the policy stopping). Use it to
    build warm-start demonstrations (``crf_core.trainer.warm_start``) or trace-replay pairs from real tool results.
    """
    prompt = row.get("prompt") if isinstance(row, Mapping) else None
    if not isinstance(prompt, list) or not prompt or not all(isinstance(m, Mapping) for m in prompt):
        raise ValueError("row must hold a conversational 'prompt' (a non-empty list of chat messages)")
    if isinstance(actions, (str, bytes)) or not isinstance(actions, Sequence) or not actions:
        raise ValueError("actions must be a non-empty sequence of (tool, code) pairs")
    if not isinstance(final_text, str):
        raise TypeError(f"final_text must be a str, got {type(final_text).__name__}")
    env = CodingEnvironment(config)
    observation = env.reset(**row)
    context = [dict(m) for m in prompt]
    if observation is not None:
        last = context[-1]
        context[-1] = {**last, "content": f"{last.get('content') or ''}{observation}"}
    response: list[dict[str, Any]] = []
    for index, action in enumerate(actions):
        if not (isinstance(action, tuple) and len(action) == 2 and action[0] in ("run_python", "run_tests", "submit")):
            raise ValueError(f"action {index} must be a (tool, code) pair with tool run_python, run_tests or submit")
        tool, code = action
        result = getattr(env, tool)(code)
        call_id = f"call_{index}"
        response.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": tool, "arguments": {"code": code}}}
                ],
            }
        )
        response.append({"role": "tool", "tool_call_id": call_id, "name": tool, "content": result})
    response.append({"role": "assistant", "content": final_text})
    return context, response, env.episode
