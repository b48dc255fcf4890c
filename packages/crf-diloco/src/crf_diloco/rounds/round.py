"""One round as a typed record, the failure its phases raise, and the one polling loop every wait uses."""

from __future__ import annotations

import concurrent.futures
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from crf_diloco.errors import AllReduceError
from crf_diloco.layout import RoundKeys
from crf_diloco.records import PayloadSpec, QuorumRecord
from crf_diloco.wire import ShardPlan

__all__ = ["DecisionChecks", "Round", "RoundFailure", "RoundSettings", "poll_until", "why"]

T = TypeVar("T")
Pending = list["concurrent.futures.Future[None]"]


DECISION_GAP = 0.25
"""Seconds between two reads of a round's decision while its quorum or data phase waits (`DecisionChecks`)."""


@dataclass
class DecisionChecks:
    """When a wait reads its round's decision beside what it waits for: at most every `DECISION_GAP` seconds after
    ``last`` (a `time.monotonic` value), and always once ``late``. A healthy round's objects arrive sooner, so most
    polls send no decision read (each a request the bucket serves and bills, and the client pays a few ms of CPU
    for); a round decided meanwhile is noticed within the gap."""

    last: float = -math.inf

    def due(self, late: bool) -> bool:
        """Whether this poll reads the decision (then counted as read now)."""
        now = time.monotonic()
        if late or now - self.last >= DECISION_GAP:
            self.last = now
            return True
        return False


@dataclass(frozen=True)
class RoundSettings:
    """The replica's settings as the round began (a caller may change them between rounds)."""

    timeout: float
    quorum_timeout: float
    poll_interval: float
    straggler_grace: float
    min_participants: int
    keep_rounds: int


class RoundFailure(AllReduceError):
    """This replica cannot complete the round: a deadline passed, an object is stale or from another attempt, a write
    of its own failed, a contribution or residual is not finite. It never reaches a caller: the round aborts (one
    decision, which this replica writes if it may) and the caller gets `RoundAbortedError` with this reason."""


@dataclass
class Round:
    """One round as this replica runs it: its keys, the settings it began with, the payload it brings (``None`` for a
    veto), whether it contributes, the quorum once formed, the data-phase deadline, its background writes and the
    error-feedback residual it leaves if it commits (``staged``: stream key and residual). ``contributed``: its payload
    went into the round (it is a participant of this incarnation)."""

    keys: RoundKeys
    settings: RoundSettings
    spec: PayloadSpec | None
    participate: bool
    quorum: QuorumRecord | None = None
    contributed: bool = False
    started: float = 0.0
    deadline: float = math.inf
    decisions: DecisionChecks = field(default_factory=DecisionChecks)
    pending: Pending = field(default_factory=list)
    staged: tuple[str, torch.Tensor] | None = None

    @property
    def round_id(self) -> int:
        return self.keys.round_id

    @property
    def formed(self) -> QuorumRecord:
        """The quorum (the round must have one by now)."""
        if self.quorum is None:
            raise RoundFailure(f"round {self.round_id} has no quorum yet")
        return self.quorum

    @property
    def token(self) -> str | None:
        return self.quorum.token if self.quorum is not None else None

    @property
    def participants(self) -> tuple[int, ...]:
        return self.quorum.participants if self.quorum is not None else ()

    @property
    def plan(self) -> ShardPlan:
        return self.formed.plan

    def start_data_phase(self) -> None:
        """Start the data phase's clock: every wait of it ends ``timeout`` seconds from now, and its first read of the
        decision is due `DECISION_GAP` seconds from now (``decisions``)."""
        self.started = time.monotonic()
        self.decisions = DecisionChecks(self.started)
        self.deadline = self.started + self.settings.timeout

    def check_writes(self) -> None:
        """Raise `RoundFailure` as soon as one of this round's background writes failed."""
        for future in self.pending:
            if future.done() and future.exception() is not None:
                raise RoundFailure(f"writing this replica's object failed: {why(future.exception())}")

    def drain(self) -> None:
        """Wait for every background write of this round; `RoundFailure` for the first that failed."""
        concurrent.futures.wait(self.pending)
        errors = [e for e in (f.exception() for f in self.pending) if e is not None]
        if errors:
            raise RoundFailure(f"writing this replica's object failed: {why(errors[0])}")


def poll_until(deadline: float, probe: Callable[[bool], T | None], *, interval: float) -> T:
    """Call ``probe(late)`` until it returns something other than ``None``, and return that.

    ``late`` is True once ``deadline`` (a `time.monotonic` value) has passed: the probe decides what that means (raise
    naming what did not appear, or act, e.g. propose a quorum). Between the starts of two calls at least a pause
    that grows from 2 ms by 1.5x up to ``interval`` seconds, with +-25 % jitter so that replicas do not poll in
    lockstep; a probe that took longer (a network round trip) is followed at once."""
    if not interval > 0:
        raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
    attempt = 0
    while True:
        began = time.monotonic()
        found = probe(began > deadline)
        if found is not None:
            return found
        pause = min(interval, 0.002 * 1.5 ** min(attempt, 20)) * (0.75 + 0.5 * random.random())
        time.sleep(max(0.0, began + pause - time.monotonic()))
        attempt += 1


def why(exc: BaseException | None) -> str:
    """The reason an exception carries (its first argument), for abort records."""
    if exc is None:
        return ""
    return str(exc.args[0]) if exc.args else repr(exc)
