"""All-gather: read every reduced shard into the result buffer, covering a straggling shard owner."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial

import torch

from crf_diloco.rounds.peer import Peer
from crf_diloco.rounds.reduce import result_buffer
from crf_diloco.rounds.round import Round, RoundFailure, poll_until
from crf_diloco.wire import read_reduced

__all__ = ["gather"]


def gather(peer: Peer, rnd: Round, done: set[int], cover: Callable[[int], None] | None) -> torch.Tensor:
    """Read every reduced shard not in ``done`` into the result buffer and return it.

    Every missing shard is read at once, with the round's decision beside them when due (`Round.decisions`; one
    round trip per poll over a network). ``cover(shard)`` computes and creates a missing shard; it is called for the
    lowest missing one once ``straggler_grace`` seconds of the data phase passed (``None``: never cover, e.g. a
    replica following a commit).
    Raises when the round was decided meanwhile, one of this round's writes failed, a shard is corrupt, or the data
    deadline passed with shards missing (`RoundFailure`)."""
    quorum, keys = rnd.formed, rnd.keys
    plan, token = quorum.plan, quorum.token
    result = result_buffer(peer.scratch, plan.numel)
    contributors = json.dumps(list(quorum.participants))
    done = set(done)

    def read(k: int) -> bool:
        lo, hi = plan.elem_range(k)
        try:
            read_reduced(peer.store, keys.reduced(k), peer.auth, plan, k, result[lo:hi], peer.scratch_for(f"shard-{k}"),
                         token=token, round=str(keys.round_id), contributors=contributors)  # fmt: skip
        except FileNotFoundError:
            return False
        return True

    def check_decided() -> bool:
        peer.check_decided(keys, rnd.settings.keep_rounds)
        return False

    def probe(late: bool) -> torch.Tensor | None:
        missing = [k for k in range(plan.n_shards) if k not in done]
        due = [check_decided] if rnd.decisions.due(late) else []
        found = peer.outcomes([*(partial(read, k) for k in missing), *due])
        decided = found.pop() if due else None
        for k, ok in zip(missing, found, strict=True):
            if isinstance(ok, BaseException):
                raise ok
            if ok:
                done.add(k)
        if len(done) == plan.n_shards:
            return result
        if isinstance(decided, BaseException):
            raise decided  # the round ended while a shard is missing
        rnd.check_writes()
        if late:
            missing = sorted(set(range(plan.n_shards)) - done)
            raise RoundFailure(f"reduced shards {missing} did not appear within {rnd.settings.timeout:.1f}s")
        if cover is not None and time.monotonic() - rnd.started > rnd.settings.straggler_grace:
            k = min(set(range(plan.n_shards)) - done)
            cover(k)
            done.add(k)
            return result if len(done) == plan.n_shards else None
        return None

    if len(done) == plan.n_shards:
        return result
    return poll_until(rnd.deadline, probe, interval=rnd.settings.poll_interval)
