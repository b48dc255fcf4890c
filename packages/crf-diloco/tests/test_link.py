"""`Link`: parsing the CLI form, the floor formula against a hand computation, and every bad input refused."""

from __future__ import annotations

import math

import pytest

from crf_diloco import Link
from crf_diloco.link import parse_rate, parse_seconds


@pytest.mark.parametrize(
    ("text", "rtt", "rate"),
    [
        ("40ms,50MB/s", 0.040, 50e6),
        (" 0.04s , 50mb/s ", 0.040, 50e6),
        ("0,1.5GB/s", 0.0, 1.5e9),
        ("120ms,800k", 0.120, 8e5),
        ("1,12.5MB", 1.0, 12.5e6),
        (".5ms,2000", 0.0005, 2000.0),
    ],
)
def test_link_parses_the_cli_form(text: str, rtt: float, rate: float) -> None:
    link = Link.parse(text)
    assert link.rtt_s == pytest.approx(rtt)
    assert link.bytes_per_s == pytest.approx(rate)


def test_floor_is_bytes_over_bandwidth_plus_round_trips_times_rtt() -> None:
    link = Link(0.037, 41e6)
    assert link.floor_s(3_300_000, 7) == pytest.approx(3_300_000 / 41e6 + 7 * 0.037, rel=1e-15)
    assert link.floor_s(0, 0) == 0.0
    assert str(Link.parse("40ms,50MB/s")) == "40 ms, 50 MB/s"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("40ms", "RTT,BANDWIDTH"),
        ("40ms,50MB/s,1", "RTT,BANDWIDTH"),
        ("fast,50MB/s", "as a duration"),
        ("-40ms,50MB/s", "as a duration"),
        ("40us,50MB/s", "as a duration"),
        ("nan,50MB/s", "as a duration"),
        ("40ms,lots", "as a bandwidth"),
        ("40ms,50TB/s", "as a bandwidth"),
        ("40ms,0MB/s", "must be > 0"),
        ("40ms,inf", "as a bandwidth"),
        ("40ms,1e9", "as a bandwidth"),
        ("", "RTT,BANDWIDTH"),
    ],
)
def test_link_refuses_what_it_cannot_read(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Link.parse(text)


@pytest.mark.parametrize(
    ("rtt", "rate"),
    [(-0.1, 1e6), (math.nan, 1e6), (math.inf, 1e6), (0.1, 0), (0.1, -5.0), (0.1, math.inf), (True, 1e6)],
)
def test_link_refuses_bad_numbers(rtt: float, rate: float) -> None:
    with pytest.raises(ValueError, match=r"rtt_s|bytes_per_s"):
        Link(rtt, rate)


@pytest.mark.parametrize(("nbytes", "trips"), [(-1, 0), (math.nan, 0), (math.inf, 1), (10, -1), (10, 1.5), (10, True)])
def test_floor_refuses_bad_counts(nbytes: float, trips: int) -> None:
    with pytest.raises(ValueError, match=r"nbytes|round_trips"):
        Link(0.04, 5e7).floor_s(nbytes, trips)


def test_parse_helpers_name_the_form() -> None:
    assert parse_seconds("250ms") == pytest.approx(0.25)
    assert parse_rate("2kB/s") == pytest.approx(2e3)
    with pytest.raises(ValueError, match=r"e\.g\. 40ms"):
        parse_seconds("soon")
    with pytest.raises(ValueError, match=r"e\.g\. 50MB/s"):
        parse_rate("quick")
