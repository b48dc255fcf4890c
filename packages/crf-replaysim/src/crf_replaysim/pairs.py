"""The schema-checked, streaming reader of pair files: what training code (crf-core's trace-replay channel) reads.

``read_pairs(path)`` yields one :class:`LoadedPair` per good line of a JSONL file in any of the pair
formats (:mod:`crf_replaysim.formats`: crf-replaysim records, TRL standard or conversational rows) and
one :class:`~crf_replaysim.records.RecordError` (``.line``, ``.reason``) per bad line, in file order,
holding one line in memory at a time. ``schema_version`` is honoured: every ``1.x`` is read (keys a
newer minor version added are dropped), other majors are bad lines whose message says which
crf-replaysim to install. ``strict=True`` raises the first ``RecordError`` instead of yielding it.

Contract fixtures ship in the wheel (current schema version, the same four pairs in each format):
``example_pairs_path("records" | "trl-standard" | "trl-conversational")``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from crf_replaysim.formats import PAIR_FORMATS, FormatReader, PairFormat
from crf_replaysim.jsonl import DEFAULT_MAX_LINE_BYTES, MalformedLine, iter_json_lines
from crf_replaysim.records import NormalizedDPOPair, RecordError

__all__ = ["LoadedPair", "example_pairs_path", "load_pairs", "read_pairs"]

_EXAMPLE_FILES = {
    "records": "example_pairs.jsonl",
    "trl-standard": "example_pairs_trl_standard.jsonl",
    "trl-conversational": "example_pairs_trl_conversational.jsonl",
}


@dataclass(frozen=True)
class LoadedPair:
    """One pair read from a file: the typed pair, its 1-based ``line`` and the ``format`` it was written in.

    ``pair`` always has both shapes: flat ``prompt``/``chosen``/``rejected`` strings and the ``*_messages``
    chat lists (built as a ``user`` prompt and ``assistant`` answers for ``trl-standard`` rows).
    """

    pair: NormalizedDPOPair
    line: int
    format: PairFormat

    @property
    def chat(self) -> bool:
        """Whether the pair is a conversation (render ``prompt_messages`` with a chat template), as opposed to
        TRL's standard format, whose flat ``prompt`` is the text to train on as it is."""
        return self.format != "trl-standard"


def read_pairs(
    path: str | os.PathLike[str],
    *,
    strict: bool = False,
    input_format: str = "auto",
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[LoadedPair | RecordError]:
    """Stream the pairs of a JSONL file: a :class:`LoadedPair` per good line, a ``RecordError`` per bad one.

    Args:
        path: JSONL file of records, TRL standard rows or TRL conversational rows (one format per file).
        strict: raise the first ``RecordError`` (with ``.line``) instead of yielding it.
        input_format: ``"auto"`` (the first good line decides), ``"records"`` or ``"trl"``.
        max_line_bytes: longer lines are bad lines (skipped without being held in memory).

    Raises ``FileNotFoundError`` if ``path`` does not exist. Blank lines are skipped.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"pair file {str(path)!r} does not exist. Fix: write it with crf-replaysim")
    reader = FormatReader(input_format)
    name = Path(path).name
    for item in iter_json_lines(path, max_line_bytes=max_line_bytes):
        if isinstance(item, MalformedLine):
            error = RecordError(item.reason, line=item.line)
        else:
            number, row = item
            try:
                record = reader.convert(row, f"{name}:{number}", decoded=True)
                assert reader.format is not None
                yield LoadedPair(NormalizedDPOPair.from_dj_record(record), number, reader.format)
                continue
            except RecordError as err:
                error = RecordError(err.reason, line=number)
        if strict:
            raise error
        yield error


def load_pairs(
    path: str | os.PathLike[str], *, input_format: str = "auto"
) -> tuple[list[LoadedPair], list[RecordError]]:
    """Every pair of a file and every bad line (loads everything; use :func:`read_pairs` to stream)."""
    pairs: list[LoadedPair] = []
    errors: list[RecordError] = []
    for item in read_pairs(path, input_format=input_format):
        (errors if isinstance(item, RecordError) else pairs).append(item)  # type: ignore[arg-type]
    return pairs, errors


def example_pairs_path(fmt: str = "records") -> Path:
    """Path of a shipped contract fixture: four pairs (tool calls included) in format ``fmt``."""
    if fmt not in PAIR_FORMATS:
        raise ValueError(f"fmt must be one of {PAIR_FORMATS}, got {fmt!r}")
    return Path(str(resources.files("crf_replaysim").joinpath("data").joinpath(_EXAMPLE_FILES[fmt])))
