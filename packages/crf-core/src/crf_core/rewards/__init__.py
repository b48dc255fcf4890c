"""Rewards that run generated code: the sandbox, the unit-test reward, and what they share.

The policy under RL is an adversary of its reward, so both halves assume hostile input:

* ``run_python`` (``crf_core.rewards.sandbox``) runs untrusted Python under bubblewrap (namespaces,
  read-only root, one private tmpfs, cleared environment, seccomp, rlimits), or with rlimits only
  when the caller opts into ``isolation="rlimits"``; ``bubblewrap_usable()`` says which is possible.
  ``SandboxPool`` (``run_python(pool=...)``, ``UnitTestReward(warm_pool=True)``) keeps warm bubblewrap
  workers that fork a freshly namespaced process per run (opt-in; root trainers).
* ``UnitTestReward`` (``crf_core.rewards.unit_tests``) is a TRL reward function. The sandboxed
  program only returns data; the test list is split on the trainer side into calls and expected
  values (``crf_core.rewards.asserts``), and the trainer compares them after a strict read of the
  returned record (``crf_core.rewards.record``). It reports SDPO feedback through ``log_extra``.
* ``extract_code`` takes the code out of a completion in linear time.
* ``CodingEnvironment`` (``crf_core.rewards.coding_env``) is a sandboxed coding environment for TRL's
  ``environment_factory``: tools ``run_python``, ``run_tests`` and ``submit`` with bounded, redacted results; the
  submission graded by ``UnitTestReward``; ``get_reward()`` and SDPO ``feedback`` from its own ``Episode`` record.

Layering: ``sandbox`` knows nothing of rewards; ``unit_tests`` uses everything else; nothing here
imports the trainer (the text of chat completions comes from ``crf_core.messages``).
"""

from __future__ import annotations

from crf_core.rewards._pool import SandboxPool
from crf_core.rewards.asserts import Check, UnitTest, UnsplittableTestError, parse_test, parse_tests
from crf_core.rewards.coding_env import (
    CodingEnvConfig,
    CodingEnvironment,
    Episode,
    EpisodeSummary,
    ToolCall,
    demonstration_episode,
    redact_secrets,
    summarize_episodes,
)
from crf_core.rewards.extract import extract_code
from crf_core.rewards.sandbox import (
    SandboxResult,
    SandboxUnavailableError,
    bubblewrap_problem,
    bubblewrap_usable,
    run_python,
)
from crf_core.rewards.unit_tests import TestOutcome, UnitTestReward

__all__ = [
    "Check",
    "CodingEnvConfig",
    "CodingEnvironment",
    "Episode",
    "EpisodeSummary",
    "SandboxPool",
    "SandboxResult",
    "SandboxUnavailableError",
    "TestOutcome",
    "ToolCall",
    "UnitTest",
    "UnitTestReward",
    "UnsplittableTestError",
    "bubblewrap_problem",
    "bubblewrap_usable",
    "demonstration_episode",
    "extract_code",
    "parse_test",
    "parse_tests",
    "redact_secrets",
    "run_python",
    "summarize_episodes",
]
