"""The README's main job (``examples/composer_main.py``): a CI-sized run, and the full run as a slow test."""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("trl", reason="the main job needs the [train] extra (trl)")
pytest.importorskip("crf_diloco", reason="the main job needs crf-diloco")
pytest.importorskip("crf_replaysim", reason="the main job needs crf-replaysim")
pytest.importorskip("matplotlib", reason="the main job plots with matplotlib (dev group)")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "composer_main.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("composer_main", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["composer_main"] = module
    spec.loader.exec_module(module)
    return module


def _check_run(main: ModuleType, out: Path, steps: int, sync_every: int, capsys: pytest.CaptureFixture[str]) -> list:
    results = main.main(["--quick", "--steps", str(steps), "--sync-every", str(sync_every), "--output-dir", str(out)])
    printed = capsys.readouterr().out
    assert len(results) == 2
    for r in results:
        assert r.error is None
        assert len(r.history) == steps
        for channel in ("grpo", "sdpo_jsd", "trace_replay_dpo"):
            assert all(channel in row for row in r.history), channel
        assert r.rounds_committed == steps // sync_every
        assert r.bytes_written > 0
        assert r.bytes_read > 0
    assert "trace replay: 12 pairs" in printed
    assert "kept 12 of 12" in printed
    assert " replica | reward (first 5 -> last 5) " in printed
    assert "[replica 1] step" in printed
    assert (out / "composer_main.png").stat().st_size > 10_000
    assert (out / "trace_pairs.jsonl").read_text().count("\n") == 12
    return results


def test_main_job_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    _check_run(_load(), tmp_path, steps=4, sync_every=2, capsys=capsys)
    assert time.monotonic() - start < 120  # < 60 s on an idle 2-core machine


@pytest.mark.slow
def test_main_job_full(tmp_path: Path) -> None:
    main = _load()
    start = time.monotonic()
    results = main.main(["--output-dir", str(tmp_path)])
    assert time.monotonic() - start < 300  # the budget on 2 cores
    for r in results:
        assert r.error is None
        assert len(r.history) == 60
        assert r.rounds_committed == 6
        rewards = [row["reward"] for row in r.history]
        assert all(0.0 <= x <= 1.0 for x in rewards)
        assert max(rewards) > 0  # the warm-started policy solves some tasks, so GRPO gets signal
        for channel in ("grpo", "sdpo_jsd", "trace_replay_dpo"):
            assert all(math.isfinite(row[channel]) for row in r.history), channel
