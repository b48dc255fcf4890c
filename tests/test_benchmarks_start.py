"""Every script under ``benchmarks/`` (not the helper modules they share) starts: its ``--help`` imports everything it needs (a run is minutes of
measuring, so no run here). A benchmark that no longer imports (a helper renamed under it) fails here, not in front
of a user."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if "__main__" in p.read_text())  # not helpers
NEEDS = ("torch", "crf_core", "crf_diloco", "crf_distill")  # the workspace the benchmarks run in


def test_there_are_benchmarks() -> None:
    assert len(BENCHMARKS) >= 10


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in NEEDS),
    reason=f"needs the installed workspace ({', '.join(NEEDS)})",
)
@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_every_benchmark_starts(script: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert proc.returncode == 0, f"{script.name} --help failed:\n{proc.stderr[-3000:]}"
    assert "usage:" in proc.stdout, proc.stdout
