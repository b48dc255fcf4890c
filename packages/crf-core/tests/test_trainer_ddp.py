"""The trainer under ``accelerate launch --num_processes 2`` (DDP on CPU, gloo), with every channel on, a PEFT
adapter and gradient checkpointing: ranks end bit-identical, pairs are sharded (not duplicated) and the logged
channel metrics are the same on every rank."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")
pytest.importorskip("peft", reason="the DDP test trains a PEFT adapter")

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.integration
def test_two_rank_ddp_run_ends_bit_identical(tmp_path: Path) -> None:
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    assert launcher, "accelerate's CLI is installed with the [train] extra"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    cmd = [
        launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(SCRIPT), str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    differ = sorted(k for k in ranks[0] if k not in ("rank", "pairs") and ranks[0][k] != ranks[1][k])
    assert not differ, f"the ranks differ in {differ}: {[{k: r[k] for k in differ} for r in ranks]}"
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["policy"] == ranks[1]["policy"]
    assert ranks[0]["teacher"] == ranks[1]["teacher"]
    assert all(r["checkpointing"] for r in ranks)
    assert all(r["reference"] == "adapter" for r in ranks)
    assert all("lora" in name for r in ranks for name in r["trainable"])
    steps = len(ranks[0]["pairs"])
    assert steps == len(ranks[1]["pairs"]) == 3
    for a, b in zip(ranks[0]["pairs"], ranks[1]["pairs"], strict=True):
        assert len(a) == len(b) == 2
        assert not set(a) & set(b), (a, b)  # sharded: no pair is used by both ranks in one step
    assert ranks[0]["logs"] == ranks[1]["logs"]
    assert all({"grpo", "sdpo_jsd", "trace_replay_dpo"} <= set(entry) for entry in ranks[0]["logs"])
