"""The ``backend="data-juicer"`` path of :class:`~crf_replaysim.normalize.DJNormalizer`.

Runs the recipe with data-juicer's own ``DefaultExecutor``, in-process, with ``skip_op_error: false``,
``use_cache: false`` and ``open_monitor: false``. Only the flat text columns (and a row number) go through
data-juicer; every other field is taken back from the input record, so nested ``meta`` or message dicts
never meet Arrow's schema inference.

Workaround for data-juicer 1.6.1: a filter caches its statistic in the record's ``__dj__stats__`` under the
op's stats name (``special_char_ratio``, ...) and skips the computation when that name is already there, so
the second copy of a filter on another ``text_key`` (and a filter that runs again after a mapper changed its
field) silently reuses the first value; ``document_deduplicator`` does the same with ``__dj__hash``.
:func:`plan_passes` splits the recipe into the fewest executor passes in which no op meets a stale cache, and
the stats and hash columns are dropped between passes.

data-juicer also installs missing optional packages at run time (``LazyLoader``); here that raises instead,
naming the package to pre-install.

A step that uses a crf-replaysim extension of an op (an argument data-juicer's op lacks, see
:func:`crf_replaysim.ops._base.uses_extensions`) is run by the native op, as a pass of its own between
data-juicer's passes: data-juicer would otherwise ignore the argument and compute something else.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from crf_replaysim._normalize_shared import NormalizeSummary, map_message_text, message_texts, pair_text
from crf_replaysim.ops import NATIVE_OPS, NativeFilter, RecipeError
from crf_replaysim.ops._base import uses_extensions
from crf_replaysim.ops._recipe import FLAT_TEXT_FIELDS, PAIR_FIELD, Recipe, RecipeStep, build_native_op

_ROW = "__crf_row__"
NATIVE_KIND = "native-filter"
"""The kind of a step the data-juicer backend runs with the native op (it uses a crf-replaysim extension)."""
_DJ_COLUMNS = ("__dj__stats__", "__dj__hash")
_EXECUTOR_DEFAULTS = {"np": 1, "use_cache": False, "open_monitor": False, "skip_op_error": False}
_IMPORT_FIX = (
    "Install it with `pip install 'crf-replaysim[dj]'` (py-data-juicer==1.6.1 and aiohttp) and pre-install ray and "
    "CPU torch, which data-juicer otherwise installs at import/run time; or use backend='native'."
)


def _signature(step: RecipeStep) -> tuple[str, str, str]:
    return (step.name, step.text_key, json.dumps(dict(step.args), sort_keys=True, default=str))


def _filters_grouped(steps: Sequence[RecipeStep], kinds: Sequence[str]) -> list[int]:
    """Step indices with each run of consecutive filters reordered (stably) by "layer".

    Filters commute (the kept set is the intersection), so within a run the first configuration of each op
    name goes to layer 0, the second to layer 1, and so on; the chosen-side and rejected-side copies of the
    default recipe then land in two passes instead of alternating.
    """
    order: list[int] = []
    run: list[int] = []

    def flush() -> None:
        seen: dict[str, list[tuple[str, str, str]]] = {}
        layers: dict[int, int] = {}
        for i in run:
            variants = seen.setdefault(steps[i].name, [])
            if _signature(steps[i]) not in variants:
                variants.append(_signature(steps[i]))
            layers[i] = variants.index(_signature(steps[i]))
        order.extend(sorted(run, key=lambda i: layers[i]))
        run.clear()

    for index, kind in enumerate(kinds):
        if kind == "filter":  # a native filter ends the run: it is a pass of its own, in recipe order
            run.append(index)
        else:
            flush()
            order.append(index)
    flush()
    return order


def plan_passes(steps: Sequence[RecipeStep], kinds: Sequence[str]) -> list[list[int]]:
    """Split ``steps`` (with their op ``kinds``) into executor passes free of data-juicer's stale-cache reuse.

    Runs of consecutive filters are first grouped by :func:`_filters_grouped`. A step then starts a new pass
    when, in the current pass, an op of the same name already ran with another ``text_key`` or other
    arguments, or a mapper has rewritten the field it reads since; or when it reads the derived ``pair``
    field after a mapper rewrote prompt, chosen or rejected (``pair`` is rebuilt at the start of each pass).
    """
    passes: list[list[int]] = [[]]
    cached: dict[str, tuple[str, str, str]] = {}  # op name -> signature it computed in this pass
    stale: dict[str, set[str]] = {}  # op name -> fields rewritten since it computed
    mapped: set[str] = set()  # fields rewritten in this pass
    for index in _filters_grouped(steps, kinds):
        step, kind = steps[index], kinds[index]
        if kind == NATIVE_KIND:  # runs outside data-juicer, on the rows as they are: no cache to go stale
            passes += [[index], []]
            cached, stale, mapped = {}, {}, set()
            continue
        if kind == "mapper":
            for fields in stale.values():
                fields.add(step.text_key)
            mapped.add(step.text_key)
        else:
            reads = {step.text_key} | (set(FLAT_TEXT_FIELDS) if step.text_key == PAIR_FIELD else set())
            conflict = step.name in cached and (cached[step.name] != _signature(step) or bool(stale[step.name] & reads))
            if conflict or (step.text_key == PAIR_FIELD and mapped & reads):
                passes.append([])
                cached, stale, mapped = {}, {}, set()
            cached[step.name] = _signature(step)
            stale[step.name] = set()
        passes[-1].append(index)
    return [p for p in passes if p]


def _import_data_juicer() -> Any:
    try:
        import data_juicer  # noqa: F401
        from data_juicer.utils import lazy_loader
    except ImportError as err:
        raise ImportError(
            f"backend='data-juicer' needs data-juicer, which failed to import ({err}). {_IMPORT_FIX}"
        ) from err
    return lazy_loader


@contextlib.contextmanager
def _no_runtime_installs(lazy_loader: Any) -> Iterator[None]:
    """Make data-juicer's ``LazyLoader`` raise instead of pip/uv-installing a missing package."""
    original = lazy_loader.LazyLoader.__dict__["_install_package"]

    def refuse(cls: Any, package_spec: str, pip_args: Any = None) -> None:
        raise ImportError(
            f"data-juicer tried to install {package_spec!r} at run time; crf-replaysim forbids that. "
            f"Pre-install it (`pip install {package_spec}`) in the environment."
        )

    lazy_loader.LazyLoader._install_package = classmethod(refuse)
    try:
        yield
    finally:
        lazy_loader.LazyLoader._install_package = original


def _op_kinds(steps: Sequence[RecipeStep], source: str) -> tuple[list[str], list[Any]]:
    """data-juicer op instances of ``steps`` and their kinds; unknown or non-text ops raise RecipeError."""
    from data_juicer.ops import OPERATORS, load_ops
    from data_juicer.ops.base_op import Deduplicator, Filter, Mapper

    kinds: list[str] = []
    instances: list[Any] = []
    for step in steps:
        native = NATIVE_OPS.get(step.name)
        if native is not None and uses_extensions(native, step.args):
            op = build_native_op(step, NATIVE_OPS, source)
            if not isinstance(op, NativeFilter):
                raise RecipeError(f"{source}: op {step.name!r}: only filters may use crf-replaysim extensions.")
            kinds.append(NATIVE_KIND)
            instances.append(op)
            continue
        if OPERATORS.modules.get(step.name) is None:
            raise RecipeError(f"{source}: unknown op {step.name!r}: data-juicer 1.6.1 has no op of that name.")
        (op,) = load_ops([{step.name: {**step.args, "text_key": step.text_key, "skip_op_error": False}}])
        kind = next(
            (
                k
                for c, k in ((Filter, "filter"), (Mapper, "mapper"), (Deduplicator, "deduplicator"))
                if isinstance(op, c)
            ),
            None,
        )
        if kind is None:
            raise RecipeError(
                f"{source}: op {step.name!r} is not a filter, mapper or deduplicator; it cannot run here."
            )
        if kind == "mapper" and step.text_key == PAIR_FIELD:
            raise RecipeError(f"{source}: mapper {step.name!r} cannot rewrite the derived {PAIR_FIELD!r} field.")
        kinds.append(kind)
        instances.append(op)
    return kinds, instances


def _apply_dj_mapper(op: Any, texts: list[str]) -> list[str]:
    """Run a data-juicer mapper instance on a list of strings (as one batch)."""
    if not texts:
        return texts
    if op.is_batched_op():
        return list(op.process_batched({op.text_key: list(texts)})[op.text_key])
    return [op.process_single({op.text_key: text})[op.text_key] for text in texts]


def _map_messages_with(op: Any, messages: list[Any]) -> list[Any]:
    rewritten = iter(_apply_dj_mapper(op, message_texts(messages)))
    return map_message_text(messages, lambda _text: next(rewritten))


def run_data_juicer(
    recipe: Recipe, records: Iterable[Mapping[str, Any]], stats: NormalizeSummary
) -> Iterator[dict[str, Any]]:
    """Run ``recipe`` over ``records`` with data-juicer's executor; yield the kept records in input order."""
    yield from _execute(recipe, records, stats)


def _execute(recipe: Recipe, records: Iterable[Mapping[str, Any]], stats: NormalizeSummary) -> list[dict[str, Any]]:
    lazy_loader = _import_data_juicer()
    settings = dict(recipe.settings)
    if settings.get("executor_type", "default") != "default":
        raise RecipeError(
            f"{recipe.source}: executor_type {settings['executor_type']!r} is not supported in-process; "
            "the data-juicer backend runs the default executor. Remove executor_type."
        )
    with _no_runtime_installs(lazy_loader):
        from data_juicer.config import get_init_configs
        from data_juicer.core import DefaultExecutor

        kinds, instances = _op_kinds(recipe.steps, recipe.source)
        originals = list(records)
        stats.read = len(originals)
        uses_pair = any(step.text_key == PAIR_FIELD for step in recipe.steps)
        rows = [{_ROW: i, **{f: r[f] for f in FLAT_TEXT_FIELDS}} for i, r in enumerate(originals)]
        stats.dropped_per_op = {}
        with tempfile.TemporaryDirectory(prefix="crf-replaysim-dj-") as work:
            for number, indices in enumerate(plan_passes(recipe.steps, kinds), start=1):
                steps = [recipe.steps[i] for i in indices]
                label = f"data-juicer pass {number}: " + ", ".join(step.label for step in steps)
                if not rows:
                    stats.dropped_per_op[label] = 0
                    continue
                if uses_pair:
                    for row in rows:
                        row[PAIR_FIELD] = pair_text(row)
                if kinds[indices[0]] == NATIVE_KIND:
                    before, native = len(rows), instances[indices[0]]
                    rows = [row for row in rows if native.keep(row[native.text_key])]
                    stats.dropped_per_op[f"native pass {number}: {steps[0].label}"] = before - len(rows)
                    continue
                dataset_path = Path(work) / f"pass{number}.jsonl"
                with dataset_path.open("w", encoding="utf-8") as handle:
                    handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
                config = {
                    **settings,
                    **_EXECUTOR_DEFAULTS,
                    "np": settings.get("np", 1),
                    "project_name": f"crf-replaysim-pass{number}",
                    "dataset_path": str(dataset_path),
                    "export_path": str(Path(work) / f"out{number}" / "out.jsonl"),
                    "work_dir": str(Path(work) / f"out{number}"),
                    "text_keys": steps[0].text_key,
                    "process": [{s.name: {**s.args, "text_key": s.text_key, "skip_op_error": False}} for s in steps],
                }
                result = DefaultExecutor(get_init_configs(config)).run(skip_export=True)
                before = len(rows)
                rows = [{k: v for k, v in row.items() if k not in _DJ_COLUMNS} for row in result.to_list()]
                stats.dropped_per_op[label] = before - len(rows)
        mappers = [op for op, kind in zip(instances, kinds, strict=True) if kind == "mapper"]
        kept: list[dict[str, Any]] = []
        for row in rows:
            record = dict(originals[row[_ROW]])
            for key in FLAT_TEXT_FIELDS:
                record[key] = row[key]
            for op in mappers:
                field = f"{op.text_key}_messages"
                record[field] = _map_messages_with(op, record[field])
            kept.append(record)
        stats.kept = len(kept)
    return kept
