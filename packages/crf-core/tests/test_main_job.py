"""The README's main job (``examples/composer_main.py``): a CI-sized run, and the full run as a slow test."""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

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
        assert 0.0 <= r.pass_rate_before <= 1.0
        assert 0.0 <= r.pass_rate_after <= 1.0
        assert r.model is None  # released once evaluated
    assert "trace replay: 12 pairs" in printed
    assert "kept 12 of 12" in printed
    assert "pass rate before RL: " in printed
    sandbox_line = next(line for line in printed.splitlines() if line.startswith("sandbox: "))
    assert sandbox_line.startswith(("sandbox: bubblewrap", "sandbox: rlimits only"))
    header = next(line for line in printed.splitlines() if line.startswith(" replica |"))
    for column in ("reward (first", "pass rate (before -> after RL)", "grpo", "sdpo_jsd", "trace_replay_dpo"):
        assert column in header, column
    for column in ("rounds", "MB synced"):
        assert column in header, column
    assert "[replica 1] step" in printed
    assert (out / "composer_main.png").stat().st_size > 10_000
    assert (out / "trace_pairs.jsonl").read_text().count("\n") == 12
    return results


def test_main_job_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    _check_run(_load(), tmp_path, steps=4, sync_every=2, capsys=capsys)
    assert time.monotonic() - start < 120  # < 60 s on an idle 2-core machine


def test_main_job_falls_back_to_rlimits_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without bubblewrap the job still runs, isolating with resource limits only, and prints that."""
    import crf_core.rewards.sandbox as sandbox

    main = _load()
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    main.sandbox_isolation.cache_clear()
    try:
        assert main.sandbox_isolation() == "rlimits"
        line = main.describe_sandbox()
        assert line.startswith("sandbox: rlimits only")
        assert "`bubblewrap`" in line
        task = main.load_tasks()[0]
        from crf_core.rewards import UnitTestReward

        reward = UnitTestReward(isolation=main.sandbox_isolation())
        assert reward([task["prompt"]], [task["solution"]], tests=[task["tests"]]) == [1.0]
    finally:
        main.sandbox_isolation.cache_clear()


def test_reward_ends_and_running_mean() -> None:
    main = _load()
    history = [{"step": float(i + 1), "reward": float(i)} for i in range(10)]  # a window of 10 // 5 = 2 steps
    assert main.reward_window(10) == 2
    assert main.reward_window(3) == 1
    assert main.reward_ends(history) == (0.5, 8.5)
    assert main.reward_ends([]) != main.reward_ends([])  # NaN, not a made-up number
    assert main._running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


@pytest.mark.slow
def test_main_job_full(tmp_path: Path) -> None:
    """The README's full run completes within the budget, every replica commits every round, and it learns what it can
    learn reliably at this size.

    Reliable: the trace-replay DPO loss on the replayed pairs falls from ln 2 ≈ 0.693 (the policy starts with no
    preference) to about 0.45 over 100 steps in every run seen. Not reliable: the coding reward. Observed pass rates
    (96 samples, before -> after RL): 0.125 -> 0.250, 0.125 -> 0.212, 0.125 -> 0.142 on the default seed, 0.076 -> 0.104
    and 0.063 -> 0.087 on seeds 1 and 2; with a standard error near 0.035 these are not significant, and runs are not
    bit-reproducible (the replica threads share torch's random generator). So the reward is only required not to
    collapse.
    """
    main = _load()
    start = time.monotonic()
    results = main.main(["--output-dir", str(tmp_path)])
    assert time.monotonic() - start < 300  # the budget on 2 cores
    for r in results:
        assert r.error is None
        assert len(r.history) == 100
        assert r.rounds_committed == 10
        rewards = [row["reward"] for row in r.history]
        assert all(0.0 <= x <= 1.0 for x in rewards)
        for channel in ("grpo", "sdpo_jsd", "trace_replay_dpo"):
            assert all(math.isfinite(row[channel]) for row in r.history), channel
        dpo = [row["trace_replay_dpo"] for row in r.history]
        first, last = sum(dpo[:20]) / 20, sum(dpo[-20:]) / 20
        assert first > 0.6, (first, last)
        assert last < first - 0.1, (first, last)
    before, after = results[0].pass_rate_before, results[0].pass_rate_after
    assert after >= before - 0.05, (before, after)


@pytest.fixture
def moto_s3() -> Iterator[dict[str, Any]]:
    """A moto S3 server on 127.0.0.1 (free port) with one bucket: ``bucket``, ``endpoint``, ``client``."""
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs", reason="the s3:// store needs crf-diloco[s3] (s3fs)")
    server_mod = pytest.importorskip("moto.server", reason="the S3 test server is moto[server]")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        client.create_bucket(Bucket="crf-main-job")
        yield {"bucket": "crf-main-job", "endpoint": endpoint, "client": client}
    finally:
        server.stop()


@pytest.mark.integration
def test_main_job_quick_s3(tmp_path: Path, moto_s3: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """The quick run with ``--store s3://…`` against moto's S3 server through s3fs (real HTTP, create-only writes)."""
    main = _load()
    store = f"s3://{moto_s3['bucket']}/runs"
    options = [
        f"endpoint_url={moto_s3['endpoint']}",
        "key=testing",
        "secret=testing",
        'client_kwargs={"region_name": "us-east-1"}',
    ]
    argv = ["--quick", "--steps", "4", "--sync-every", "2", "--output-dir", str(tmp_path), "--store", store]
    argv += ["--run-id", "s3-quick", *(x for option in options for x in ("--storage-option", option))]
    results = main.main(argv)
    printed = capsys.readouterr().out
    assert f"store {store}" in printed
    for r in results:
        assert r.error is None
        assert r.rounds_committed == 2
        assert r.bytes_written > 0
        assert r.bytes_read > 0
    listed = moto_s3["client"].list_objects_v2(Bucket=moto_s3["bucket"], Prefix="runs/s3-quick/")
    keys = [obj["Key"] for obj in listed.get("Contents", [])]
    assert keys, "nothing was written under the run's prefix in the bucket"
    assert not (tmp_path / "store").exists()  # nothing fell back to the local folder


def test_storage_option_parsing() -> None:
    main = _load()
    opts = main.parse_args(
        ["--storage-option", "endpoint_url=http://127.0.0.1:9", "--storage-option", 'client_kwargs={"a": 1}']
    )
    assert opts.storage_options == {"endpoint_url": "http://127.0.0.1:9", "client_kwargs": {"a": 1}}
    with pytest.raises(SystemExit):
        main.parse_args(["--storage-option", "no-equals-sign"])
