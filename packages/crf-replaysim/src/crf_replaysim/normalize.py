"""Normalise DPO-pair records with a data-juicer recipe: native ops, the real data-juicer executor, or a passthrough.

``DJNormalizer(recipe, skip_dj=False, backend="native")`` runs the recipe's ops in order on each record's
flat strings (``prompt``, ``chosen``, ``rejected``, or the derived ``pair``):

* ``backend="native"`` (default): the pure-Python ops of :mod:`crf_replaysim.ops`, which give data-juicer
  1.6.1's results. Streaming: one record at a time, memory independent of the input size except for the
  16-byte digests a deduplicator remembers. Imports neither data-juicer nor Ray.
* ``backend="data-juicer"``: data-juicer's ``DefaultExecutor`` in-process with ``skip_op_error: false``
  (see :mod:`crf_replaysim._dj_executor`). It materialises the whole input.
* ``skip_dj=True``: every record passes through unchanged; imports neither data-juicer nor Ray.

A mapper that rewrites a flat field also rewrites the text content of the matching ``*_messages`` list,
so the chat shape (what becomes a ``NormalizedDPOPair``) carries the same cleaning.

Input rows may be crf-replaysim records or TRL's standard or conversational preference rows
(``input_format``, auto-detected by default; see :mod:`crf_replaysim.formats`); the output is records or
TRL rows (``output_format``). :func:`normalize_jsonl` never loses data: every bad line is reported by
number and skipped, the output is written to a temporary file renamed into place at the end, and an
output that is the input file is refused before anything is opened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from crf_replaysim._normalize_shared import NormalizeSummary, map_message_text, message_texts, pair_text
from crf_replaysim.formats import INPUT_FORMATS, OUTPUT_FORMATS, FormatReader, PairFormat, dj_record_to_trl
from crf_replaysim.jsonl import DEFAULT_MAX_LINE_BYTES, MalformedLine, atomic_output, check_output, iter_json_lines
from crf_replaysim.ops import NATIVE_OPS, NativeDeduplicator, NativeFilter, NativeMapper, NativeOp, RecipeError
from crf_replaysim.ops._recipe import (
    PAIR_FIELD,
    RecipeSource,
    build_native_op,
    load_recipe,
)
from crf_replaysim.records import RecordError

Backend = Literal["native", "data-juicer"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)


class DJNormalizer:
    """Apply a data-juicer recipe to DPO-pair records.

    Args:
        recipe: ``None`` (the packaged ``recipes/default.yaml``), a path to a YAML recipe, or a dict.
        skip_dj: pass every record through unchanged (no data-juicer, no Ray, no filtering).
        backend: ``"native"`` (pure Python, streaming) or ``"data-juicer"`` (the real executor, in-process).
        input_format: ``"auto"`` (records or TRL rows, decided by the first row), ``"records"`` or ``"trl"``.
        output_format: ``"records"`` (dj records), ``"trl"`` (TRL rows in the input's flavour; records become
            conversational), ``"trl-standard"`` or ``"trl-conversational"``.

    ``normalize(rows)`` yields the kept rows in input order; ``stats`` holds the counts of the last
    (or running) call. Recipe mistakes raise :class:`~crf_replaysim.ops.RecipeError` at construction.
    """

    def __init__(
        self,
        recipe: RecipeSource = None,
        skip_dj: bool = False,
        backend: Backend = "native",
        *,
        input_format: str = "auto",
        output_format: str = "records",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(skip_dj, bool):
            raise TypeError(f"skip_dj must be a bool, got {type(skip_dj).__name__}")
        if input_format not in INPUT_FORMATS:
            raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {input_format!r}")
        if output_format not in OUTPUT_FORMATS:
            raise ValueError(f"output_format must be one of {OUTPUT_FORMATS}, got {output_format!r}")
        self.recipe = load_recipe(recipe)
        self.skip_dj = skip_dj
        self.backend: Backend = backend
        self.input_format = input_format
        self.output_format = output_format
        # Built for both backends: this checks the arguments of every op the native backend knows.
        self._ops: list[NativeOp] = []
        for step in self.recipe.steps:
            if backend == "native" or step.name in NATIVE_OPS:
                op = build_native_op(step, NATIVE_OPS, self.recipe.source)
                if op.kind == "mapper" and step.text_key == PAIR_FIELD:
                    raise RecipeError(
                        f"{self.recipe.source}: mapper {step.name!r} cannot rewrite the derived {PAIR_FIELD!r} field; "
                        "map prompt, chosen and rejected instead."
                    )
                self._ops.append(op)
        self.stats = NormalizeSummary()

    def normalize(self, records: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
        """Yield the rows the recipe keeps (rewritten by its mappers), in input order, in ``output_format``.

        Each row is read as ``input_format`` (a TRL row is converted to a record first, see
        :mod:`crf_replaysim.formats`); a bad one raises ``RecordError`` naming its index.
        """
        reader = FormatReader(self.input_format)
        return self._emit(self._normalize(self._checked(records, reader)), reader)

    def _emit(self, records: Iterator[dict[str, Any]], reader: FormatReader) -> Iterator[dict[str, Any]]:
        """``records`` in ``output_format`` (``reader`` tells the input's flavour for ``"trl"``)."""
        if self.output_format == "records":
            return records
        return (dj_record_to_trl(record, self._trl_flavour(reader)) for record in records)

    def _trl_flavour(self, reader: FormatReader) -> PairFormat:
        if self.output_format == "trl-standard" or (self.output_format == "trl" and reader.format == "trl-standard"):
            return "trl-standard"
        return "trl-conversational"

    def _normalize(self, records: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
        """The recipe over already validated dj ``records`` (no conversion, records out)."""
        self.stats = NormalizeSummary(dropped_per_op={} if self.skip_dj else {s.label: 0 for s in self.recipe.steps})
        if self.skip_dj:
            return self._passthrough(records)
        if self.backend == "native":
            return self._run_native(records)
        from crf_replaysim._dj_executor import run_data_juicer

        return run_data_juicer(self.recipe, records, self.stats)

    def _checked(self, rows: Iterable[Any], reader: FormatReader) -> Iterator[dict[str, Any]]:
        for index, row in enumerate(rows):
            try:
                record = reader.convert(row, f"row-{index}")
            except RecordError as err:
                raise RecordError(f"record {index}: {err}") from None
            self.stats.input_format = reader.format
            yield record

    def _passthrough(self, records: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
        for record in records:
            self.stats.read += 1
            self.stats.kept += 1
            yield dict(record)

    def _run_native(self, records: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
        stats = self.stats
        labels = [step.label for step in self.recipe.steps]
        plan: list[tuple[int, str, Callable[[str], Any]]] = []  # (kind: 0 filter, 1 dedup, 2 mapper, key, fn)
        for op in self._ops:
            if isinstance(op, NativeFilter):
                plan.append((0, op.text_key, op.keep))
            elif isinstance(op, NativeDeduplicator):
                plan.append((1, op.text_key, op.digest))
            elif isinstance(op, NativeMapper):
                plan.append((2, op.text_key, op.apply))
        seen: list[set[bytes]] = [set() for _ in plan]
        for record in records:
            stats.read += 1
            out = dict(record)
            for i, (kind, key, fn) in enumerate(plan):
                text = pair_text(out) if key == PAIR_FIELD else out[key]
                if kind == 0:
                    if not fn(text):
                        break
                elif kind == 1:
                    digest = fn(text)
                    if digest in seen[i]:
                        break
                    seen[i].add(digest)
                else:
                    out[key] = fn(text)
                    out[f"{key}_messages"] = map_message_text(out[f"{key}_messages"], fn)
            else:
                stats.kept += 1
                yield out
                continue
            stats.dropped_per_op[labels[i]] += 1


def _read_rows(
    path: Path,
    summary: NormalizeSummary,
    reader: FormatReader,
    progress: Callable[[int], None] | None,
    max_line_bytes: int,
) -> Iterator[dict[str, Any]]:
    """Yield the dj records of ``path``'s good lines; record every other line in ``summary.malformed``."""
    for count, item in enumerate(iter_json_lines(path, max_line_bytes=max_line_bytes, blank_lines="report"), 1):
        if progress is not None:
            progress(count)
        if isinstance(item, MalformedLine):
            summary.malformed.append((item.line, item.reason))
            continue
        number, row = item
        try:
            record = reader.convert(row, f"{path.name}:{number}", decoded=True)
        except RecordError as err:
            summary.malformed.append((number, str(err)))
            continue
        yield record


def normalize_jsonl(
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    recipe: RecipeSource = None,
    backend: Backend = "native",
    skip_dj: bool = False,
    progress: Callable[[int], None] | None = None,
    input_format: str = "auto",
    output_format: str = "records",
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> NormalizeSummary:
    """Normalise the pair JSONL file ``input_path`` into ``output_path``; nothing is lost on bad input.

        Streams with the native backend and ``skip_dj``. Lines that are not valid rows of the input format
        (bad JSON or UTF-8, lone surrogates, too deep, longer than ``max_line_bytes``, wrong schema, blank)
        are not written; they are counted in ``read`` and listed in ``malformed`` with their line numbers, and
        the other lines are processed. The output goes to a temporary file renamed over ``output_path`` only
        at the end (an error or Ctrl-C leaves the previous file as it was); ``output_path`` naming the input
        file (by any path, symlink or hard link) raises :class:`~crf_replaysim.jsonl.UnsafeOutputError`
        before anything is opened. ``progress(n)`` is called after each line read, with the number of lines read so
    far (the shape :class:`~crf_replaysim.progress.StderrProgress` takes).
    """
    normalizer = DJNormalizer(
        recipe, skip_dj=skip_dj, backend=backend, input_format=input_format, output_format=output_format
    )
    source = Path(input_path)
    check_output(output_path, [source])
    if not source.is_file():
        raise FileNotFoundError(f"input file {str(source)!r} does not exist")
    summary = NormalizeSummary()
    reader = FormatReader(input_format)
    with atomic_output(output_path, inputs=[source]) as out:
        rows = _read_rows(source, summary, reader, progress, max_line_bytes)
        for row in normalizer._emit(normalizer._normalize(rows), reader):
            out.write(json.dumps(row, ensure_ascii=False))
            out.write("\n")
    summary.read = normalizer.stats.read + len(summary.malformed)
    summary.kept = normalizer.stats.kept
    summary.dropped_per_op = dict(normalizer.stats.dropped_per_op)
    summary.input_format = reader.format
    return summary


__all__ = [
    "BACKENDS",
    "DJNormalizer",
    "NormalizeSummary",
    "RecordError",
    "map_message_text",
    "message_texts",
    "normalize_jsonl",
    "pair_text",
]
