"""`Link`: the network between a replica and its bucket, and the time a round cannot beat on it.

A round's floor on a link of round-trip time ``rtt`` and bandwidth ``rate``::

    floor = bytes / rate + round_trips * rtt

``bytes``: what the replica moved (up + down); ``round_trips``: its sequential request waves that found something
(`crf_diloco.store.Traffic`: polls that found nothing wait for slower peers, not for the network). Concurrent
requests share one wave, so the floor rewards a protocol that keeps few waves and many requests in each.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Link", "parse_rate", "parse_seconds"]

_SECONDS = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>ms|s)?", re.IGNORECASE)
_RATE = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<prefix>[kmg]?)(?:b(?:/s)?)?", re.IGNORECASE)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_seconds(text: str) -> float:
    """``"40ms"`` -> 0.04, ``"1.5s"`` or ``"1.5"`` -> 1.5 (seconds, >= 0)."""
    match = _SECONDS.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"cannot read {text!r} as a duration: write e.g. 40ms or 0.04s")
    value = float(match["number"])
    return value / 1000 if (match["unit"] or "s").lower() == "ms" else value


def parse_rate(text: str) -> float:
    """``"50MB/s"`` -> 5e7, ``"1.5GB/s"`` -> 1.5e9, ``"800k"`` -> 8e5 (bytes per second, decimal prefixes, > 0)."""
    match = _RATE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"cannot read {text!r} as a bandwidth: write e.g. 50MB/s (bytes per second)")
    value = float(match["number"]) * _PREFIX[match["prefix"].lower()]
    if not value > 0:
        raise ValueError(f"a bandwidth must be > 0 bytes/s, got {text!r}")
    return value


@dataclass(frozen=True)
class Link:
    """A replica's network to the bucket: ``rtt_s`` seconds per round trip, ``bytes_per_s`` of bandwidth.

    ``Link.parse("40ms,50MB/s")`` reads the form the CLIs take."""

    rtt_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if isinstance(self.rtt_s, bool) or not isinstance(self.rtt_s, int | float) or not 0 <= self.rtt_s < math.inf:
            raise ValueError(f"rtt_s must be a finite number of seconds >= 0, got {self.rtt_s!r}")
        if (
            isinstance(self.bytes_per_s, bool)
            or not isinstance(self.bytes_per_s, int | float)
            or not 0 < self.bytes_per_s < math.inf
        ):
            raise ValueError(f"bytes_per_s must be a finite number > 0, got {self.bytes_per_s!r}")

    @classmethod
    def parse(cls, text: str) -> Link:
        """``"RTT,BANDWIDTH"``, e.g. ``"40ms,50MB/s"``."""
        parts = text.split(",")
        if len(parts) != 2:
            raise ValueError(f"a link is RTT,BANDWIDTH (e.g. 40ms,50MB/s), got {text!r}")
        return cls(parse_seconds(parts[0]), parse_rate(parts[1]))

    def floor_s(self, nbytes: float, round_trips: int) -> float:
        """``nbytes / bytes_per_s + round_trips * rtt_s``: the least time ``round_trips`` sequential waves moving
        ``nbytes`` in all can take on this link."""
        if not 0 <= nbytes < math.inf:
            raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
        if isinstance(round_trips, bool) or not isinstance(round_trips, int) or round_trips < 0:
            raise ValueError(f"round_trips must be an int >= 0, got {round_trips!r}")
        return nbytes / self.bytes_per_s + round_trips * self.rtt_s

    def __str__(self) -> str:
        return f"{self.rtt_s * 1000:g} ms, {self.bytes_per_s / 1e6:g} MB/s"
