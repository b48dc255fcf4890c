"""``MockManager(vote_scope="replica")``: torchft's own ``should_commit`` scope (a replica decides for itself).

torchft's ``Manager.should_commit`` is a collective within one replica group ("different replica groups may return
different values"); a group that did not commit is behind and recovers from an up-to-date one at its next quorum.
``vote_scope="replica"`` does the same over the store: the rounds decide themselves, ``should_commit()`` sends no
request (no barrier while training waits), and a replica that votes False on a committed round heals from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from state_tensors import nested_tensors
from torch import nn
from torchft.local_sgd import DiLoCo

from crf_diloco import MockManager, ObjectStoreAllReduce

RunReplicas = Callable[..., list[Any]]


def _refuse_vote(manager: MockManager) -> None:
    """Make any store-wide vote of ``manager`` fail the test."""

    def vote(ok: bool, reason: str = "") -> bool:
        pytest.fail("vote_scope='replica' must not vote through the store")

    manager.allreduce_backend.vote = vote  # type: ignore[method-assign]


def test_streaming_diloco_with_replica_scope_never_votes_through_the_store_and_ends_bit_identical(
    memory_uri: str, run_replicas: RunReplicas
) -> None:
    """Real torchft Streaming DiLoCo (2 fragments, ``fragment_sync_delay``, overlapped rounds): every sync commits
    without a vote through the store, the replicas end bit-identical, and on exactly the bits of the same run with the
    store-wide vote (the scopes differ only when a replica errs)."""
    torch.manual_seed(0)
    init = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).state_dict()

    def replica(rank: int, scope: str = "replica", uri: str = memory_uri) -> tuple[int, list[torch.Tensor], list[bool]]:
        manager = MockManager(ObjectStoreAllReduce(uri, rank, 2, timeout=20), vote_scope=scope)  # type: ignore[arg-type]
        if scope == "replica":
            _refuse_vote(manager)
        should_commit, answers = manager.should_commit, []

        def checked(timeout: Any = None) -> bool:
            answer = should_commit(timeout)
            answers.append(answer)
            return answer

        manager.should_commit = checked  # type: ignore[method-assign]
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        model.load_state_dict(init)
        inner = torch.optim.AdamW(model.parameters(), lr=4e-3)
        outer = [torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True) for m in (model[0], model[2])]
        g = torch.Generator().manual_seed(rank)
        with DiLoCo(manager, [model[0], model[2]], inner, outer, sync_every=6, fragment_sync_delay=2):
            for _ in range(12):
                inner.zero_grad()
                nn.functional.mse_loss(model(torch.randn(8, 6, generator=g)), torch.randn(8, 3, generator=g)).backward()
                inner.step()
            manager.shutdown()
            # what replicas share under Streaming DiLoCo: each fragment's global weights and outer-optimizer state
            shared = nested_tensors({key: save() for key, save in manager._save_fns.items()})
        return manager.current_step(), shared, answers

    (step0, shared0, answers0), (step1, shared1, answers1) = run_replicas(replica, 2)
    assert step0 == step1 == len(answers0) == len(answers1) == 4
    assert all(answers0 + answers1)
    assert len(shared0) == len(shared1) > 0
    assert all(torch.equal(a, b) for a, b in zip(shared0, shared1, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(shared0, init.values(), strict=False)), "training moved them"
    voted = run_replicas(lambda rank: replica(rank, "run", f"{memory_uri}/voted"), 2)
    assert all(torch.equal(a, b) for a, b in zip(shared0, voted[0][1], strict=True)), "the same bits as the vote's"


def test_an_error_after_the_allreduce_aborts_only_its_replica_which_heals_at_its_next_quorum(
    memory_uri: str, run_replicas: RunReplicas
) -> None:
    """torchft's call order (allreduce, wait, an error, should_commit): the replica that reported the error answers
    False, the other commits (the store decided the round), and at the next ``start_quorum()`` the first loads the
    committed state, so both end on the same weights and step."""
    barrier = threading.Barrier(2, timeout=30)

    def replica(rank: int) -> tuple[list[bool], int, torch.Tensor]:
        manager = MockManager(ObjectStoreAllReduce(memory_uri, rank, 2, timeout=20), vote_scope="replica")
        _refuse_vote(manager)
        w = {"w": torch.zeros(5)}
        manager.register_state_dict_fn("w", lambda s: w.update(w=s["w"].clone()), lambda: {"w": w["w"].clone()})
        answers = []
        for sync in range(3):
            manager.start_quorum()
            t = w["w"] + rank + 1.0 + sync
            assert manager.allreduce(t).wait() is True
            barrier.wait()  # both allreduces completed
            if sync == 1 and rank == 0:  # round 1's checkpoint is rank 1's to write (participants[1 % 2])
                manager.report_error(RuntimeError("injected after the allreduce"))
            answers.append(manager.should_commit())
            if answers[-1]:
                w["w"] = t
        manager.shutdown()
        return answers, manager.current_step(), w["w"]

    (answers0, step0, w0), (answers1, step1, w1) = run_replicas(replica, 2)
    assert answers0 == [True, False, True]
    assert answers1 == [True, True, True]
    assert step0 == step1 == 3
    assert torch.equal(w0, w1)
    decision = ObjectStoreAllReduce(memory_uri, 0, 2).read_decision(1)
    assert decision is not None
    assert decision.committed, "the store committed round 1: only rank 0 did not apply it"


def test_a_veto_before_the_round_still_aborts_it_everywhere(memory_uri: str, run_replicas: RunReplicas) -> None:
    """An error reported before a replica's round ran vetoes that round in the store in both scopes: nobody
    commits it."""

    def replica(rank: int) -> bool:
        manager = MockManager(ObjectStoreAllReduce(memory_uri, rank, 2, timeout=20), vote_scope="replica")
        manager.start_quorum()
        work = manager.allreduce(torch.full((3,), float(rank)))
        if rank == 1:
            manager.report_error(RuntimeError("injected before the round"))
        work.wait()
        return manager.should_commit()

    assert run_replicas(replica, 2) == [False, False]
    decision = ObjectStoreAllReduce(memory_uri, 0, 2).read_decision(0)
    assert decision is not None
    assert decision.outcome == "abort"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vote_scope": "group"}, r"vote_scope must be 'run' .* or 'replica' .*got 'group'"),
        ({"vote_scope": None}, r"vote_scope must be 'run'"),
        ({"vote_scope": "replica", "min_replica_size": 2}, r"ObjectStoreAllReduce\(min_participants=2\)"),
    ],
)
def test_bad_vote_scopes_are_refused(memory_uri: str, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MockManager(ObjectStoreAllReduce(memory_uri, 0, 2), **kwargs)


def test_replica_scope_with_min_participants_aborts_a_round_with_too_few_in_the_store(memory_uri: str) -> None:
    """``min_replica_size`` in the replica scope: the allreduce's ``min_participants`` aborts the lone round in the
    store, so no replica later heals towards a round whose state was never written."""
    ar = ObjectStoreAllReduce(memory_uri, 0, 2, timeout=5, quorum_timeout=0.3, min_participants=2)
    manager = MockManager(ar, min_replica_size=2, vote_scope="replica")
    manager.start_quorum()
    assert manager.allreduce(torch.ones(3)).wait() is False
    assert manager.should_commit() is False
    assert manager.current_step() == 0
    decision = ar.read_decision(0)
    assert decision is not None
    assert decision.outcome == "abort"
    assert ar.latest_committed_round() is None
