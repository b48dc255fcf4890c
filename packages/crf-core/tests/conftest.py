"""Shared fixtures for crf-core tests: tiny Hugging Face causal LMs built from a config (no downloads), bubblewrap."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch


def _tiny_llama(vocab_size: int = 96, num_hidden_layers: int = 1, seed: int = 0, **overrides: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        **overrides,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.eval()  # no dropout: repeated forwards are identical
    return model


@pytest.fixture
def make_tiny_causal_lm() -> Callable[..., Any]:
    """Factory ``make_tiny_causal_lm(vocab_size=96, num_hidden_layers=1, seed=0, **config_overrides)``.

    Returns a randomly initialised ``LlamaForCausalLM`` (hidden 32, 4 heads) in eval mode.
    """
    pytest.importorskip("transformers")
    return _tiny_llama


@pytest.fixture
def tiny_causal_lm(make_tiny_causal_lm: Callable[..., Any]) -> Any:
    """A tiny ``LlamaForCausalLM`` (vocab 96, one layer), seeded."""
    return make_tiny_causal_lm()


@pytest.fixture
def tiny_config() -> Callable[..., Any]:
    """``tiny_config(output_dir, **overrides)``: the ``ComposerConfig`` of the tiny trainer tests (one CPU step of
    4 rollouts, 2 per group, 8 tokens; nothing saved or reported; SDPO on the top 8); overrides win."""
    pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")
    from crf_core.trainer import ComposerConfig

    def make(output_dir: Path, **overrides: Any) -> Any:
        settings: dict[str, Any] = {
            "output_dir": str(output_dir),
            "per_device_train_batch_size": 4,
            "num_generations": 2,
            "max_completion_length": 8,
            "max_steps": 1,
            "report_to": [],
            "use_cpu": True,
            "save_strategy": "no",
            "disable_tqdm": True,
            "seed": 0,
            "sdpo_top_k": 8,
        }
        return ComposerConfig(**{**settings, **overrides})

    return make


@pytest.fixture
def bwrap() -> None:
    """Require a usable bubblewrap: skip (naming the Debian package) outside CI, fail when ``CI=true``."""
    from crf_core.rewards import bubblewrap_problem

    problem = bubblewrap_problem()
    if problem is None:
        return
    message = f"bubblewrap is not usable here ({problem}); install the Debian package `bubblewrap`"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " (CI=true: tests that need it must run)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def sandbox_pool() -> Iterator[Any]:
    """A ``SandboxPool`` of 2 workers: needs bubblewrap (as ``bwrap``) and a root trainer (skipped otherwise: the
    pool refuses non-root trainers by design, so no CI setting makes these tests runnable without root)."""
    from crf_core.rewards import SandboxPool, bubblewrap_problem

    problem = bubblewrap_problem()
    if problem is not None:
        message = f"bubblewrap is not usable here ({problem}); install the Debian package `bubblewrap`"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " (CI=true: tests that need it must run)")
        pytest.skip(message)
    if os.geteuid() != 0:
        pytest.skip("the warm sandbox pool needs a root trainer (it refuses otherwise)")
    with SandboxPool(2) as pool:
        yield pool


@pytest.fixture
def repo_root(pytestconfig: pytest.Config) -> Path:
    """The workspace root: pytest's rootdir (the root pyproject.toml holds the pytest settings)."""
    return pytestconfig.rootpath


@pytest.fixture
def composer_main(repo_root: Path) -> ModuleType:
    """``examples/composer_main.py`` as a module; ``examples/`` is on the path through the root pyproject.toml's
    pytest ``pythonpath``, so ``composer_main`` and ``main_job`` import as they do when the job runs as a script."""
    script = repo_root / "examples" / "composer_main.py"
    if not script.is_file():
        pytest.skip(f"the main job is not here ({script}): run the tests from the workspace root")
    return importlib.import_module("composer_main")
