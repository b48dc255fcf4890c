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
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from crf_replaysim.ops import NATIVE_OPS, NativeDeduplicator, NativeFilter, NativeMapper, NativeOp, RecipeError
from crf_replaysim.ops._recipe import (
    PAIR_FIELD,
    RecipeSource,
    build_native_op,
    load_recipe,
)
from crf_replaysim.records import RecordError, validate_dj_record

Backend = Literal["native", "data-juicer"]
BACKENDS: tuple[str, ...] = ("native", "data-juicer")


@dataclass
class NormalizeSummary:
    """Counts of one normalisation run.

    ``read``: records (or JSONL lines) read; ``kept``: records written; ``dropped_per_op``: records each
    recipe step removed, keyed ``op_name(text_key)`` (data-juicer backend: per executor pass, see its
    docs); ``malformed``: ``(line number, reason)`` of input lines that were not valid records (never written).
    """

    read: int = 0
    kept: int = 0
    dropped_per_op: dict[str, int] = field(default_factory=dict)
    malformed: list[tuple[int, str]] = field(default_factory=list)

    def format(self) -> str:
        """Multi-line human-readable summary, as the CLI prints it at the end."""
        lines = [f"read {self.read}, kept {self.kept}, dropped {sum(self.dropped_per_op.values())}"]
        lines += [f"  dropped by {label}: {count}" for label, count in self.dropped_per_op.items()]
        if self.malformed:
            lines.append(f"  malformed lines (not written): {len(self.malformed)}")
            lines += [f"    line {number}: {reason}" for number, reason in self.malformed]
        return "\n".join(lines)


def pair_text(record: Mapping[str, Any]) -> str:
    """The derived ``pair`` field: ``[prompt, chosen, rejected]`` as compact JSON (unambiguous, so exact dedup)."""
    return json.dumps([record["prompt"], record["chosen"], record["rejected"]], ensure_ascii=False)


def message_texts(messages: list[Any]) -> list[str]:
    """The strings :func:`map_message_text` would rewrite, in the same order."""
    texts: list[str] = []

    def collect(text: str) -> str:
        texts.append(text)
        return text

    map_message_text(messages, collect)
    return texts


def map_message_text(messages: list[Any], apply: Callable[[str], str]) -> list[Any]:
    """A copy of ``messages`` with ``apply`` run on each string ``content`` and each ``{"type": "text"}`` part.

    Tool-call arguments (JSON) are left untouched.
    """
    out: list[Any] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise RecordError(f"chat messages must be dicts, got {type(message).__name__}")
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": apply(content)}
        elif isinstance(content, list):
            parts = [
                {**part, "text": apply(part["text"])}
                if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
                else part
                for part in content
            ]
            message = {**message, "content": parts}
        out.append(message)
    return out


class DJNormalizer:
    """Apply a data-juicer recipe to DPO-pair records.

    Args:
        recipe: ``None`` (the packaged ``recipes/default.yaml``), a path to a YAML recipe, or a dict.
        skip_dj: pass every record through unchanged (no data-juicer, no Ray, no filtering).
        backend: ``"native"`` (pure Python, streaming) or ``"data-juicer"`` (the real executor, in-process).

    ``normalize(records)`` yields the kept records in input order; ``stats`` holds the counts of the last
    (or running) call. Recipe mistakes raise :class:`~crf_replaysim.ops.RecipeError` at construction.
    """

    def __init__(self, recipe: RecipeSource = None, skip_dj: bool = False, backend: Backend = "native") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(skip_dj, bool):
            raise TypeError(f"skip_dj must be a bool, got {type(skip_dj).__name__}")
        self.recipe = load_recipe(recipe)
        self.skip_dj = skip_dj
        self.backend: Backend = backend
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
        """Yield the records the recipe keeps (rewritten by its mappers), in input order.

        Each record is checked with :func:`crf_replaysim.records.validate_dj_record` first; a bad one raises
        ``RecordError`` naming its index.
        """
        return self._normalize(self._checked(records))

    def _normalize(self, records: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
        """:meth:`normalize` without the record check (``records`` are already validated)."""
        self.stats = NormalizeSummary(dropped_per_op={} if self.skip_dj else {s.label: 0 for s in self.recipe.steps})
        if self.skip_dj:
            return self._passthrough(records)
        if self.backend == "native":
            return self._run_native(records)
        from crf_replaysim._dj_executor import run_data_juicer

        return run_data_juicer(self.recipe, records, self.stats)

    def _checked(self, records: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
        for index, record in enumerate(records):
            try:
                validate_dj_record(record)
            except RecordError as err:
                raise RecordError(f"record {index}: {err}") from None
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


def _read_jsonl(
    path: str | os.PathLike[str],
    summary: NormalizeSummary,
    progress: Callable[[int], None] | None,
) -> Iterator[dict[str, Any]]:
    """Yield the valid records of ``path``; record every other line in ``summary.malformed``."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if progress is not None:
                progress(1)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                reason = "blank line" if not line.strip() else f"invalid JSON ({err.msg} at column {err.colno})"
                summary.malformed.append((number, reason))
                continue
            try:
                validate_dj_record(record)
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
) -> NormalizeSummary:
    """Normalise the DPO-pair JSONL file ``input_path`` into ``output_path``.

    Streams with the native backend and ``skip_dj``. Lines that are not JSON objects with the record fields
    are not written; they are counted in ``read`` and listed in ``malformed`` with their line numbers.
    ``progress(1)`` is called once per line read (e.g. ``crf_replaysim.progress.StderrProgress``).
    """
    normalizer = DJNormalizer(recipe, skip_dj=skip_dj, backend=backend)
    summary = NormalizeSummary()
    with open(output_path, "w", encoding="utf-8") as out:
        for record in normalizer._normalize(_read_jsonl(input_path, summary, progress)):
            out.write(json.dumps(record, ensure_ascii=False))
            out.write("\n")
    summary.read = normalizer.stats.read + len(summary.malformed)
    summary.kept = normalizer.stats.kept
    summary.dropped_per_op = dict(normalizer.stats.dropped_per_op)
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
