"""Every script under ``benchmarks/`` (not the helper modules they share) starts: its ``--help`` imports everything
it needs (a run is minutes of measuring, so no run here). A benchmark that no longer imports (a helper renamed under
it) fails here, not in front of a user. All scripts run in one interpreter, so torch is imported once."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if "__main__" in p.read_text())  # not helpers
NEEDS = ("torch", "crf_core", "crf_diloco", "crf_distill")  # the workspace the benchmarks run in
DRIVER = """
import contextlib, io, json, runpy, sys, traceback
failed = {}
sys.path.insert(0, sys.argv[1])  # as for `python benchmarks/X.py`: the scripts import their sibling helpers
for script in sys.argv[2:]:
    sys.argv = [script, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
        failed[script] = "--help returned instead of exiting"
    except SystemExit as e:
        if e.code not in (0, None) or "usage:" not in out.getvalue():
            failed[script] = f"exit {e.code!r}; stdout: {out.getvalue()[-500:]}"
    except BaseException:
        failed[script] = traceback.format_exc()[-3000:]
print(json.dumps(failed))
"""


def test_there_are_benchmarks() -> None:
    assert len(BENCHMARKS) >= 10


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in NEEDS),
    reason=f"needs the installed workspace ({', '.join(NEEDS)})",
)
def test_every_benchmark_starts(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(ROOT / "benchmarks"), *map(str, BENCHMARKS)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert failed == {}, "\n\n".join(f"{Path(k).name}: {v}" for k, v in failed.items())
