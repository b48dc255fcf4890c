"""The README's main job (``examples/composer_main.py``) end to end: a CI-sized run is wired (replica processes
through crf-diloco's executor, DiLoCo rounds, the report), the same on an S3 store, and the full run learns on
tasks it never trained on (slow). The data and plumbing tests are in ``test_main_job_data.py``."""

from __future__ import annotations

import json
import math
import platform
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("trl", reason="the main job needs the [train] extra (trl)")
pytest.importorskip("crf_diloco", reason="the main job needs crf-diloco")
pytest.importorskip("crf_replaysim", reason="the main job needs crf-replaysim")
pytest.importorskip("matplotlib", reason="the main job plots with matplotlib (examples group)")

CHANNELS = ("grpo", "sdpo_jsd", "trace_replay_dpo")


# --------------------------------------------------------------------------- runs
def _check_run(outcome: Any, out: Path, printed: str, steps: int, sync_every: int) -> None:
    assert len(outcome.replicas) == 2
    for r in outcome.replicas:
        assert len(r.history) == steps
        for channel in CHANNELS:  # every step logs every channel: SDPO logs 0.0 in a step without teacher signal
            values = [row.losses.get(channel) for row in r.history]
            assert all(v is not None and math.isfinite(v) for v in values), (r.rank, channel, values)
        assert r.rounds_committed == steps // sync_every
        assert [s.committed for s in r.syncs] == [True] * (steps // sync_every)
        assert r.bytes_written > 0
        assert r.bytes_read > 0
        assert r.checkpoint_bytes < r.bytes_written + r.bytes_read, "the checkpoints are part of the store's traffic"
    assert sum(r.checkpoint_bytes for r in outcome.replicas) > 0, "committed rounds' states were written"
    assert outcome.identical_weights  # the last DiLoCo round leaves every replica with the same weights
    assert 0.0 <= outcome.before.mean <= 1.0
    assert 0.0 <= outcome.after.mean <= 1.0
    assert len(outcome.before.per_task) == 88
    assert len(outcome.hard) == 28
    assert set(outcome.hard) <= set(outcome.before.tasks)
    assert set(outcome.subsets()) == {"all", "easy", "hard"}
    assert "trace replay: 112 pairs from 112 traces" in printed
    assert "kept 112 of 112" in printed
    assert "held-out pass rate before RL: " in printed
    sandbox_line = next(line for line in printed.splitlines() if line.startswith("sandbox: "))
    assert sandbox_line.startswith(("sandbox: bubblewrap", "sandbox: rlimits only"))
    header = next(line for line in printed.splitlines() if line.startswith(" replica |"))
    for column in ("reward (first", *(f"{c} loss" for c in CHANNELS), "rounds", "MB synced", "checkpoints"):
        assert column in header, column
    assert "[replica 1] step" in printed
    assert re.search(r"change [+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]", printed)
    assert (out / "composer_main.png").stat().st_size > 10_000
    summary = (out / "summary.md").read_text()
    assert "## Held-out pass rate" in summary
    assert "95% interval" in summary
    assert "## DiLoCo syncs" in summary
    assert "Run with `--link RTT,BANDWIDTH`" in summary  # no link given: no floor, and how to get one
    assert (out / "trace_pairs.jsonl").read_text().count("\n") == 112
    result = json.loads((out / "result.json").read_text())
    assert set(result["subsets"]) == {"all", "easy", "hard"}
    assert result["subsets"]["hard"]["tasks"] == 28
    # Structural: what the replica processes were told to train on names only train tasks.
    job = json.loads((out / "job.json").read_text())
    assert Path(job["train_tasks"]).name == "tasks_train.jsonl"
    assert "heldout" not in json.dumps(job)


@pytest.mark.timeout(300)
def test_main_job_quick(composer_main: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CI-sized run: 2 replica processes through crf-diloco's local executor, 4 steps, 2 DiLoCo rounds."""
    outcome = composer_main.main(["--quick", "--output-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    _check_run(outcome, tmp_path, printed, steps=4, sync_every=2)
    # A cheap learning signal on the fixed seed (runs are deterministic for a seed; measured, two runs alike):
    # the warm start takes the tiny model from a uniform guess (ln 101 = 4.615 per token) to 1.936, and the
    # trace-replay DPO loss starts at ln 2 (the policy is its own reference) and falls on every replica
    # (0.6931 -> 0.6876 and 0.6703 in 4 steps).
    warm = float(re.search(r"^warm start: .*, loss (\d+\.\d+)$", printed, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert warm < 0.5 * math.log(101), warm
    for r in outcome.replicas:
        dpo = [row.losses["trace_replay_dpo"] for row in r.history]
        assert dpo[0] == pytest.approx(math.log(2), abs=1e-3), (r.rank, dpo)
        assert dpo[-1] < dpo[0] - 1e-3, (r.rank, dpo)


@pytest.mark.timeout(900)
def test_main_job_agent_quick(composer_main: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--agent --quick``: the agentic job wired end to end (multi-turn DPO pairs and warm-start episodes played in
    the sandbox, the held-out evaluation through TRL's tool loop, 2 replica processes training on episodes in a
    `CodingEnvironment` per rollout through DiLoCo, the report with the episodes' section), and a cheap learning
    signal: the warm start learns the tool format, and the multi-turn DPO loss starts at ln 2 and falls."""
    from main_job.agent_job import QUICK

    outcome = composer_main.main(["--agent", "--quick", "--output-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    steps, sync_every = QUICK["steps"], QUICK["sync_every"]
    assert len(outcome.replicas) == 2
    for r in outcome.replicas:
        assert len(r.history) == steps
        for channel in CHANNELS:
            values = [row.losses.get(channel) for row in r.history]
            assert all(v is not None and math.isfinite(v) for v in values), (r.rank, channel, values)
        assert r.rounds_committed == steps // sync_every
    assert outcome.identical_weights
    assert len(outcome.before.per_task) == 88
    assert len(outcome.hard) == 28
    assert "crf main job, agentic (--agent)" in printed
    assert re.search(r"trace-replay DPO: \d+ multi-turn pairs", printed)
    assert "held-out pass rate before RL: " in printed
    assert "[replica 1] step" in printed
    assert re.search(r"change [+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]", printed)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["agent"] is True
    for when in ("before", "after"):
        assert set(result["episodes"][when]) == {"all", "easy", "hard"}
        stats = result["episodes"][when]["all"]
        assert set(stats) == {"tool_calls", "submitted", "failed_drafts", "repair", "pass_rate"}
        assert stats["pass_rate"] == pytest.approx(result[when])
    summary = (tmp_path / "summary.md").read_text()
    assert "## Episodes (held-out tasks)" in summary
    assert "failing drafts fixed" in summary
    job = json.loads((tmp_path / "job.json").read_text())
    assert job["agent"] is True
    assert Path(job["train_tasks"]).name == "tasks_train.jsonl"
    assert "heldout" not in json.dumps(job)
    pairs = (tmp_path / "agent_pairs.jsonl").read_text().splitlines()
    assert pairs
    assert all('"tool_calls"' in line for line in pairs)
    # The learning signal (runs are deterministic for a seed): the warm start takes the policy from a uniform guess
    # over the 101 characters (ln 101 = 4.615 per token) to well under half of it on the tool-call format, and the
    # DPO loss on multi-turn pairs starts at ln 2 (the policy is its own reference) and falls on every replica.
    warm = re.search(r"^warm start: .*, loss (\d+\.\d+) -> (\d+\.\d+)$", printed, re.MULTILINE)
    assert warm is not None
    first, last = float(warm.group(1)), float(warm.group(2))
    assert first == pytest.approx(math.log(101), abs=0.1)
    assert last < 0.5 * first, (first, last)
    for r in outcome.replicas:
        dpo = [row.losses["trace_replay_dpo"] for row in r.history]
        assert dpo[0] == pytest.approx(math.log(2), abs=1e-3), (r.rank, dpo)
        assert dpo[-1] < dpo[0] - 1e-3, (r.rank, dpo)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_main_job_full(composer_main: ModuleType, tmp_path: Path) -> None:
    """The README's run on its default seed: the composed recipe beats GRPO alone at the same budget, on all held-out
    tasks and on the hard subset, where GRPO alone stays near 0 (its groups there are all zeros). Each run is its own
    process, as `nox -s main` and the ablation run it, so the job pins its CPU numerics before torch loads and prints
    the figures of docs/ablation.json for seed 0 (benchmarks/main_job_ablation.py). Its wall time moves with the
    machine's load, so it is a figure in the docs, not asserted."""
    script = Path(composer_main.__file__)
    results = {}
    for arm, flags in (("composed", []), ("grpo", ["--channels", "grpo"])):
        out = tmp_path / arm
        subprocess.run([sys.executable, str(script), "--output-dir", str(out), *flags], check=True, timeout=1700)
        results[arm] = json.loads((out / "result.json").read_text())
        if platform.machine().lower() in ("x86_64", "amd64"):  # pinned: the figures of any x86-64 machine
            assert results[arm]["numerics"].split()[1] == "AVX2", results[arm]["numerics"]
    composed, grpo = results["composed"], results["grpo"]
    assert composed["before_per_task"] == grpo["before_per_task"]  # the same warm start and evaluation draws
    assert composed["change"] > grpo["change"], (composed["change"], grpo["change"])
    hard = {arm: r["subsets"]["hard"]["change"] for arm, r in results.items()}
    assert hard["composed"] > hard["grpo"], hard
    assert abs(hard["grpo"]) < 0.05, hard


@pytest.fixture
def moto_s3(repo_root: Path) -> Iterator[dict[str, Any]]:
    """A moto S3 server on 127.0.0.1 (free port) with one bucket: ``bucket``, ``endpoint``, ``client``; started by
    crf-diloco's test server (``packages/crf-diloco/tests/s3_server.py``, which also fixes a moto read race)."""
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs", reason="the s3:// store needs crf-diloco[s3] (s3fs)")
    pytest.importorskip("moto.server", reason="the S3 test server is moto[server]")
    sys.path.insert(0, str(repo_root / "packages" / "crf-diloco" / "tests"))
    try:
        from s3_server import moto_s3_server
    finally:
        sys.path.pop(0)
    with moto_s3_server("crf-main-job") as s3:
        client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                              aws_secret_access_key="testing")  # fmt: skip
        yield {"bucket": s3.bucket, "endpoint": s3.endpoint, "client": client}


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_main_job_quick_s3(
    composer_main: ModuleType, tmp_path: Path, moto_s3: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """The quick run with ``--store s3://…`` against moto's S3 server through s3fs (real HTTP, create-only writes),
    with the sparse codec on the wire, each round started a step early in the background (Streaming DiLoCo's
    overlap) and torchft's replica-scoped ``should_commit`` (no store-wide vote): the replicas still end
    bit-identical."""
    store = f"s3://{moto_s3['bucket']}/runs"
    options = [
        f"endpoint_url={moto_s3['endpoint']}",
        "key=testing",
        "secret=testing",
        'client_kwargs={"region_name": "us-east-1"}',
    ]
    argv = ["--quick", "--output-dir", str(tmp_path), "--store", store, "--run-id", "s3-quick"]
    argv += ["--codec", "topk", "--sync-every", "4", "--sync-delay", "2"]  # one round, overlapped with one step
    argv += ["--vote-scope", "replica"]
    argv += ["--link", "40ms,50MB/s"]  # the report sets each sync against its floor on that link
    argv += [x for option in options for x in ("--storage-option", option)]
    outcome = composer_main.main(argv)
    printed = capsys.readouterr().out
    assert f"store {store}" in printed
    assert "(topk on the wire), started 2 steps early in the background, vote scope replica" in printed
    from main_job.records import JobSpec, read_record

    spec = read_record(JobSpec, tmp_path / "job.json")
    assert (spec.codec, spec.sync_every, spec.sync_delay, spec.vote_scope) == ("topk", 4, 2, "replica")
    for r in outcome.replicas:
        assert r.rounds_committed == 1
        assert r.bytes_written > 0
        assert r.bytes_read > 0
    assert len({r.weights_sha256 for r in outcome.replicas}) == 1  # the overlapped rounds still agree bit for bit
    for r in outcome.replicas:  # the sync's record: committed, its megabytes and round trips as the store counted
        (sync,) = r.syncs
        assert sync.committed
        assert 0 < sync.megabytes * 1e6 <= r.bytes_written + r.bytes_read
        assert sync.round_trips >= 3  # announce, payload, decision at least
        assert sync.seconds > 0
    header = next(line for line in printed.splitlines() if line.startswith(" replica |"))
    assert "sync/floor" in header
    result = json.loads((tmp_path / "result.json").read_text())
    for rank, r in enumerate(outcome.replicas):
        (sync,) = r.syncs
        floor = sync.megabytes * 1e6 / 50e6 + sync.round_trips * 0.040
        assert result["syncs"][str(rank)]["floor"] == pytest.approx(floor)
        assert result["syncs"][str(rank)]["ratio"] == pytest.approx(sync.seconds / floor)
    assert "Link to the store: 40 ms, 50 MB/s" in (tmp_path / "summary.md").read_text()
    listed = moto_s3["client"].list_objects_v2(Bucket=moto_s3["bucket"], Prefix="runs/s3-quick/")
    assert listed.get("Contents"), "nothing was written under the run's prefix in the bucket"
    assert not (tmp_path / "store").exists()  # nothing fell back to the local folder
    # The credentials reached the replicas through their environment, never the run folder.
    assert "secret=***" in (tmp_path / "summary.md").read_text()
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".md", ".log"):
            assert "testing" not in path.read_text(errors="replace"), path
