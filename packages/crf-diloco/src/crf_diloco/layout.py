"""Object-store layout of a serverless DiLoCo run (layout version 5).

Everything lives under ``{uri}/{run_id}/``::

    LAYOUT                          {"layout": "crf-diloco", "version": 5, "world_size": W}   (create-only)
    r{round:08d}/members/{rank}.json  announcement: incarnation nonce, payload spec, observer flag, veto
    r{round:08d}/quorum.json          participants, incarnations, payload spec, rejected ranks, round token (first writer wins)
    r{round:08d}/data/{rank}.safetensors      a participant's whole payload, written once
    r{round:08d}/reduced/{shard}.safetensors  the reduced shard (owner, or any replica covering it)
    r{round:08d}/votes/{rank}.json    a participant's commit vote {"ok": bool, ...} (rounds run with a vote)
    r{round:08d}/decision.json        {"outcome": "commit" | "abort", ...}   (first writer wins)
    state/r{round:08d}.safetensors    manifest of MockManager's global state after the commit of that round
    state/parts/{digest}.safetensors  a part of such states (content-named: written once, shared by manifests)

Version 2 added ``votes/`` (the store-wide ``should_commit`` vote) and the member ``veto`` field. Version 3
authenticates every object with the run's secret (records sealed as ``{"mac": ..., "body": ...}``, tensor objects in
wire format 2 with a header MAC and per-shard content tags), stores typed records (the quorum names ``rejected``
ranks and no longer stores the shard plan) and writes states in the same sealed format. Version 4 binds the run's
``world_size`` into ``LAYOUT`` and every record, adds the payload's dtypes to its spec, and keeps the decision of
every collected round (a tombstone: a collected round is never re-created). Version 5 writes states incrementally:
a manifest per round and content-named parts (`crf_diloco.snapshots`).
Every object is written create-only and never rewritten. Names that reach a key are validated
so that nothing can escape the run prefix.
"""

from __future__ import annotations

import re

__all__ = [
    "LAYOUT_VERSION",
    "RoundKeys",
    "parse_round_dir",
    "parse_state_key",
    "part_key",
    "state_key",
    "validate_name",
]

LAYOUT_VERSION = 5
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ROUND_RE = re.compile(r"r([0-9]{8,})")
_STATE_RE = re.compile(r"r([0-9]{8,})\.safetensors")


def validate_name(value: str, what: str) -> str:
    """Return ``value`` if it is a safe single path component, else raise ``ValueError``.

    Allowed: 1–128 characters from ``[A-Za-z0-9._-]``, starting with a letter or digit, and no
    ``..`` (so ``"../x"``, ``"a/b"``, ``"~"``, ``""`` and absolute paths are all rejected).
    """
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    if not _NAME_RE.fullmatch(value) or ".." in value:
        raise ValueError(
            f"{what}={value!r} could escape the store prefix or is not a plain name; use 1-128 characters "
            "from [A-Za-z0-9._-], starting with a letter or digit, without '..' or '/'"
        )
    return value


class RoundKeys:
    """Keys (relative to the run prefix) of the objects of one round."""

    def __init__(self, round_id: int) -> None:
        if round_id < 0:
            raise ValueError(f"round_id must be >= 0, got {round_id}")
        self.round_id = round_id
        self.prefix = f"r{round_id:08d}"

    def member(self, rank: int) -> str:
        return f"{self.prefix}/members/{rank}.json"

    @property
    def members_dir(self) -> str:
        return f"{self.prefix}/members"

    @property
    def quorum(self) -> str:
        return f"{self.prefix}/quorum.json"

    def data(self, rank: int) -> str:
        return f"{self.prefix}/data/{rank}.safetensors"

    def reduced(self, shard: int) -> str:
        return f"{self.prefix}/reduced/{shard}.safetensors"

    def vote(self, rank: int) -> str:
        return f"{self.prefix}/votes/{rank}.json"

    @property
    def votes_dir(self) -> str:
        return f"{self.prefix}/votes"

    @property
    def decision(self) -> str:
        return f"{self.prefix}/decision.json"


def parse_round_dir(name: str) -> int | None:
    """Round number of a directory name ``r00000012`` (last path component), else ``None``."""
    m = _ROUND_RE.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def state_key(round_id: int) -> str:
    """Key of the checkpoint written after the commit of ``round_id``."""
    return f"state/r{round_id:08d}.safetensors"


def part_key(digest: str) -> str:
    """Key of the state part named by ``digest`` (`crf_diloco.checkpoint.part_digest`)."""
    return f"state/parts/{digest}.safetensors"


def parse_state_key(name: str) -> int | None:
    """Round number of a checkpoint object name, else ``None``."""
    m = _STATE_RE.fullmatch(name.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None
