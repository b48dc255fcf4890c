"""Contribute and reduce-scatter: write this replica's payload; sum one shard over every participant's payload."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable
from functools import partial

import torch

from crf_diloco.errors import AllReduceError
from crf_diloco.payload import count_nonfinite, nonfinite_as_dtypes
from crf_diloco.rounds.peer import Peer
from crf_diloco.rounds.round import Round, RoundFailure, poll_until, why
from crf_diloco.wire import (
    Blob,
    Header,
    Prefetch,
    Scratch,
    check_payload_header,
    encode_reduced,
    payload_data_start,
    prefetch_payload_shard,
    read_header,
    read_payload_shard,
    read_reduced,
)

__all__ = ["blame", "contribute", "fetch_slices", "payload_header", "reduce_shard", "result_buffer"]

#: the reads of one shard's slices, by rank
Slices = dict[int, "concurrent.futures.Future[torch.Tensor]"]


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


def payload_header(peer: Peer, rnd: Round, rank: int) -> Header | None:
    """The authenticated header of ``rank``'s payload in this round attempt, ``None`` while it is absent;
    `RoundFailure` for an object of another attempt, `CorruptObjectError` for a malformed one."""
    quorum, keys = rnd.formed, rnd.keys
    key = keys.data(rank)
    try:
        header = read_header(peer.store, key, peer.auth, payload_data_start(quorum.plan))
    except FileNotFoundError:
        return None
    if header.metadata.get("token") != quorum.token:
        raise RoundFailure(f"{key} belongs to another round attempt (stale object)")
    check_payload_header(header, quorum.plan, rank=str(rank), round=str(keys.round_id))
    return header


def fetch_slices(peer: Peer, rnd: Round, shard: int, ranks: list[int], first_into: torch.Tensor | None) -> Slices:
    """Start reading slice ``shard`` of each of ``ranks``' payloads as soon as it appears; returns the reads (one
    future per rank) once every payload is there.

    All payloads are polled at once, with the round's decision beside them: `RoundFailure` when the data deadline
    passes first. Over a network each poll also reads the slice where this version's writer puts it
    (`crf_diloco.wire.prefetch_payload_shard`), so header and slice take one round trip; the bytes count only once
    the authenticated header puts them there and their tag verifies. ``first_into``: where the first rank's fp32
    slice lands (the result buffer), to save a copy."""
    plan, keys, settings = rnd.plan, rnd.keys, rnd.settings
    speculate = peer.store.remote  # a local read costs no round trip: read once the header is known
    reads: Slices = {}
    kept: dict[int, Prefetch] = {}

    def where(rank: int) -> tuple[Scratch, torch.Tensor | None]:
        return peer.scratch_for(f"slice-{rank}"), first_into if rank == ranks[0] else None

    def read_slice(rank: int, header: Header, prefetched: Prefetch | None) -> torch.Tensor:
        scratch, out = where(rank)
        return read_payload_shard(peer.store, header, peer.auth, plan, shard, scratch, out=out, prefetched=prefetched,
                                  run=peer.concurrently)  # fmt: skip

    def probe(late: bool) -> Slices | None:
        missing = [r for r in ranks if r not in reads]
        calls: list[Callable[[], object]] = [partial(payload_header, peer, rnd, r) for r in missing]
        spans: dict[int, tuple[int, int, Prefetch]] = {}  # a rank's prefetch calls' positions in `calls`
        for r in missing if speculate else []:
            if r not in kept:
                fills, prefetched = prefetch_payload_shard(peer.store, keys.data(r), plan, shard, *where(r))
                spans[r] = (len(calls), len(calls) + len(fills), prefetched)
                calls += fills
        due = [partial(_check_decided, peer, rnd)] if rnd.decisions.due(late) else []
        found = peer.outcomes([*calls, *due])
        decided = found.pop() if due else None
        for r, (first, last, prefetched) in spans.items():
            if all(ok is True for ok in found[first:last]):  # objects are never rewritten: bytes read stay theirs
                kept[r] = prefetched
        for r, header in zip(missing, found, strict=False):
            if isinstance(header, BaseException):
                raise header
            if header is not None:
                reads[r] = peer.read(read_slice, r, header, kept.get(r))
        if len(reads) < len(ranks) and isinstance(decided, BaseException):
            raise decided  # the round ended while a payload is missing
        if len(reads) == len(ranks):
            return reads
        rnd.check_writes()
        if late:
            key = keys.data(min(set(ranks) - set(reads)))
            raise RoundFailure(f"{key} did not appear within {settings.timeout:.1f}s")
        return None

    if not ranks:
        return reads
    try:
        return poll_until(rnd.deadline, probe, interval=settings.poll_interval)
    except BaseException:
        concurrent.futures.wait(reads.values())  # nothing reads into this replica's buffers once it gives up
        raise


def _check_decided(peer: Peer, rnd: Round) -> None:
    peer.check_decided(rnd.keys, rnd.settings.keep_rounds)


def reduce_shard(
    peer: Peer, rnd: Round, shard: int, own: torch.Tensor | None, feedback: torch.Tensor | None = None
) -> None:
    """Sum shard ``shard`` over all participants in order into the result buffer and create its object.

    The slices of the other participants are read at once; the sum runs in participant order (so any replica
    computing this shard gets the same bits). ``own``: what the others decode from this replica's payload when it is
    a participant. ``feedback``: the shard owner's staged residual (error-feedback
    codecs); the broadcast leg's loss (the exact reduction minus what its codec delivers, in sum units: times the
    participants for ``avg``) is added to it over the shard's elements, so the next round's contribution of the
    owner carries it."""
    quorum, keys = rnd.formed, rnd.keys
    plan, participants, token = quorum.plan, quorum.participants, quorum.token
    lo, hi = plan.elem_range(shard)
    acc = result_buffer(peer.scratch, plan.numel)[lo:hi]
    ranks = [r for r in participants if not (r == peer.rank and own is not None)]
    into = acc if ranks and ranks[0] == participants[0] else None
    reads = fetch_slices(peer, rnd, shard, ranks, into)
    try:
        for i, r in enumerate(participants):
            if r == peer.rank and own is not None:
                values = own[lo:hi]  # exactly what others decode from our object
            else:
                values = reads[r].result()
            if i == 0:
                if values.data_ptr() != acc.data_ptr():
                    acc.copy_(values)
            else:
                acc.add_(values)
    finally:
        concurrent.futures.wait(reads.values())
    if quorum.spec.op == "avg":
        acc /= len(participants)
    if count_nonfinite(acc):
        raise RoundFailure(blame(peer, rnd, shard, own))
    key = keys.reduced(shard)
    meta = {"token": token, "round": str(keys.round_id), "contributors": json.dumps(list(participants))}
    blob, decoded = encode_reduced(key, peer.auth, acc, plan, shard, meta)
    same = decoded.data_ptr() == acc.data_ptr() and not quorum.spec.dtypes  # fp32 both ways: checked above
    overflow = {} if same else nonfinite_as_dtypes(decoded, lo, quorum.spec.dtypes)
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
                values = own[lo:hi]
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
