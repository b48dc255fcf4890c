"""``crf-diloco launch`` / ``python -m crf_diloco launch``, run as a real command."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from crf_diloco._version import __version__
from crf_diloco.cli import main

BEHAVE = str(Path(__file__).parent / "replica_scripts" / "behave.py")


def launch(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "crf_diloco", "launch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rank_lines(text: str, rank: int) -> list[str]:
    prefix = f"[rank {rank}] "
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


def test_console_script_points_at_cli_main() -> None:
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "crf-diloco"]
    assert script.value == "crf_diloco.cli:main"


def test_cli_launch_streams_rank_prefixed_logs_and_exits_zero(tmp_path: Path) -> None:
    proc = launch(
        "--replicas", "2", "--uri", "store", "--run-id", "cli-run", "--env", "MY_FLAG=42",
        BEHAVE, "--show-env", "MY_FLAG", "--lines", "2", "--replicas", "9",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        stdout = rank_lines(proc.stdout, rank)
        record = json.loads(stdout[0])
        assert record["rank"] == rank
        assert record["world_size"] == 2
        assert record["uri"] == str(tmp_path / "store")
        assert record["run_id"] == "cli-run"
        assert record["env"] == {"MY_FLAG": "42"}
        assert record["extra_argv"] == ["--replicas", "9"]  # options after the script belong to the script
        assert stdout[1:] == [f"line 0 of rank {rank}", f"line 1 of rank {rank}"]
        assert rank_lines(proc.stderr, rank) == [f"stderr line of rank {rank}"]  # stderr stays on stderr
    assert "crf-diloco: run cli-run: 2 of 2 replicas succeeded" in proc.stderr
    assert "rank 0: ok after" in proc.stderr


def test_cli_hands_every_replica_the_same_fresh_secret(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CRF_DILOCO_SECRET"}

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        args = ["--replicas", "2", "--uri", "store", *extra, BEHAVE, "--show-env", "CRF_DILOCO_SECRET"]
        return subprocess.run(
            [sys.executable, "-m", "crf_diloco", "launch", *args],
            cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip

    seen = []
    for _ in range(2):
        proc = run()
        assert proc.returncode == 0, proc.stderr
        secrets = {json.loads(rank_lines(proc.stdout, r)[0])["env"]["CRF_DILOCO_SECRET"] for r in (0, 1)}
        assert len(secrets) == 1, "every replica of a launch gets the same secret"
        (secret,) = secrets
        assert re.fullmatch(r"[0-9a-f]{64}", secret)
        launcher_lines = [line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith("[rank ")]
        assert not any(secret in line for line in launcher_lines), "the launcher never prints the secret"
        seen.append(secret)
    assert seen[0] != seen[1], "a fresh secret per launch"
    given = "given-secret-0123456789abcdefghijkl"
    proc = run("--env", f"CRF_DILOCO_SECRET={given}")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(rank_lines(proc.stdout, 1)[0])["env"]["CRF_DILOCO_SECRET"] == given
    weak = run("--env", "CRF_DILOCO_SECRET=weak")
    assert weak.returncode == 2
    assert "at least 32" in weak.stderr


def test_cli_exits_nonzero_and_summarises_failed_replicas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(
        ["launch", "--replicas", "3", "--uri", str(tmp_path),
         BEHAVE, "--fail-rank", "1", "--fail-stderr", "loss is NaN", "--fail-exit", "3"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert status == 1
    summary = err[err.index("replicas succeeded") :]
    assert "2 of 3 replicas succeeded" in err
    assert "rank 1: FAILED (exit code 3) after" in summary
    assert "    | loss is NaN" in summary
    assert "rank 0: ok" in summary
    assert "rank 2: ok" in summary
    assert json.loads(rank_lines(out, 2)[0])["rank"] == 2


def test_cli_timeout_stops_replicas_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    status = main(["launch", "--replicas", "1", "--uri", str(tmp_path), "--timeout", "1.5", BEHAVE, "--sleep", "60"])
    _, err = capsys.readouterr()
    assert time.monotonic() - start < 30
    assert status == 1
    assert "rank 0: FAILED (timed out after 1.5 s; terminated (killed by signal SIGTERM))" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas", "0", "--uri", "x", BEHAVE], "expected a whole number >= 1"),
        (["--replicas", "2", "--uri", "x", "missing.py"], "is not a file"),
        (["--replicas", "2", "--uri", "x", "--run-id", "../up", BEHAVE], "could escape the store prefix"),
        (["--replicas", "2", "--uri", "x", "--timeout", "-3", BEHAVE], "seconds > 0"),
        (["--replicas", "2", "--uri", "x", "--env", "NOEQUALS", BEHAVE], "expected KEY=VALUE"),
        (["--replicas", "2", "--uri", "x", "--env", "CRF_DILOCO_RANK=1", BEHAVE], "must not set"),
        (["--replicas", "2", "--uri", "", BEHAVE], "uri must be a non-empty"),
        (["--replicas", "2", BEHAVE], "--uri"),
        (["--replicas", "2", "--uri", "x", "--ray-num-gpus", "1", BEHAVE], "--ray-num-gpus needs --executor ray"),
        (["--replicas", "2", "--uri", "x", "--executor", "ray", "--ray-num-cpus", "-1", BEHAVE], "a number >= 0"),
        (["--replicas", "2", "--uri", "x", "--modal-gpu", "H100", BEHAVE], "--modal-gpu needs --executor modal"),
        (["--replicas", "2", "--uri", "x", "--executor", "modal", "--hf-flavor", "t4-small", BEHAVE],
         "--hf-flavor needs --executor hf"),
        (["--replicas", "2", "--uri", "x", "--image", "python:3.12", BEHAVE], "--image needs --executor hf or modal"),
        (["--replicas", "2", "--uri", "x", "--secret", "HF_TOKEN", BEHAVE], "--secret needs --executor hf or modal"),
        (["--replicas", "2", "--uri", "x", "--no-cancel-on-failure", BEHAVE], "needs --executor hf or modal"),
        (["--replicas", "2", "--uri", "x", "--executor", "hf", "--pip", "torch", "--no-pip", BEHAVE],
         "--pip and --no-pip exclude each other"),
        (["--replicas", "2", "--uri", "x", "--executor", "modal", "--modal-memory", "0", BEHAVE], "whole number >= 1"),
        (["--replicas", "2", "--uri", "x", "--executor", "modal", "--modal-cpu", "nan", BEHAVE], "a number > 0"),
    ],
)  # fmt: skip
def test_cli_rejects_bad_arguments_with_status_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["launch", *args])
    out, err = capsys.readouterr()
    assert info.value.code == 2
    assert message in err
    assert "[rank" not in out  # nothing was started


def test_cli_sigterm_stops_every_replica(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    cli = subprocess.Popen(
        [sys.executable, "-m", "crf_diloco", "launch", "--replicas", "2", "--uri", str(tmp_path),
         BEHAVE, "--pidfile-dir", str(pids), "--sleep", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        replica_pids = [int(p.read_text()) for p in sorted(pids.glob("*.pid"))]
        assert len(replica_pids) == 2
        cli.send_signal(signal.SIGTERM)
        _, stderr = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 128 + signal.SIGTERM
    assert "interrupted by SIGTERM; replicas stopped" in stderr
    for pid in replica_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped by the launcher, not left running or as a zombie


@pytest.mark.slow
@pytest.mark.integration
def test_cli_runs_real_diloco_training_across_replicas(tmp_path: Path, diloco_replicas_agree: Any) -> None:
    """The whole chain a user meets: CLI → executor → CRF_DILOCO_* → from_env → MockManager → torchft DiLoCo."""
    script = str(Path(__file__).parent / "replica_scripts" / "diloco_replica.py")
    out = tmp_path / "out"
    out.mkdir()
    proc = launch(
        "--replicas", "2", "--uri", str(tmp_path / "store"), "--timeout", "400", script, "--out", str(out),
        "--steps", "12", "--sync-every", "4",
        cwd=tmp_path, timeout=420,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert f"rank {rank}: 3 outer steps" in rank_lines(proc.stdout, rank)[-1]
    diloco_replicas_agree(out, world_size=2, outer_steps=3)


def test_cli_builds_the_hf_executor_and_ships_the_script(tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub")
    from crf_diloco.cli import _make_executor, _replica_command, build_parser
    from crf_diloco.executors import HFJobsExecutor, script_command
    from crf_diloco.executors.torch_env import with_torch_env

    args = build_parser().parse_args(
        ["launch", "--executor", "hf", "--replicas", "4", "--uri", "s3://bucket/runs", "--timeout", "7200.5",
         "--crf-source", "index", "--hf-flavor", "a10g-large", "--hf-namespace", "crf-org", "--secret", "AWS_SECRET_ACCESS_KEY",
         "--no-cancel-on-failure", BEHAVE, "--lr", "1"]
    )  # fmt: skip
    executor = _make_executor(args, "s3://bucket/runs")
    assert isinstance(executor, HFJobsExecutor)
    assert (executor.flavor, executor.namespace, executor.job_timeout_s) == ("a10g-large", "crf-org", 7201)
    assert executor.secret_env == ("AWS_SECRET_ACCESS_KEY",)
    assert executor.policy.cancel_on_failure is False
    command = _replica_command(args, ["--lr", "1"], "s3://bucket/runs")
    # the replicas install this crf-diloco with the store's extra, then run the shipped script
    assert command[:6] == ["uv", "run", "--no-project", "--with", f"crf-diloco[s3]=={__version__}", "--"]
    assert command[6:] == with_torch_env(script_command(BEHAVE, ["--lr", "1"]))
    args.pip, args.no_pip = None, True
    assert _replica_command(args, [], "s3://bucket/runs") == with_torch_env(script_command(BEHAVE, []))


def test_cli_builds_the_modal_executor(tmp_path: Path) -> None:
    pytest.importorskip("modal")
    from crf_diloco.cli import _make_executor, _replica_command, build_parser
    from crf_diloco.executors import ModalExecutor, script_command
    from crf_diloco.executors.torch_env import with_torch_env

    args = build_parser().parse_args(
        ["launch", "--executor", "modal", "--replicas", "2", "--uri", "gs://bucket/runs", "--modal-gpu", "H100:2",
         "--modal-cpu", "8", "--modal-memory", "32768", "--modal-secret", "gcp", "--modal-app", "my-app",
         "--pip", "crf-diloco[gcs]", "--pip", "transformers>=4.50", "--image", "python:3.11", BEHAVE]
    )  # fmt: skip
    executor = _make_executor(args, "gs://bucket/runs")
    assert isinstance(executor, ModalExecutor)
    assert (executor.app_name, executor.gpu, executor.cpu, executor.memory) == ("my-app", "H100:2", 8.0, 32768)
    assert executor.modal_secrets == ("gcp",)
    assert executor.pip == ("crf-diloco[gcs]", "transformers>=4.50")  # installed into the image, not at start-up
    assert executor.image == "python:3.11"
    assert executor.timeout_s == 86400  # no --timeout: Modal's longest, not its 300 s default
    assert _replica_command(args, [], "gs://bucket/runs") == with_torch_env(script_command(BEHAVE, []))


@pytest.mark.parametrize(("executor", "module"), [("hf", "huggingface_hub"), ("modal", "modal")])
def test_cli_cloud_executor_without_its_sdk_exits_2_naming_the_extra(
    executor: str, module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setenv("CRF_DILOCO_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens: the index cannot say
    with pytest.raises(SystemExit) as info:
        main(
            ["launch", "--executor", executor, "--replicas", "2", "--uri", "s3://b/p", "--crf-source", "index", BEHAVE]
        )
    assert info.value.code == 2
    assert f"pip install 'crf-diloco[{executor}]'" in capsys.readouterr().err


def test_default_requirement_follows_the_store() -> None:
    from crf_diloco.cli import default_requirement

    assert default_requirement("s3://b/p") == f"crf-diloco[s3]=={__version__}"
    assert default_requirement("gs://b/p") == f"crf-diloco[gcs]=={__version__}"
    assert default_requirement("az://c/p") == f"crf-diloco[azure]=={__version__}"
    assert default_requirement("hf://buckets/me/b") == f"crf-diloco[hf]=={__version__}"
    assert default_requirement("/mnt/shared") == f"crf-diloco=={__version__}"


REPLICA_SCRIPTS = Path(__file__).parent / "replica_scripts"


def test_cli_exports_torchruns_variables_for_a_one_process_world_per_replica(tmp_path: Path) -> None:
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"]
    show = [arg for name in names for arg in ("--show-env", name)]
    env = {**os.environ, "RANK": "7", "WORLD_SIZE": "9"}  # a launcher inside another job must not leak its world
    proc = subprocess.run(
        [sys.executable, "-m", "crf_diloco", "launch", "--replicas", "2", "--uri", "store", BEHAVE, *show],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ports = set()
    for rank in (0, 1):
        record = json.loads(rank_lines(proc.stdout, rank)[0])
        assert record["rank"] == rank  # the replica's rank is CRF_DILOCO_RANK ...
        seen = record["env"]
        # ... and torchrun's variables describe the replica's own one-process torch.distributed world
        assert {k: seen[k] for k in names[:5]} == {
            "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"
        }  # fmt: skip
        assert seen["MASTER_ADDR"] == "127.0.0.1"
        ports.add(int(seen["MASTER_PORT"]))
    assert len(ports) == 2  # two replicas on one host do not share a rendezvous port


def test_cli_runs_a_module_with_dash_m(tmp_path: Path) -> None:
    proc = launch(
        "--replicas", "2", "--uri", "store", "--env", f"PYTHONPATH={REPLICA_SCRIPTS}",
        "-m", "behave", "--lines", "1", "--extra",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        lines = rank_lines(proc.stdout, rank)
        assert json.loads(lines[0])["extra_argv"] == ["--extra"]
        assert lines[1] == f"line 0 of rank {rank}"


def test_cli_runs_a_program_with_no_python(tmp_path: Path) -> None:
    proc = launch(
        "--replicas", "2", "--uri", "store", "--no-python", "sh", "-c", 'echo "replica $CRF_DILOCO_RANK of $WORLD_SIZE"',
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert rank_lines(proc.stdout, 0) == ["replica 0 of 1"]
    assert rank_lines(proc.stdout, 1) == ["replica 1 of 1"]


@pytest.mark.integration
def test_cli_wraps_a_two_process_torchrun_replica_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    env = {**os.environ, "PATH": f"{torchrun.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "crf_diloco", "launch", "--replicas", "2", "--uri", "store", "--timeout", "300",
         "--no-python", "torchrun", "--nproc-per-node", "2", str(REPLICA_SCRIPTS / "torchrun_replica.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=330, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for replica in (0, 1):
        records = sorted(
            (json.loads(line) for line in rank_lines(proc.stdout, replica) if line.startswith("{")),
            key=lambda r: r["RANK"],
        )
        assert [r["RANK"] for r in records] == ["0", "1"]  # torchrun's own ranks inside the replica
        for worker, record in enumerate(records):
            assert record["CRF_DILOCO_RANK"] == str(replica)  # the replica's rank survives torchrun
            assert record["CRF_DILOCO_WORLD_SIZE"] == "2"
            assert (record["WORLD_SIZE"], record["LOCAL_RANK"], record["LOCAL_WORLD_SIZE"]) == ("2", str(worker), "2")
            assert (record["dist_rank"], record["dist_world_size"]) == (worker, 2)
            # the all-reduce summed this replica's two workers only: (10r + 1) + (10r + 2)
            assert record["sum"] == 20 * replica + 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.py"], "crf-diloco launch: error: script 'missing.py' is not a file"),
        (["-m", "not a/module"], "crf-diloco launch: error: -m 'not a/module' is not a module name"),
        (["--no-python", "no-such-program-crf"], "program 'no-such-program-crf' is not found on PATH"),
        (["-m", "--no-python", "x"], "not allowed with argument"),
        (["--env", "RANK=3", BEHAVE], "--env must not set ['RANK']"),
        (["--env", "MASTER_PORT=1", BEHAVE], "--env must not set ['MASTER_PORT']"),
    ],
)  # fmt: skip
def test_cli_launch_errors_name_the_subcommand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["launch", "--replicas", "2", "--uri", "store", *args])
    out, err = capsys.readouterr()
    assert info.value.code == 2
    assert message in err
    assert "crf-diloco launch: error:" in err
    assert "[rank" not in out


def test_cli_ships_this_checkouts_wheel_when_the_index_lacks_this_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("huggingface_hub")
    if shutil.which("uv") is None:
        pytest.skip("uv is not on PATH (pip install uv)")
    from crf_diloco.cli import _replica_command, _shipped_wheels, build_parser
    from crf_diloco.executors.wheels import LOADER, source_tree

    if source_tree() is None:
        pytest.skip("crf-diloco is installed from a wheel here (nox -s wheels), not a checkout to build one from")

    monkeypatch.setenv("CRF_DILOCO_INDEX_URL", "http://127.0.0.1:9/simple")
    args = build_parser().parse_args(["launch", "--executor", "hf", "--replicas", "2", "--uri", "s3://b/p", BEHAVE])
    wheels = _shipped_wheels(args)
    assert [w.name for w in wheels] == [f"crf_diloco-{__version__}-py3-none-any.whl"]
    assert "is not known to be on the package index http://127.0.0.1:9/simple" in capsys.readouterr().err
    command = _replica_command(args, [], "s3://b/p", wheels)
    assert command[:4] == ["python", "-c", LOADER, wheels[0].name]
    rest = command[command.index("--") + 1 :]
    assert rest[:6] == ["uv", "run", "--no-project", "--with", f"crf-diloco[s3]=={__version__}", "--"]
    assert all(len(arg) < 128 * 1024 for arg in command)  # each argument fits Linux's limit
    args = build_parser().parse_args(
        ["launch", "--executor", "hf", "--replicas", "2", "--uri", "s3://b/p", "--crf-source", "index", BEHAVE]
    )
    assert _shipped_wheels(args) == []
    with pytest.raises(SystemExit):
        main(["launch", "--replicas", "2", "--uri", "s3://b/p", "--crf-source", "workspace", BEHAVE])
    assert "--crf-source needs --executor hf or modal" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(
            [
                "launch",
                "--executor",
                "hf",
                "--replicas",
                "2",
                "--uri",
                "x",
                "--pip",
                "y",
                "--crf-source",
                "index",
                BEHAVE,
            ]
        )
    assert "--crf-source applies to the default requirement only" in capsys.readouterr().err
