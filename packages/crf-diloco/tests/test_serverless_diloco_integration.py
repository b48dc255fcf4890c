"""MockManager through real ``torchft.local_sgd.DiLoCo`` (torchft 0.2): surface, outer rounds, parity, healing."""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torchft
import torchft.local_sgd
from torch import nn
from torch.distributed import ReduceOp
from torchft.local_sgd import DiLoCo
from torchft.manager import Manager

from crf_diloco import DILOCO_MANAGER_SURFACE, MockManager, ObjectStoreAllReduce
from crf_diloco.layout import RoundKeys

RunReplicas = Callable[..., list[Any]]
ModelFactory = Callable[..., nn.Module]
INNER_LR, OUTER_LR, MOMENTUM = 4e-3, 0.7, 0.9


class StrictManagerProxy:
    """Forwards to a MockManager, records every member DiLoCo touches, and fails loudly on a missing one."""

    def __init__(self, target: MockManager) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "touched", set())

    def __getattr__(self, name: str) -> Any:
        self.touched.add(name)
        if not hasattr(self._target, name):
            pytest.fail(f"torchft DiLoCo touched Manager.{name}, which MockManager lacks: update MockManager")
        return getattr(self._target, name)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _train(
    manager: Any,
    model: nn.Module,
    rank: int,
    inner_steps: int,
    sync_every: int,
    *,
    fragments: int = 1,
    on_commit: Callable[[int, nn.Module], None] | None = None,
    **diloco_kwargs: Any,
) -> nn.Module:
    """Plain DiLoCo loop: AdamW inner, SGD-Nesterov outer (DiLoCo paper's optimizers)."""
    inner = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=0.1, betas=(0.9, 0.95))
    parts: list[nn.Module] = [model] if fragments == 1 else [model[0], model[2]]  # type: ignore[index]
    # one outer optimizer per fragment (a shared one would also step the other fragments' local grads)
    outer = [torch.optim.SGD(p.parameters(), lr=OUTER_LR, momentum=MOMENTUM, nesterov=True) for p in parts]
    with DiLoCo(manager, parts, inner, outer, sync_every=sync_every, **diloco_kwargs):
        for step in range(inner_steps):
            before = manager.current_step()
            x, y = _batch(rank, step)
            loss = nn.functional.mse_loss(model(x), y)
            inner.zero_grad()
            loss.backward()
            inner.step()
            if on_commit is not None and manager.current_step() != before:
                on_commit(manager.current_step(), model)
    return model


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_mockmanager_has_full_diloco_call_surface(
    memory_uri: str, run_replicas: RunReplicas, tiny_model: ModelFactory
) -> None:
    """Real DiLoCo over a strict proxy: every member it touches exists and is exactly the documented surface."""
    init = tiny_model().state_dict()

    def replica(rank: int) -> set[str]:
        proxy = StrictManagerProxy(MockManager(ObjectStoreAllReduce(memory_uri, rank, 2, timeout=20)))
        _train(proxy, tiny_model(init), rank, inner_steps=4, sync_every=2, fragments=2, use_bucketization=True)
        assert proxy.current_step() == 4  # 2 fragments, sync_every=2: one fragment syncs every inner step
        return set(proxy.touched)

    for touched in run_replicas(replica, 2):
        assert touched - {"current_step"} <= set(DILOCO_MANAGER_SURFACE)
        assert touched >= set(DILOCO_MANAGER_SURFACE), "every documented member is exercised"

    # the same surface exists on torchft's real Manager, with compatible call signatures
    init_src = inspect.getsource(Manager.__init__)
    for name in DILOCO_MANAGER_SURFACE:
        assert hasattr(Manager, name) or f"self.{name} =" in init_src, f"torchft.Manager no longer has {name}"
        if callable(getattr(Manager, name, None)):
            theirs = list(inspect.signature(getattr(Manager, name)).parameters)
            ours = list(inspect.signature(getattr(MockManager, name)).parameters)
            assert theirs == ours, f"{name}: torchft {theirs} vs MockManager {ours}"
    # and no `manager.X` in torchft.local_sgd's source is missing from MockManager
    source = inspect.getsource(torchft.local_sgd)
    used = set(re.findall(r"(?:self\._manager|manager)\.(\w+)", source))
    missing = {name for name in used if not hasattr(MockManager, name) and name != "_use_async_quorum"}
    assert not missing, f"torchft {torchft.__version__} DiLoCo uses Manager members MockManager lacks: {missing}"


def test_mockmanager_diloco_outer_round_completes(
    memory_uri: str, run_replicas: RunReplicas, tiny_model: ModelFactory
) -> None:
    """One outer round through real DiLoCo equals a float64 plain-PyTorch DiLoCo step."""
    torch.manual_seed(3)
    init = tiny_model().state_dict()
    world_size, sync_every = 3, 3

    def replica(rank: int) -> tuple[int, list[torch.Tensor]]:
        manager = MockManager(ObjectStoreAllReduce(memory_uri, rank, world_size, timeout=20))
        model = _train(manager, tiny_model(init), rank, inner_steps=sync_every, sync_every=sync_every)
        return manager.current_step(), _params(model)

    results = run_replicas(replica, world_size)
    assert [step for step, _ in results] == [1] * world_size

    # reference: each replica's H local AdamW steps, then the outer Nesterov step on the mean pseudo-gradient
    locals_ = []
    for rank in range(world_size):
        model = tiny_model(init)
        inner = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=0.1, betas=(0.9, 0.95))
        for step in range(sync_every):
            x, y = _batch(rank, step)
            inner.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            inner.step()
        locals_.append([p.detach().double() for p in model.parameters()])
    global0 = [p.detach().double() for p in tiny_model(init).parameters()]
    for i, theta in enumerate(global0):
        delta = sum(theta - loc[i] for loc in locals_) / world_size  # averaged pseudo-gradient
        # first SGD step with momentum: buffer = delta; nesterov: delta + momentum * buffer
        expect = theta - OUTER_LR * (delta + MOMENTUM * delta)
        for _, params in results:
            torch.testing.assert_close(params[i].double(), expect, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for _, params in results for a, b in zip(params, results[0][1], strict=False))


@pytest.mark.parametrize(
    "variant",
    [
        {"fragments": 1},
        {"fragments": 2, "use_bucketization": True},
        {"fragments": 1, "should_quantize": True},
    ],
    ids=["plain", "two-fragments-bucketized", "int8-quantized"],
)
def test_replicas_bit_identical_after_every_commit(
    variant: dict[str, Any], memory_uri: str, run_replicas: RunReplicas, tiny_model: ModelFactory
) -> None:
    """After every commit all replicas hold the same global state (each fragment's backup weights and
    outer-optimizer state, as torchft's integration tests compare); with one fragment and alpha=0 the
    model parameters themselves are identical too."""
    init = tiny_model().state_dict()
    world_size, rounds = 3, 3

    def global_state(manager: MockManager) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []

        def walk(value: Any) -> None:
            if isinstance(value, torch.Tensor):
                out.append(value.detach().clone())
            elif isinstance(value, dict):
                for k in sorted(value, key=str):
                    walk(value[k])
            elif isinstance(value, (list, tuple)):
                for v in value:
                    walk(v)

        walk({key: fn() for key, fn in manager._save_fns.items()})
        return out

    def replica(rank: int) -> dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]]:
        snapshots: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        manager = MockManager(ObjectStoreAllReduce(memory_uri, rank, world_size, timeout=20))
        _train(
            manager,
            tiny_model(init),
            rank,
            inner_steps=2 * rounds,
            sync_every=2 * variant["fragments"],  # each fragment syncs every 2 inner steps
            on_commit=lambda step, m: snapshots.__setitem__(step, (_params(m), global_state(manager))),
            **variant,
        )
        return snapshots

    results = run_replicas(replica, world_size)
    assert sorted(results[0]) == list(range(1, rounds + 1))
    for step in results[0]:
        params0, state0 = results[0][step]
        assert len(state0) >= 4
        for r in range(1, world_size):
            params, state = results[r][step]
            assert all(torch.equal(a, b) for a, b in zip(state, state0, strict=False)), (
                f"rank {r} global state, step {step}"
            )
            if variant["fragments"] == 1:
                assert all(torch.equal(a, b) for a, b in zip(params, params0, strict=False)), (
                    f"rank {r} params, step {step}"
                )
    assert not all(
        torch.equal(a, b) for a, b in zip(results[0][rounds][0], tiny_model(init).parameters(), strict=False)
    )


def test_work_objects_behave_like_torchft(memory_uri: str, run_replicas: RunReplicas) -> None:
    def replica(rank: int) -> None:
        manager = MockManager(ObjectStoreAllReduce(memory_uri, rank, 2, timeout=20))
        manager.start_quorum()
        a, b = torch.full((4,), float(rank)), torch.full((2, 2), 10.0 * rank)
        work_a = manager.allreduce(a)
        seen: list[torch.Tensor] = []

        def record(fut: torch.futures.Future[Any]) -> int:
            seen.append(fut.value().clone())
            return 1

        chained = manager.allreduce(b).get_future().then(record)
        assert isinstance(work_a, torch.distributed._Work)
        assert work_a.wait() is True  # one round carries both tensors
        assert chained.wait() == 1
        assert torch.equal(a, torch.full((4,), 0.5))
        assert torch.equal(b, torch.full((2, 2), 5.0))
        assert torch.equal(seen[0], b)
        assert manager.should_commit()
        assert manager.current_step() == 1
        assert manager.num_participants() == 2
        assert manager.participating_rank() == rank

    run_replicas(replica, 2)


def test_reported_error_vetoes_round_on_every_replica_and_keeps_pre_round_weights(
    memory_uri: str, run_replicas: RunReplicas, tiny_model: ModelFactory
) -> None:
    """A replica that reports an error during the one overlapped inner step of
    ``fragment_sync_delay=1`` (before its lazy round ran) vetoes the round; it aborts on every
    replica and nobody moves off the pre-round weights. The veto may reach the store before the
    other replica joined the round: that replica must still land in the vetoed round, not skip it
    and commit the next one alone (``test_allreduce_vote.py`` pins that race down)."""
    init = tiny_model().state_dict()

    def replica(rank: int) -> tuple[bool, list[torch.Tensor], list[torch.Tensor]]:
        manager = MockManager(ObjectStoreAllReduce(memory_uri, rank, 2, timeout=20))
        model = tiny_model(init)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        before = _params(model)
        with DiLoCo(manager, [model], inner, outer, sync_every=2, fragment_sync_delay=1) as diloco:
            for step in range(2):
                if rank == 1 and step == 1:
                    manager.report_error(RuntimeError("injected: loss became NaN"))
                x, y = _batch(rank, step)
                inner.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                inner.step()
            assert diloco is not None
        return manager.current_step() == 1, before, _params(model)

    results = run_replicas(replica, 2)
    for committed, before, after in results:
        assert not committed
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=False)), "no partial update anywhere"


class EagerMockManager(MockManager):
    """A MockManager whose allreduce runs its object-store round at once (waits on the Work)."""

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: ReduceOp.RedOpType = ReduceOp.AVG
    ) -> torch.distributed._Work:
        work = super().allreduce(tensor, should_quantize, reduce_op)
        work.wait()
        return work


def test_error_reported_after_the_allreduce_completed_vetoes_every_replica(
    memory_uri: str, run_replicas: RunReplicas, tiny_model: ModelFactory
) -> None:
    """Deterministic form of the test above: the pseudo-gradient allreduce has finished on every
    replica (eager rounds, then a barrier) before rank 1 reports its error during the overlapped
    inner step. ``should_commit()`` is a vote, so rank 0 must not commit either."""
    init = tiny_model().state_dict()
    allreduced = threading.Barrier(2, timeout=30)

    def replica(rank: int) -> tuple[int, list[torch.Tensor], list[torch.Tensor], list[bool]]:
        manager = EagerMockManager(ObjectStoreAllReduce(memory_uri, rank, 2, timeout=20))
        model = tiny_model(init)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        before = _params(model)
        with DiLoCo(manager, [model], inner, outer, sync_every=2, fragment_sync_delay=1):
            for step in range(2):
                if step == 1:
                    allreduced.wait()  # every round of this sync ran (step 0's post-hook prepared it)
                    assert manager.allreduce_backend.open_rounds, "the rounds wait for the vote"
                    if rank == 1:
                        manager.report_error(RuntimeError("injected: loss became NaN"))
                x, y = _batch(rank, step)
                inner.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                inner.step()
        backend = manager.allreduce_backend
        last = backend.read_decision(backend.round_id - 1)
        assert last is not None
        outcomes = [last.committed, backend.latest_committed_round() is not None]
        return manager.current_step(), before, _params(model), outcomes

    results = run_replicas(replica, 2)
    for step, before, after, outcomes in results:
        assert step == 0, "no replica may commit a sync another replica vetoed"
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "no partial update anywhere"
        assert not any(outcomes), "the store holds no committed round of the vetoed sync"


def test_should_commit_is_a_store_wide_vote(
    memory_uri: str, run_replicas: RunReplicas, read_record: Callable[[ObjectStoreAllReduce, str], dict[str, Any]]
) -> None:
    """torchft's call order without DiLoCo: allreduce, wait, then an error, then should_commit."""
    barrier = threading.Barrier(2, timeout=30)

    def replica(rank: int) -> list[bool]:
        manager = MockManager(ObjectStoreAllReduce(memory_uri, rank, 2, timeout=20))
        answers = []
        for sync in range(3):
            manager.start_quorum()
            t = torch.full((5,), float(rank + sync))
            assert manager.allreduce(t).wait() is True
            assert torch.equal(t, torch.full((5,), sync + 0.5))
            barrier.wait()  # both allreduces completed
            if sync == 1 and rank == 0:
                manager.report_error(RuntimeError("injected after the allreduce"))
            answers.append(manager.should_commit())
        return answers

    assert run_replicas(replica, 2) == [[True, False, True]] * 2
    ar = ObjectStoreAllReduce(memory_uri, 0, 2)
    decision = ar.read_decision(1)
    assert decision is not None
    assert decision.outcome == "abort"
    assert "injected after the allreduce" in decision.reason
    assert [read_record(ar, RoundKeys(1).vote(r))["ok"] for r in range(2)] == [False, True]


def test_too_few_participants_abort_in_the_store(memory_uri: str) -> None:
    """min_replica_size is part of the vote: the store records abort (so nobody heals towards a
    round whose state was never written)."""
    manager = MockManager(ObjectStoreAllReduce(memory_uri, 0, 2, timeout=5, quorum_timeout=0.3), min_replica_size=2)
    manager.start_quorum()
    assert manager.allreduce(torch.ones(3)).wait() is True
    assert manager.should_commit() is False
    assert manager.current_step() == 0
    decision = manager.allreduce_backend.read_decision(0)
    assert decision is not None
    assert decision.outcome == "abort"
    assert "min_replica_size=2" in decision.reason
    assert manager.allreduce_backend.latest_committed_round() is None


def test_wait_never_raises_and_should_commit_votes_false_on_store_failure(tmp_path: Any) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    ar = ObjectStoreAllReduce(str(tmp_path / "ok"), 0, 2, timeout=1)
    ar.store.uri = str(blocker)
    ar.store._root = str(blocker)  # every write now fails (a file sits where the prefix should be)
    manager = MockManager(ar)
    t = torch.ones(3)
    work = manager.allreduce(t)
    assert work.wait() is False
    assert manager.errored() is not None
    assert torch.equal(t, torch.ones(3))
    assert work.get_future().wait() is t
    assert manager.should_commit() is False
    assert manager.current_step() == 0


def test_mockmanager_validation(memory_uri: str) -> None:
    ar = ObjectStoreAllReduce(memory_uri, 0, 2)
    with pytest.raises(ValueError, match="use_async_quorum"):
        MockManager(ar, use_async_quorum=True)
    with pytest.raises(ValueError, match="min_replica_size"):
        MockManager(ar, min_replica_size=3)
    with pytest.raises(TypeError, match="ObjectStoreAllReduce"):
        MockManager("s3://bucket")  # type: ignore[arg-type]
    manager = MockManager(ar)
    with pytest.raises(ValueError, match="floating point"):
        manager.allreduce(torch.ones(2, dtype=torch.int64))
    manager.register_state_dict_fn("a", lambda s: None, dict)
    with pytest.raises(ValueError, match="already registered"):
        manager.register_state_dict_fn("a", lambda s: None, dict)
    with pytest.raises(KeyError, match="batches_committed"):
        manager.load_state_dict({"step": 1})
    assert manager._use_async_quorum is False  # DiLoCo raises ValueError on an async-quorum manager


def test_mockmanager_world_size_1_runs_diloco_without_io(
    monkeypatch: pytest.MonkeyPatch, tiny_model: ModelFactory
) -> None:
    import fsspec

    def no_io(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("world_size == 1 must not touch the store")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_io)
    manager = MockManager(ObjectStoreAllReduce("s3://never-touched/x", 0, 1))
    _train(manager, tiny_model(), 0, inner_steps=4, sync_every=2)
    assert manager.current_step() == 2
    assert manager.num_participants() == 1


def test_survivors_continue_and_restarted_replica_heals(
    memory_uri: str, run_replicas: RunReplicas, tiny_model: ModelFactory
) -> None:
    """Rank 2 dies after 2 outer rounds; ranks 0-1 go on with 2 participants; a fresh rank 2 (new random
    init) loads the last committed state from the store, rejoins, and ends bit-identical."""
    init = tiny_model().state_dict()
    world_size = 3
    rejoin = threading.Event()
    stop_at: list[int] = []  # set by rank 0 two rounds after the restarted replica took part

    def manager_for(rank: int) -> MockManager:
        return MockManager(ObjectStoreAllReduce(memory_uri, rank, world_size, timeout=10, quorum_timeout=1.5))

    def run(rank: int, manager: MockManager, model: nn.Module, until: Callable[[], bool]) -> list[int]:
        participants = []
        inner = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
        outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)
        step = 0
        with DiLoCo(manager, [model], inner, outer, sync_every=2):
            while not until():
                assert manager.current_step() < 40, "the run did not converge to a stop"
                before = manager.current_step()
                x, y = _batch(rank, step)
                inner.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                inner.step()
                step += 1
                if manager.current_step() != before:
                    participants.append(manager.num_participants())
                    if rank == 0 and manager.current_step() >= 3:
                        rejoin.set()
                        if 2 in participants and participants[-1] == 3 and not stop_at:
                            stop_at.append(manager.current_step() + 2)
        manager.shutdown()
        return participants

    def replica(rank: int) -> tuple[int, list[torch.Tensor], list[int], int]:
        model = tiny_model(init)
        manager = manager_for(rank)
        if rank == 2:
            run(rank, manager, model, lambda: manager.current_step() >= 2)  # then "dies"
            assert rejoin.wait(60)
            torch.manual_seed(1234)
            model = tiny_model()  # a restarted process: fresh weights, fresh manager
            manager = manager_for(rank)
        first = manager.current_step()
        participants = run(rank, manager, model, lambda: bool(stop_at) and manager.current_step() >= stop_at[0])
        return manager.current_step(), _params(model), participants, first

    results = run_replicas(replica, world_size, timeout=120)
    assert [r[0] for r in results] == [stop_at[0]] * world_size
    for r in range(1, world_size):
        assert all(torch.equal(a, b) for a, b in zip(results[r][1], results[0][1], strict=True)), f"rank {r} diverged"
    survivors = results[0][2]
    assert 2 in survivors, f"survivors continued with fewer participants: {survivors}"
    assert survivors[-1] == 3, f"the restarted replica rejoined as a participant: {survivors}"
    assert results[2][3] == 0  # the restarted manager started from scratch and healed
    assert results[2][2], "the restarted replica committed rounds after healing"


def test_mockmanager_matches_torchft_manager_with_lighthouse(
    memory_uri: str, run_replicas: RunReplicas, tiny_model: ModelFactory
) -> None:
    """The same DiLoCo run over MockManager and over torchft's Manager (Lighthouse + Gloo).

    Tolerance: rtol 1e-5, atol 1e-6 (fp32). Both average 2 replicas as (a + b) / 2 in fp32, so the
    runs are expected to agree to the last bit; the tolerance only allows for a Gloo reduction order.
    """
    import torch.distributed as dist
    from torchft._torchft import LighthouseServer
    from torchft.process_group import ProcessGroupGloo

    init = tiny_model().state_dict()
    world_size, inner_steps, sync_every = 2, 6, 2

    def mock_replica(rank: int) -> list[torch.Tensor]:
        manager = MockManager(ObjectStoreAllReduce(memory_uri, rank, world_size, timeout=20))
        model = _train(manager, tiny_model(init), rank, inner_steps, sync_every)
        assert manager.current_step() == inner_steps // sync_every
        return _params(model)

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world_size)

    def torchft_replica(rank: int) -> list[torch.Tensor]:
        model = tiny_model(init)
        store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
            min_replica_size=world_size,
            load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
            state_dict=lambda: {"model": model.state_dict()},
            replica_id=f"parity_{rank}",
            store_addr="localhost",
            store_port=store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse.address(),
            port=0,
            use_async_quorum=False,
            init_sync=False,  # replicas start identical; no step-0 heal from a peer's mid-round weights
            timeout=timedelta(seconds=20),
            quorum_timeout=timedelta(seconds=20),
            connect_timeout=timedelta(seconds=20),
        )
        try:
            _train(manager, model, rank, inner_steps, sync_every)
            assert manager.current_step() == inner_steps // sync_every
        finally:
            manager.shutdown(wait=False)
        return _params(model)

    try:
        theirs = run_replicas(torchft_replica, world_size, timeout=120)
    finally:
        lighthouse.shutdown()
    ours = run_replicas(mock_replica, world_size)
    for rank in range(world_size):
        for a, b in zip(ours[rank], theirs[rank], strict=False):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
