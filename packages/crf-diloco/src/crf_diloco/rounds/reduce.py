"""Contribute and reduce-scatter: write this replica's payload; sum one shard over every participant's payload."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from crf_diloco.errors import AllReduceError
from crf_diloco.payload import count_nonfinite, nonfinite_as_dtypes
from crf_diloco.rounds.peer import Peer
from crf_diloco.rounds.round import Round, RoundFailure, poll_until, why
from crf_diloco.wire import (
    Blob,
    Header,
    Scratch,
    check_payload_header,
    encode_reduced,
    header_probe,
    read_header,
    read_payload_shard,
    read_reduced,
    wire_roundtrip,
)

__all__ = ["await_payload", "blame", "contribute", "reduce_shard", "result_buffer"]


def result_buffer(scratch: Scratch, numel: int) -> torch.Tensor:
    """The round's result buffer (fp32, ``numel``), reused across rounds."""
    return scratch.get("result", 4 * numel).view(torch.float32)


def contribute(peer: Peer, rnd: Round, blob: Blob) -> None:
    """Create this replica's payload ``data/{rank}.safetensors`` in the background (an object already there must be
    this round attempt's: a retried write)."""
    key, token = rnd.keys.data(peer.rank), rnd.formed.token

    def create() -> None:
        if not peer.store.put_create(key, blob):
            header = read_header(peer.store, key, peer.auth)
            if header.metadata.get("token") != token:
                raise RoundFailure(f"{key} exists from another round attempt")

    rnd.pending.append(peer.submit(create))


def await_payload(peer: Peer, rnd: Round, rank: int) -> Header:
    """The authenticated header of ``rank``'s payload in this round attempt, polled until the data deadline."""
    quorum, keys = rnd.formed, rnd.keys
    key = keys.data(rank)

    def probe(late: bool) -> Header | None:
        try:
            header = read_header(peer.store, key, peer.auth, header_probe(len(quorum.participants)))
        except FileNotFoundError:
            header = None
        if header is not None:
            if header.metadata.get("token") != quorum.token:
                raise RoundFailure(f"{key} belongs to another round attempt (stale object)")
            check_payload_header(header, quorum.plan, rank=str(rank), round=str(keys.round_id))
            return header
        peer.check_decided(keys, rnd.settings.keep_rounds)
        rnd.check_writes()
        if late:
            raise RoundFailure(f"{key} did not appear within {rnd.settings.timeout:.1f}s")
        return None

    return poll_until(rnd.deadline, probe, interval=rnd.settings.poll_interval)


def reduce_shard(
    peer: Peer, rnd: Round, shard: int, own: torch.Tensor | None, feedback: torch.Tensor | None = None
) -> None:
    """Sum shard ``shard`` over all participants in order into the result buffer and create its object.

    ``own``: this replica's flat contribution when it is a participant (its slice is taken as others decode it).
    ``feedback``: the shard owner's staged residual (error-feedback codecs); the broadcast leg's loss (the exact
    reduction minus what its codec delivers, in sum units: times the participants for ``avg``) is added to it over
    the shard's elements, so the next round's contribution of the owner carries it."""
    quorum, keys = rnd.formed, rnd.keys
    plan, participants, token = quorum.plan, quorum.participants, quorum.token
    lo, hi = plan.elem_range(shard)
    acc = result_buffer(peer.scratch, plan.numel)[lo:hi]
    for i, r in enumerate(participants):
        if r == peer.rank and own is not None:
            values = wire_roundtrip(own[lo:hi], plan.codec)  # exactly what others decode from our object
        else:
            header = await_payload(peer, rnd, r)
            out = acc if i == 0 else None
            values = read_payload_shard(peer.store, header, peer.auth, plan, shard, peer.scratch, out=out)
        if i == 0:
            if values.data_ptr() != acc.data_ptr():
                acc.copy_(values)
        else:
            acc.add_(values)
    if quorum.spec.op == "avg":
        acc /= len(participants)
    if count_nonfinite(acc):
        raise RoundFailure(blame(peer, rnd, shard, own))
    key = keys.reduced(shard)
    meta = {"token": token, "round": str(keys.round_id), "contributors": json.dumps(list(participants))}
    blob, decoded = encode_reduced(key, peer.auth, acc, plan, shard, meta)
    overflow = nonfinite_as_dtypes(decoded, lo, quorum.spec.dtypes)
    if overflow:
        what = ", ".join(f"{n} in {dtype}" for dtype, n in sorted(overflow.items()))
        raise RoundFailure(f"shard {shard} of round {keys.round_id}: the reduced values overflow their dtype ({what})")
    if feedback is not None:
        lost = acc - decoded
        if quorum.spec.op == "avg":
            lost *= len(participants)
        feedback[lo:hi] += lost
        if count_nonfinite(feedback[lo:hi]):
            raise RoundFailure(f"rank {peer.rank}: the error-feedback residual of shard {shard} is not finite")
    if decoded.data_ptr() != acc.data_ptr():
        acc.copy_(decoded)
    rnd.pending.append(peer.submit(_create_reduced, peer, key, blob, _same_values(peer, rnd, shard, acc)))


def _create_reduced(peer: Peer, key: str, blob: Blob, check: Callable[[], None]) -> None:
    """(Background) create a reduced shard; if one is already there, ``check`` that it holds our values."""
    if not peer.store.put_create(key, blob):
        check()


def _same_values(peer: Peer, rnd: Round, shard: int, acc: torch.Tensor) -> Callable[[], None]:
    """A check that the reduced shard already in the store holds exactly ``acc`` (a duplicate must be identical)."""
    plan, token, key = rnd.plan, rnd.formed.token, rnd.keys.reduced(shard)

    def check() -> None:
        theirs = torch.empty_like(acc)
        read_reduced(peer.store, key, peer.auth, plan, shard, theirs, Scratch(), token=token)
        if not torch.equal(theirs, acc):
            raise RoundFailure(f"{key} already exists with other values than this replica's reduction")

    return check


def blame(peer: Peer, rnd: Round, shard: int, own: torch.Tensor | None) -> str:
    """Why shard ``shard`` is not finite: the ranks whose slices hold NaN/inf, or an fp32 overflow."""
    plan, keys = rnd.plan, rnd.keys
    lo, hi = plan.elem_range(shard)
    culprits = []
    for r in rnd.participants:
        try:
            if r == peer.rank and own is not None:
                values = wire_roundtrip(own[lo:hi], plan.codec)
            else:
                header = read_header(peer.store, keys.data(r), peer.auth)
                values = read_payload_shard(peer.store, header, peer.auth, plan, shard, peer.scratch)
        except (OSError, AllReduceError) as exc:
            culprits.append(f"rank {r}'s slice could not be read again ({why(exc)})")
            continue
        bad = count_nonfinite(values.float())
        if bad:
            culprits.append(f"rank {r} contributed {bad} NaN/inf value(s) to shard {shard}")
    return "; ".join(culprits) or f"shard {shard} of round {keys.round_id} overflows fp32"
