"""MockManager's asynchronous work: Streaming DiLoCo (real ``torchft.local_sgd.DiLoCo``, several fragments,
``fragment_sync_delay``) keeps training while a fragment syncs, and ends exactly where a synchronous run ends.

Overlap is proven without timing: each replica's payload write is held (a fault rule on the store) until its
training loop has run a step's forward and backward pass while that round was held; a manager that ran rounds
inside ``wait()`` (or inside any call of the training thread) would hold the loop itself, and the hold gives up
(failing the test) after a bounded wait.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from state_tensors import nested_tensors
from torch import nn
from torchft.local_sgd import DiLoCo

from crf_diloco import MockManager, ObjectStoreAllReduce, SyncRecord

RunReplicas = Callable[..., list[Any]]
WORLD, FRAGMENTS, SYNC_EVERY, DELAY, STEPS = (
    3,
    2,
    8,
    2,
    24,
)  # a fragment prepared at local step 2, started at 3, synced at 4
# (with fragments, a replica's parameters hold the local steps since each fragment's last sync: what every replica
# shares is each fragment's global state, DiLoCo's backup weights and outer-optimizer state, as torchft's tests check)
HOLD = 60.0  # seconds a held payload write waits for its overlapped step before the test fails


def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).state_dict()


INITIAL = _initial()  # built once: replica threads drawing from torch's global generator at once would interleave


def _model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    model.load_state_dict(INITIAL)
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(104729 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


Run = tuple[int, list[torch.Tensor], list[torch.Tensor]]  # committed syncs, model parameters, global state


Hook = Callable[[MockManager], None]


def _train(
    manager: MockManager, rank: int, after_backward: Hook = lambda m: None, after_step: Hook = lambda m: None
) -> Run:
    """Streaming DiLoCo, two fragments; returns the committed syncs, the replica's parameters and the global state
    (each fragment's last global weights and outer-optimizer state, which every replica must share). The hooks run
    after each backward pass (the step's computation) and after each optimizer step."""
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.1, betas=(0.9, 0.95))
    parts = [model[0], model[2]]
    outer = [torch.optim.SGD(p.parameters(), lr=0.7, momentum=0.9, nesterov=True) for p in parts]
    with DiLoCo(manager, parts, inner, outer, sync_every=SYNC_EVERY, fragment_sync_delay=DELAY):
        for step in range(STEPS):
            x, y = _batch(rank, step)
            inner.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            after_backward(manager)
            inner.step()
            after_step(manager)
        manager.shutdown()
        shared = nested_tensors({key: save() for key, save in manager._save_fns.items()})
    return manager.current_step(), [p.detach().clone() for p in model.parameters()], shared


def test_streaming_diloco_trains_while_a_fragment_syncs_and_ends_bit_identical(
    faulty_store: Any, fault_rule: Callable[..., dict[str, Any]], run_replicas: RunReplicas, memory_uri: str
) -> None:
    syncs = STEPS // (SYNC_EVERY // FRAGMENTS)
    done = [0] * WORLD  # backward passes finished, per rank
    held = [threading.Event() for _ in range(WORLD)]  # a round of the rank is held in its payload write
    overlapped = [0] * WORLD  # rounds held until a backward pass finished meanwhile
    syncing = [False] * WORLD  # what the training loop saw after its last step
    progress = threading.Condition()

    def hold(path: str) -> None:  # runs on the manager's background thread, inside the round's payload write
        rank = int(re.search(r"/data/(\d+)\.safetensors", path).group(1))  # type: ignore[union-attr]
        with progress:
            seen = done[rank]
            held[rank].set()
            moved = progress.wait_for(lambda: done[rank] > seen, HOLD)
            held[rank].clear()
        assert moved, f"rank {rank}: no training step ran while its round was held (no overlap)"
        overlapped[rank] += 1

    rule = fault_rule("write", lambda p: "/data/" in p, hold, count=WORLD * syncs)

    def after_backward(manager: MockManager) -> None:
        with progress:
            done[manager.rank] += 1
            progress.notify_all()

    def after_step(manager: MockManager) -> None:
        manager.current_step()  # DiLoCo's next call to the manager: queued rounds start in the background
        started = manager.syncing and not syncing[manager.rank]
        syncing[manager.rank] = manager.syncing
        if started:  # a round is in flight: let it reach its payload write before training on
            assert held[manager.rank].wait(HOLD), "the background round never reached its payload write"

    def overlapping(rank: int) -> Run:
        ar = ObjectStoreAllReduce("crffaulty://overlap", rank, WORLD, timeout=HOLD + 30)
        return _train(MockManager(ar), rank, after_backward, after_step)

    def synchronous(rank: int) -> Run:
        return _train(MockManager(ObjectStoreAllReduce(memory_uri, rank, WORLD, timeout=60), overlap=False), rank)

    ran = run_replicas(overlapping, WORLD, timeout=HOLD * syncs)
    assert rule["fired"] == WORLD * syncs, "every sync's payload write was held until a step overlapped it"
    assert overlapped == [syncs] * WORLD, overlapped
    reference = run_replicas(synchronous, WORLD, timeout=300)
    initial = [p.detach() for p in _model().parameters()]
    for (steps, params, shared), (ref_steps, ref_params, ref_shared) in zip(ran, reference, strict=True):
        assert steps == ref_steps == syncs, "every fragment sync committed"
        assert len(shared) == len(ran[0][2]) > 0
        for mine, first in zip(shared, ran[0][2], strict=True):
            assert torch.equal(mine, first), "replicas end bit-identical (every fragment's global state)"
        for mine, ref in zip([*params, *shared], [*ref_params, *ref_shared], strict=True):
            assert torch.equal(mine, ref), "overlapping changes nothing: the synchronous run ends on the same bits"
        assert not any(torch.equal(p, init) for p, init in zip(params, initial, strict=True)), "training moved them"


def test_a_round_never_waits_behind_a_checkpoint_upload(
    faulty_store: Any, fault_rule: Callable[..., dict[str, Any]], run_replicas: RunReplicas
) -> None:
    """Each checkpoint upload is held until its writer has committed the next sync (or finished training): rounds
    queued behind the upload on one thread could never commit that sync, and the hold gives up (failing the test).
    The held states still land (``shutdown`` waits for the uploads) and the replicas end bit-identical."""
    committed = [0] * WORLD  # syncs committed, per rank, as the training loop saw them
    finished = [False] * WORLD
    overtaken: list[str] = []  # uploads held while a later sync of their writer committed
    progress = threading.Condition()

    def hold(path: str) -> None:  # on the writer's upload thread, at the checkpoint's manifest (after its parts)
        round_id = int(re.search(r"state/r(\d+)\.", path).group(1))  # type: ignore[union-attr]
        rank = round_id % WORLD  # the writer rotates: participants[round % participants]
        with progress:
            seen = committed[rank]
            moved = progress.wait_for(lambda: committed[rank] > seen or finished[rank], HOLD)
            assert moved, f"rank {rank}: no sync committed while its checkpoint upload was held"
            if committed[rank] > seen:
                overtaken.append(path)

    rule = fault_rule("write", lambda p: re.search(r"/state/r\d+\.", p) is not None, hold, count=10_000)

    def after_step(manager: MockManager) -> None:
        with progress:
            committed[manager.rank] = manager.current_step()
            progress.notify_all()

    def replica(rank: int) -> tuple[Run, list[int | None]]:
        ar = ObjectStoreAllReduce("crffaulty://uploads", rank, WORLD, timeout=HOLD + 30)
        manager = MockManager(ar)
        original = manager.shutdown

        def shutdown(wait: bool = True) -> None:  # training is over: release the last held upload
            with progress:
                finished[rank] = True
                progress.notify_all()
            original(wait)

        manager.shutdown = shutdown  # type: ignore[method-assign]
        run = _train(manager, rank, after_step=after_step)
        return run, [s.round_id for s in manager.syncs]

    ran = run_replicas(replica, WORLD, timeout=HOLD * 4)
    assert rule["fired"] >= 2, "checkpoints were uploaded (and held)"
    assert len(overtaken) >= rule["fired"] - WORLD, f"syncs committed while uploads were held: {overtaken}"
    (steps, _, shared), rounds = ran[0]
    assert steps == STEPS // (SYNC_EVERY // FRAGMENTS), "every sync committed"
    states = ObjectStoreAllReduce("crffaulty://uploads", 0, WORLD).snapshots().listed()
    assert states, "the held uploads landed"
    assert states[-1] == rounds[-1], f"the last committed round's state landed: {states}"
    for (other_steps, _, other_shared), _ in ran[1:]:
        assert other_steps == steps
        assert all(torch.equal(a, b) for a, b in zip(shared, other_shared, strict=True)), "bit-identical"


def test_a_checkpoint_uploads_from_the_call_after_the_outer_step_not_the_next_sync(
    faulty_store: Any, fault_rule: Callable[..., dict[str, Any]], run_replicas: RunReplicas
) -> None:
    """The writer of a committed round's state starts uploading it at its first call after the outer step (DiLoCo's
    next inner step), so the upload has the replica's link in the gap before the next sync's round instead of
    sharing it with that round from ``start_quorum`` on."""
    uploading = threading.Event()
    rule = fault_rule("write", lambda p: "/state/" in p, lambda p: uploading.set(), count=10_000)

    def replica(rank: int) -> bool:
        manager = MockManager(ObjectStoreAllReduce("crffaulty://early", rank, 2, timeout=30))
        manager.register_state_dict_fn("w", lambda s: None, lambda: {"w": torch.full((3,), float(rank))})
        manager.start_quorum()
        assert manager.allreduce(torch.ones(3)).wait()
        assert manager.should_commit()
        manager.disallow_state_dict_read()  # the next inner step: round 0's writer (rank 0) copies its state
        started = uploading.wait(30) if rank == 0 else True  # before any start_quorum of the next sync
        manager.shutdown()
        return started

    assert run_replicas(replica, 2) == [True, True]
    assert rule["fired"] >= 1


def test_work_of_a_failed_background_round_returns_false_and_the_sync_aborts_everywhere(
    faulty_store: Any, fault_rule: Callable[..., dict[str, Any]], run_replicas: RunReplicas
) -> None:
    """Rank 1's payload write of round 0 fails (it is a participant: its payload is missing): its ``wait()`` returns
    False without raising, the future still completes (``.then`` runs) and every replica's ``should_commit()``
    answers False (one decision); the next sync commits everywhere."""
    fault_rule("write", lambda p: "r00000000/data/1." in p, "oserror", count=10_000)

    def replica(rank: int) -> tuple[bool, list[str], bool, bool, tuple[SyncRecord, ...], int]:
        ar = ObjectStoreAllReduce("crffaulty://fails", rank, 2, timeout=20, quorum_timeout=20, retries=0)
        manager = MockManager(ar)
        seen: list[str] = []
        t = torch.full((4,), float(rank))
        manager.start_quorum()
        work = manager.allreduce(t)
        work.get_future().then(lambda f: seen.append(f"done {float(f.value()[0])}"))
        manager.current_step()  # DiLoCo's next call: the round starts in the background
        ok = work.wait()
        first = manager.should_commit()
        manager.start_quorum()
        work = manager.allreduce(torch.full((4,), float(rank)))
        work.wait()
        second = manager.should_commit()
        manager.shutdown()
        return ok, seen, first, second, manager.syncs, ar.bytes_written

    results = run_replicas(replica, 2, timeout=120)
    assert results[1][0] is False, "the failed round's work says so, without raising"
    assert [r[2] for r in results] == [False, False], "one decision: the sync aborts on every replica"
    assert [r[3] for r in results] == [True, True], "the next sync commits"
    assert all(len(r[1]) == 1 for r in results), "every future completed once and ran its .then callback"
    assert results[1][1] == ["done 1.0"], "a failed round leaves the tensor unchanged"
    for *_, syncs, written in results:  # each sync's record: its outcome, time and store traffic
        assert [s.committed for s in syncs] == [False, True]
        assert syncs[1].round_id is not None
        assert syncs[1].round_id > (syncs[0].round_id or 0)
        assert all(s.seconds > 0 and s.traffic.busy_round_trips >= 1 for s in syncs)
        assert syncs[1].traffic.bytes_written >= 4 * 4  # its payload, at least
        assert sum(s.traffic.bytes_written for s in syncs) <= written


def test_overlap_must_be_a_bool(memory_uri: str) -> None:
    with pytest.raises(TypeError, match="overlap must be a bool"):
        MockManager(ObjectStoreAllReduce(memory_uri, 0, 2), overlap="yes")  # type: ignore[arg-type]
