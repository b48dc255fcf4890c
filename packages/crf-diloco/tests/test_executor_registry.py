"""`ExecutorBase` owns the launch template; `crf_diloco.executors.registry` is what ``crf-diloco launch`` offers.

Adding an executor is one module (an `ExecutorBase` subclass and its ``LAUNCHER``): these tests add a toy one
through the registry alone and check the CLI offers, refuses and builds it without a branch of its own.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from crf_diloco import cli
from crf_diloco.executors import (
    ExecutorBase,
    HFJobsExecutor,
    LaunchPlan,
    LocalProcessExecutor,
    ModalExecutor,
    RayExecutor,
    ReplicaResult,
    ServerlessExecutor,
    plan_launch,
    registry,
)
from crf_diloco.executors.registry import BuildContext, Launcher


@dataclass
class _ToyHandle:
    rank: int


class _ToyExecutor(ExecutorBase[LaunchPlan, list[str], _ToyHandle]):
    """Starts nothing real; fails at rank ``fail_at``; records what the template called."""

    def __init__(self, fail_at: int | None = None, reword: bool = False) -> None:
        self.fail_at, self.reword = fail_at, reword
        self.calls: list[str] = []

    def prepare_launch(
        self, command: Sequence[str], world_size: int, uri: str, run_id: str | None, env: Mapping[str, str] | None
    ) -> LaunchPlan:
        self.calls.append("prepare")
        return plan_launch(command, world_size, uri, run_id, env)

    def begin_launch(self, plan: LaunchPlan, on_output: Any) -> list[str]:
        self.calls.append("begin")
        return ["shared"]

    def start_replica(self, launch: list[str], plan: LaunchPlan, rank: int) -> _ToyHandle:
        if rank == self.fail_at:
            raise OSError(f"rank {rank} cannot start")
        self.calls.append(f"start {rank}")
        return _ToyHandle(rank)

    def abort_launch(self, launch: list[str]) -> None:
        self.calls.append(f"abort {launch[0]}")

    def launch_error(self, exc: Exception, launch: list[str], started: int) -> Exception | None:
        return RuntimeError(f"rank {started} failed ({exc}); stopped the others") if self.reword else None

    def collect(self, handles: Sequence[_ToyHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        return [ReplicaResult(rank=h.rank, returncode=0, duration_s=0.0) for h in handles]

    def terminate(self, handles: Sequence[_ToyHandle]) -> None:
        self.calls.append(f"terminate {[h.rank for h in handles]}")


def test_every_executor_is_an_executor_base_and_a_serverless_executor() -> None:
    for cls in (LocalProcessExecutor, RayExecutor, HFJobsExecutor, ModalExecutor):
        assert issubclass(cls, ExecutorBase)
        assert "launch_replicas" not in vars(cls)  # the template is the base's
    assert isinstance(_ToyExecutor(), ServerlessExecutor)


def test_the_template_validates_starts_each_rank_and_returns_handles_by_rank(tmp_path: Any) -> None:
    toy = _ToyExecutor()
    handles = toy.launch_replicas(["prog"], world_size=3, uri=str(tmp_path), run_id="run-1")
    assert [h.rank for h in handles] == [0, 1, 2]
    assert toy.calls == ["prepare", "begin", "start 0", "start 1", "start 2"]
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        toy.launch_replicas(["prog"], world_size=0, uri=str(tmp_path))


@pytest.mark.parametrize("reword", [False, True])
def test_a_failed_start_stops_the_started_replicas_and_releases_the_launch(tmp_path: Any, reword: bool) -> None:
    toy = _ToyExecutor(fail_at=2, reword=reword)
    with pytest.raises(RuntimeError if reword else OSError, match="rank 2") as info:
        toy.launch_replicas(["prog"], world_size=4, uri=str(tmp_path))
    assert toy.calls[-2:] == ["terminate [0, 1]", "abort shared"]
    if reword:
        assert info.value.__cause__ is None
        assert "stopped the others" in str(info.value)


def test_the_registry_lists_the_four_executors_in_order() -> None:
    assert [entry.name for entry in registry.launchers()] == ["local", "ray", "hf", "modal"]
    assert cli.EXECUTORS == ("local", "ray", "hf", "modal")
    assert [e.name for e in registry.launchers() if e.remote] == ["hf", "modal"]
    with pytest.raises(KeyError, match="choose one of"):
        registry.launcher("nope")


def _toy_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--toy-level", type=registry.positive_int, default=None)


def test_a_new_executor_needs_only_its_launcher(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    built: list[BuildContext] = []

    def build(args: argparse.Namespace, context: BuildContext) -> _ToyExecutor:
        built.append(context)
        return _ToyExecutor()

    toy = Launcher("toy", "--executor toy", build, add_options=_toy_options, same_machine=True, order=5)
    real = registry.launchers()
    monkeypatch.setattr(registry, "launchers", lambda: (*real, toy))
    parser = cli.build_parser()
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    argv = ["launch", "--replicas", "2", "--uri", str(tmp_path), "--executor", "toy", "--toy-level", "3", str(script)]
    args = parser.parse_args(argv)
    assert args.toy_level == 3
    executor = cli._make_executor(args, str(tmp_path))
    assert isinstance(executor, _ToyExecutor)
    assert built == [BuildContext(str(tmp_path))]  # not remote: nothing to install, no wheels
    launch = cli._subcommand(parser, "launch")
    cli._check_executor_options(args, launch)  # its own option is fine with it
    wrong = parser.parse_args(["launch", "--replicas", "1", "--uri", "x", "--toy-level", "2", str(script)])
    with pytest.raises(SystemExit):
        cli._check_executor_options(wrong, launch)  # ... and refused with another executor


def test_number_types_word_their_bound() -> None:
    positive = registry.number(minimum=0.0, inclusive=False)
    assert positive("1.5") == 1.5
    for bad in ("0", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a number > 0"):
            positive(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="expected a number >= 0"):
        registry.number(minimum=0.0, inclusive=True)("-1")
