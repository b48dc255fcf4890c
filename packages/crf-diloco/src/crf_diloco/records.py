"""Typed records of the round protocol (members, quorum, votes, decision) and their strict JSON parsing.

Each record is a frozen dataclass with ``to_json()`` and ``parse(obj, key, world_size)``; ``parse`` accepts exactly
the shape ``to_json`` writes (types, ranges, ranks ``0 <= r < world_size``) and raises `CorruptObjectError` naming the
key for anything else, so a malformed object can never surface as a raw ``KeyError``/``TypeError``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from crf_diloco.errors import CorruptObjectError
from crf_diloco.wire import CODECS, ShardPlan

__all__ = [
    "MAX_NUMEL",
    "DecisionRecord",
    "MemberRecord",
    "PayloadSpec",
    "QuorumRecord",
    "VoteRecord",
    "parse_rank",
    "ranks_named",
]

MAX_NUMEL = 1 << 40
_RANK_RE = re.compile(r"0|[1-9][0-9]{0,8}")
_TOKEN_RE = re.compile(r"[0-9a-f]{32}")
_MAX_TEXT = 4096


def parse_rank(text: str, world_size: int) -> int | None:
    """The rank written as ``text`` (plain decimal digits, no sign, ``_`` or padding) if ``0 <= rank < world_size``."""
    if not _RANK_RE.fullmatch(text):
        return None
    rank = int(text)
    return rank if rank < world_size else None


def ranks_named(entries: list[str], world_size: int) -> list[int]:
    """The ranks of the ``{rank}.json`` entries of a listing (``members/``, ``votes/``); other names are ignored."""
    ranks = (parse_rank(e[: -len(".json")], world_size) for e in entries if e.endswith(".json"))
    return sorted(r for r in ranks if r is not None)


class _Reader:
    """Typed field access on a parsed JSON object; every violation is a `CorruptObjectError` naming the key."""

    def __init__(self, obj: Any, key: str, world_size: int, fields: set[str]) -> None:
        if not isinstance(obj, dict):
            raise CorruptObjectError(f"{key}: expected a JSON object, got {type(obj).__name__}")
        extra = sorted(set(obj) - fields)
        missing = sorted(fields - set(obj))
        if extra or missing:
            raise CorruptObjectError(f"{key}: unexpected fields {extra} / missing fields {missing}")
        self.obj, self.key, self.world_size = obj, key, world_size

    def bad(self, name: str, want: str) -> CorruptObjectError:
        return CorruptObjectError(f"{self.key}: field {name!r} must be {want}, got {self.obj.get(name)!r:.200}")

    def integer(self, name: str, lo: int = 0, hi: int = MAX_NUMEL) -> int:
        v = self.obj[name]
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise self.bad(name, f"an int in [{lo}, {hi}]")
        return v

    def rank(self, name: str) -> int:
        return self.integer(name, 0, self.world_size - 1)

    def flag(self, name: str) -> bool:
        v = self.obj[name]
        if not isinstance(v, bool):
            raise self.bad(name, "a bool")
        return v

    def text(self, name: str, *, optional: bool = False, pattern: re.Pattern[str] | None = None) -> Any:
        v = self.obj[name]
        if v is None and optional:
            return None
        if not isinstance(v, str) or len(v) > _MAX_TEXT or (pattern is not None and not pattern.fullmatch(v)):
            raise self.bad(name, "a short string" + (" matching " + pattern.pattern if pattern else ""))
        return v

    def choice(self, name: str, options: tuple[str, ...]) -> Any:
        v = self.obj[name]
        if not isinstance(v, str) or v not in options:
            raise self.bad(name, f"one of {options}")
        return v

    def ranks(self, name: str) -> tuple[int, ...]:
        v = self.obj[name]
        ok = isinstance(v, list) and all(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r < self.world_size for r in v
        )
        if not ok or list(v) != sorted(set(v)):
            raise self.bad(name, f"a sorted list of distinct ranks in [0, {self.world_size})")
        return tuple(v)

    def rank_map(self, name: str, *, value_pattern: re.Pattern[str] | None = None) -> dict[int, str]:
        v = self.obj[name]
        if not isinstance(v, dict):
            raise self.bad(name, "an object keyed by rank")
        out: dict[int, str] = {}
        for k, text in v.items():
            rank = parse_rank(k, self.world_size)
            if rank is None or not isinstance(text, str) or len(text) > _MAX_TEXT:
                raise self.bad(name, f"an object of rank (0 <= rank < {self.world_size}) -> string")
            if value_pattern is not None and not value_pattern.fullmatch(text):
                raise self.bad(name, f"an object of rank -> string matching {value_pattern.pattern}")
            out[rank] = text
        return out


@dataclass(frozen=True)
class PayloadSpec:
    """What a replica contributes to a round: element count, wire codec, op, optional name, vote-decided or not."""

    numel: int
    codec: str
    op: Literal["avg", "sum"]
    name: str | None
    vote: bool

    def to_json(self) -> dict[str, Any]:
        return {"numel": self.numel, "codec": self.codec, "op": self.op, "name": self.name, "vote": self.vote}

    @staticmethod
    def parse(obj: Any, key: str) -> PayloadSpec:
        r = _Reader(obj, key, 1, {"numel", "codec", "op", "name", "vote"})
        return PayloadSpec(
            r.integer("numel", 1),
            r.choice("codec", CODECS),
            r.choice("op", ("avg", "sum")),
            r.text("name", optional=True),
            r.flag("vote"),
        )

    def describe(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"{self.numel} elements{label} ({self.codec}, {self.op}{', vote' if self.vote else ''})"


@dataclass(frozen=True)
class MemberRecord:
    """``members/{rank}.json``: a replica's announcement (``spec`` is ``None`` for a veto)."""

    rank: int
    incarnation: str
    spec: PayloadSpec | None
    observer: bool
    veto: str | None

    def to_json(self) -> dict[str, Any]:
        spec = self.spec.to_json() if self.spec is not None else None
        return {
            "rank": self.rank,
            "incarnation": self.incarnation,
            "spec": spec,
            "observer": self.observer,
            "veto": self.veto,
        }

    @staticmethod
    def parse(obj: Any, key: str, world_size: int) -> MemberRecord:
        r = _Reader(obj, key, world_size, {"rank", "incarnation", "spec", "observer", "veto"})
        spec = None if obj["spec"] is None else PayloadSpec.parse(obj["spec"], key)
        record = MemberRecord(
            r.rank("rank"),
            r.text("incarnation", pattern=_TOKEN_RE),
            spec,
            r.flag("observer"),
            r.text("veto", optional=True),
        )
        if (record.spec is None) == (record.veto is None):
            raise CorruptObjectError(f"{key}: a member record has either a payload spec or a veto")
        return record


@dataclass(frozen=True)
class QuorumRecord:
    """``quorum.json``: who contributes to a round (sorted ranks), with which incarnation, and the round token.

    ``rejected`` maps ranks that announced another payload than the round's to the reason; they take no part and
    raise `PayloadMismatchError`. The shard plan is not stored: it follows from ``spec`` and the participants.
    """

    round: int
    token: str
    participants: tuple[int, ...]
    incarnations: Mapping[int, str]
    spec: PayloadSpec
    by: int
    rejected: Mapping[int, str] = field(default_factory=dict)

    @property
    def plan(self) -> ShardPlan:
        return ShardPlan.build(self.spec.numel, self.spec.codec, len(self.participants))

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "token": self.token,
            "participants": list(self.participants),
            "incarnations": {str(r): i for r, i in self.incarnations.items()},
            "spec": self.spec.to_json(),
            "by": self.by,
            "rejected": {str(r): why for r, why in self.rejected.items()},
        }

    @staticmethod
    def parse(obj: Any, key: str, world_size: int, round_id: int) -> QuorumRecord:
        fields = {"round", "token", "participants", "incarnations", "spec", "by", "rejected"}
        r = _Reader(obj, key, world_size, fields)
        record = QuorumRecord(
            r.integer("round", round_id, round_id),
            r.text("token", pattern=_TOKEN_RE),
            r.ranks("participants"),
            r.rank_map("incarnations", value_pattern=_TOKEN_RE),
            PayloadSpec.parse(obj["spec"], key),
            r.rank("by"),
            r.rank_map("rejected"),
        )
        if not record.participants or set(record.incarnations) != set(record.participants):
            raise CorruptObjectError(f"{key}: participants and incarnations disagree (or no participant)")
        if set(record.rejected) & set(record.participants):
            raise CorruptObjectError(f"{key}: a rank is both a participant and rejected")
        return record


@dataclass(frozen=True)
class VoteRecord:
    """``votes/{rank}.json``: a participant's commit vote on a vote-decided round."""

    rank: int
    ok: bool
    reason: str
    token: str
    incarnation: str

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "ok": self.ok,
            "reason": self.reason[:_MAX_TEXT],
            "token": self.token,
            "incarnation": self.incarnation,
        }

    @staticmethod
    def parse(obj: Any, key: str, world_size: int) -> VoteRecord:
        r = _Reader(obj, key, world_size, {"rank", "ok", "reason", "token", "incarnation"})
        return VoteRecord(
            r.rank("rank"),
            r.flag("ok"),
            r.text("reason"),
            r.text("token", pattern=_TOKEN_RE),
            r.text("incarnation", pattern=_TOKEN_RE),
        )


@dataclass(frozen=True)
class DecisionRecord:
    """``decision.json``: the round's single outcome. ``token`` is the quorum's (``None`` when aborted before it)."""

    round: int
    outcome: Literal["commit", "abort"]
    reason: str
    by: int
    token: str | None

    @property
    def committed(self) -> bool:
        return self.outcome == "commit"

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "outcome": self.outcome,
            "reason": self.reason[:_MAX_TEXT],
            "by": self.by,
            "token": self.token,
        }

    @staticmethod
    def parse(obj: Any, key: str, world_size: int, round_id: int) -> DecisionRecord:
        r = _Reader(obj, key, world_size, {"round", "outcome", "reason", "by", "token"})
        record = DecisionRecord(
            r.integer("round", round_id, round_id),
            r.choice("outcome", ("commit", "abort")),
            r.text("reason"),
            r.rank("by"),
            r.text("token", optional=True, pattern=_TOKEN_RE),
        )
        if record.committed and record.token is None:
            raise CorruptObjectError(f"{key}: a commit decision names its round token")
        return record
