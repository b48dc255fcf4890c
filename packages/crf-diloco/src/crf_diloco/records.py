"""Typed records of the round protocol (members, quorum, votes, decision) and their strict JSON parsing.

Each record is a frozen dataclass with ``to_json()`` and ``parse(obj, key, world_size)``; ``parse`` accepts exactly
the shape ``to_json`` writes (types, ranges, ranks ``0 <= r < world_size``) and raises `CorruptObjectError` naming the
key for anything else, so a malformed object can never surface as a raw ``KeyError``/``TypeError``. Every record
names the ``world_size`` of its writer, and a reader refuses one written for another world size.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from crf_diloco._checks import is_int
from crf_diloco.errors import CorruptObjectError
from crf_diloco.wire import CODECS, ShardPlan, parse_codec

__all__ = [
    "MAX_NUMEL",
    "OUTCOMES",
    "PAYLOAD_DTYPES",
    "REDUCE_OPS",
    "DecisionRecord",
    "MemberRecord",
    "Outcome",
    "PayloadSpec",
    "QuorumRecord",
    "ReduceOp",
    "VoteRecord",
    "parse_rank",
    "ranks_named",
]

MAX_NUMEL = 1 << 40
_RANK_RE = re.compile(r"0|[1-9][0-9]{0,8}")
_TOKEN_RE = re.compile(r"[0-9a-f]{32}")
_MAX_TEXT = 4096
#: dtypes a payload may come from (the reduction is fp32; results are checked for finiteness in these).
PAYLOAD_DTYPES = ("float32", "float16", "bfloat16")
ReduceOp = Literal["avg", "sum"]
"""How contributions combine: their mean or their sum."""
REDUCE_OPS: tuple[ReduceOp, ...] = get_args(ReduceOp)
Outcome = Literal["commit", "abort"]
"""A round's one decision."""
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)


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

    def world(self) -> int:
        """The writer's ``world_size``, which must be the reader's."""
        v = self.obj["world_size"]
        if v != self.world_size or not is_int(v):
            raise CorruptObjectError(
                f"{self.key}: written by a replica with world_size={v!r:.20}, this replica has world_size="
                f"{self.world_size}; every replica of a run must be launched with the same world size"
            )
        return v

    def bad(self, name: str, want: str) -> CorruptObjectError:
        return CorruptObjectError(f"{self.key}: field {name!r} must be {want}, got {self.obj.get(name)!r:.200}")

    def integer(self, name: str, lo: int = 0, hi: int = MAX_NUMEL) -> int:
        v = self.obj[name]
        if not is_int(v) or not lo <= v <= hi:
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

    def codec(self, name: str) -> str:
        v = self.obj[name]
        try:
            ok = isinstance(v, str) and parse_codec(v).name == v
        except ValueError:
            ok = False
        if not ok:
            raise self.bad(name, f"a canonical codec name ({CODECS}, 'int4:<block>' or 'topk:<k>/<block>')")
        return v

    def dtype_runs(self, name: str) -> tuple[tuple[str, int], ...]:
        v = self.obj[name]
        want = f"runs [dtype, count] of {PAYLOAD_DTYPES}, neighbours differing, not all float32"
        if not isinstance(v, list) or not all(
            isinstance(run, list) and len(run) == 2 and run[0] in PAYLOAD_DTYPES and isinstance(run[1], int)
            and not isinstance(run[1], bool) and 1 <= run[1] <= MAX_NUMEL for run in v
        ):  # fmt: skip
            raise self.bad(name, want)
        runs = tuple((str(d), int(n)) for d, n in v)
        if any(a[0] == b[0] for a, b in itertools.pairwise(runs)) or [d for d, _ in runs] == ["float32"]:
            raise self.bad(name, want)
        return runs

    def ranks(self, name: str) -> tuple[int, ...]:
        v = self.obj[name]
        ok = isinstance(v, list) and all(is_int(r) and 0 <= r < self.world_size for r in v)
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
    """What a replica contributes to a round: element count, wire codec, op, optional name, vote-decided or not, and
    the dtypes of its tensors as runs ``(dtype, count)`` over the flat payload (``()``: all float32)."""

    numel: int
    codec: str
    op: ReduceOp
    name: str | None
    vote: bool
    dtypes: tuple[tuple[str, int], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"numel": self.numel, "codec": self.codec, "op": self.op, "name": self.name, "vote": self.vote,
                "dtypes": [list(run) for run in self.dtypes]}  # fmt: skip

    @staticmethod
    def parse(obj: Any, key: str) -> PayloadSpec:
        r = _Reader(obj, key, 1, {"numel", "codec", "op", "name", "vote", "dtypes"})
        spec = PayloadSpec(
            r.integer("numel", 1),
            r.codec("codec"),
            r.choice("op", REDUCE_OPS),
            r.text("name", optional=True),
            r.flag("vote"),
            r.dtype_runs("dtypes"),
        )
        if spec.dtypes and sum(n for _, n in spec.dtypes) != spec.numel:
            raise r.bad("dtypes", f"runs covering the {spec.numel} elements")
        return spec

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
    world_size: int = field(kw_only=True)

    def to_json(self) -> dict[str, Any]:
        spec = self.spec.to_json() if self.spec is not None else None
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "incarnation": self.incarnation,
            "spec": spec,
            "observer": self.observer,
            "veto": self.veto,
        }

    @staticmethod
    def parse(obj: Any, key: str, world_size: int) -> MemberRecord:
        r = _Reader(obj, key, world_size, {"world_size", "rank", "incarnation", "spec", "observer", "veto"})
        world = r.world()
        spec = None if obj["spec"] is None else PayloadSpec.parse(obj["spec"], key)
        record = MemberRecord(
            r.rank("rank"),
            r.text("incarnation", pattern=_TOKEN_RE),
            spec,
            r.flag("observer"),
            r.text("veto", optional=True),
            world_size=world,
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
    world_size: int = field(kw_only=True)

    @property
    def plan(self) -> ShardPlan:
        return ShardPlan.build(self.spec.numel, self.spec.codec, len(self.participants))

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
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
        fields = {"world_size", "round", "token", "participants", "incarnations", "spec", "by", "rejected"}
        r = _Reader(obj, key, world_size, fields)
        world = r.world()
        record = QuorumRecord(
            r.integer("round", round_id, round_id),
            r.text("token", pattern=_TOKEN_RE),
            r.ranks("participants"),
            r.rank_map("incarnations", value_pattern=_TOKEN_RE),
            PayloadSpec.parse(obj["spec"], key),
            r.rank("by"),
            r.rank_map("rejected"),
            world_size=world,
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
    world_size: int = field(kw_only=True)

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "ok": self.ok,
            "reason": self.reason[:_MAX_TEXT],
            "token": self.token,
            "incarnation": self.incarnation,
        }

    @staticmethod
    def parse(obj: Any, key: str, world_size: int) -> VoteRecord:
        r = _Reader(obj, key, world_size, {"world_size", "rank", "ok", "reason", "token", "incarnation"})
        world = r.world()
        return VoteRecord(
            r.rank("rank"),
            r.flag("ok"),
            r.text("reason"),
            r.text("token", pattern=_TOKEN_RE),
            r.text("incarnation", pattern=_TOKEN_RE),
            world_size=world,
        )


@dataclass(frozen=True)
class DecisionRecord:
    """``decision.json``: the round's single outcome. ``token`` is the quorum's (``None`` when aborted before it)."""

    round: int
    outcome: Outcome
    reason: str
    by: int
    token: str | None
    world_size: int = field(kw_only=True)

    @property
    def committed(self) -> bool:
        return self.outcome == "commit"

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "round": self.round,
            "outcome": self.outcome,
            "reason": self.reason[:_MAX_TEXT],
            "by": self.by,
            "token": self.token,
        }

    @staticmethod
    def parse(obj: Any, key: str, world_size: int, round_id: int) -> DecisionRecord:
        r = _Reader(obj, key, world_size, {"world_size", "round", "outcome", "reason", "by", "token"})
        world = r.world()
        record = DecisionRecord(
            r.integer("round", round_id, round_id),
            r.choice("outcome", OUTCOMES),
            r.text("reason"),
            r.rank("by"),
            r.text("token", optional=True, pattern=_TOKEN_RE),
            world_size=world,
        )
        if record.committed and record.token is None:
            raise CorruptObjectError(f"{key}: a commit decision names its round token")
        return record
