"""Base classes of the native text ops and the argument checks they share.

A native op mirrors one data-juicer 1.6.1 op of the same name: same arguments, same defaults, same
statistic and the same keep rule. An op may add crf-replaysim *extensions* (:attr:`NativeOp.extensions`):
arguments data-juicer's op lacks, whose defaults give data-juicer's results; a recipe step that sets one
to another value is run natively by the data-juicer backend too (:func:`uses_extensions`). Ops are
stateless; a deduplicator returns a digest and the runner keeps the set of digests already seen.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

from crf_replaysim._checks import is_int, is_number

OpKind = Literal["filter", "mapper", "deduplicator"]

#: Keyword arguments every data-juicer op accepts that only steer its executor (parallelism, batching,
#: hardware). The native backend accepts and ignores them so one recipe serves both backends.
EXECUTOR_ONLY_ARGS: frozenset[str] = frozenset(
    {"batch_size", "num_proc", "accelerator", "turbo", "cpu_required", "mem_required", "num_cpus", "memory"}
)


class RecipeError(ValueError):
    """A recipe (or one op in it) is invalid; the message names the problem and the fix."""


def check_number(op: str, name: str, value: object, *, minimum: float | None = None) -> float:
    """Return ``value`` if it is a real, non-NaN number (not a bool) at least ``minimum``; else raise."""
    if not is_number(value) or math.isnan(value):
        raise RecipeError(f"{op}: {name} must be a number, got {value!r}; write e.g. `{name}: 0.5`.")
    if minimum is not None and value < minimum:
        raise RecipeError(f"{op}: {name} must be >= {minimum}, got {value!r}.")
    return value


def check_int(op: str, name: str, value: object, *, minimum: int) -> int:
    """Return ``value`` if it is an int (not a bool) at least ``minimum``; else raise."""
    if not is_int(value) or value < minimum:
        raise RecipeError(f"{op}: {name} must be an integer >= {minimum}, got {value!r}.")
    return value


def check_bool(op: str, name: str, value: object) -> bool:
    """Return ``value`` if it is a bool; else raise."""
    if not isinstance(value, bool):
        raise RecipeError(f"{op}: {name} must be true or false, got {value!r}.")
    return value


def check_no_tokenization(op: str, tokenization: object) -> None:
    """Reject ``tokenization: true``: data-juicer then downloads a tokenizer model at run time."""
    if check_bool(op, "tokenization", tokenization):
        raise RecipeError(
            f"{op}: tokenization: true needs a tokenizer model that data-juicer downloads at run time; the native "
            "backend splits words on whitespace only. Set `tokenization: false` (the default)."
        )


def check_word_options(op: str, lang: object, tokenization: object) -> None:
    """Check the word ops' ``lang`` (a language code; only data-juicer's tokeniser uses it) and ``tokenization``."""
    if not isinstance(lang, str):
        raise RecipeError(f"{op}: lang must be a language code string such as 'en', got {lang!r}.")
    check_no_tokenization(op, tokenization)


def uses_extensions(cls: type[NativeOp], args: Mapping[str, object]) -> bool:
    """Whether recipe arguments ``args`` set one of ``cls``'s extensions away from its default (data-juicer's
    op of the same name would then compute something else, so the step must run natively)."""
    return any(key in args and args[key] != default for key, default in cls.extensions.items())


class NativeOp(ABC):
    """One recipe step applied to the flat string in ``text_key``."""

    name: ClassVar[str]
    kind: ClassVar[OpKind]
    #: crf-replaysim arguments beyond data-juicer's, with the defaults that reproduce data-juicer.
    extensions: ClassVar[Mapping[str, object]] = {}

    def __init__(self, *, text_key: str) -> None:
        self.text_key = text_key

    @classmethod
    def accepted_args(cls) -> list[str]:
        """The keyword arguments a recipe step of this op may set (``text_key`` included)."""
        return [p for p in inspect.signature(cls.__init__).parameters if p != "self"]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(text_key={self.text_key!r})"


@dataclass(frozen=True)
class Bounds:
    """A filter's range arguments: data-juicer's names and defaults, and whether they are counts (ints >= 0)."""

    low: str
    low_default: float
    high: str
    high_default: float
    integer: bool = False


#: The closure arguments every data-juicer filter takes, with their defaults.
INTERVAL_ARGS: Mapping[str, bool] = {"min_closed_interval": True, "max_closed_interval": True, "reversed_range": False}


class NativeFilter(NativeOp):
    """Keep a record when ``stat(text)`` lies in ``[min, max]`` (data-juicer's ``Filter.get_keep_boolean``).

    Table-driven: a subclass declares its range arguments (:attr:`bounds`), its own arguments with their
    defaults (:attr:`options`, checked by :meth:`check_options`) and :meth:`stat`; the constructor takes
    ``text_key`` plus any of :meth:`arguments` as keywords, as data-juicer's op of the same name does.

    ``min_closed_interval`` / ``max_closed_interval`` switch each bound between ``>=``/``<=`` and ``>``/``<``;
    ``reversed_range`` keeps the complement instead. As in data-juicer's code, both closures are flipped first,
    so with the default closed bounds the reversed filter keeps ``value <= min or value >= max`` (data-juicer's
    docstring says the open complement; parity follows its code).
    """

    kind: ClassVar[OpKind] = "filter"
    #: data-juicer's ``StatsKeys`` name of the statistic (stats are cached under it per record).
    stat_name: ClassVar[str]
    #: The range arguments (``min_ratio``/``max_ratio``, ``min_len``/``max_len``, ...).
    bounds: ClassVar[Bounds]
    #: The op's own arguments besides the range and closures, with data-juicer's defaults.
    options: ClassVar[Mapping[str, object]] = {}

    def __init__(self, *, text_key: str, **args: object) -> None:
        super().__init__(text_key=text_key)
        defaults = self.arguments()
        unknown = sorted(set(args) - set(defaults))
        if unknown:
            raise RecipeError(
                f"{self.name}: unknown argument(s) {', '.join(unknown)}; it accepts {', '.join(self.accepted_args())}."
            )
        values = {**defaults, **args}
        self.check_options(values)
        b = self.bounds
        if b.integer:
            low: float = check_int(self.name, b.low, values[b.low], minimum=0)
            high: float = check_int(self.name, b.high, values[b.high], minimum=0)
        else:
            low = check_number(self.name, b.low, values[b.low])
            high = check_number(self.name, b.high, values[b.high])
        min_closed, max_closed, reversed_range = (check_bool(self.name, k, values[k]) for k in INTERVAL_ARGS)
        if low > high and not reversed_range:
            raise RecipeError(
                f"{self.name}: the lower bound {low!r} is above the upper bound {high!r}, so every record would be "
                "dropped; swap them (or set reversed_range: true to keep values outside the range)."
            )
        self.low = low
        self.high = high
        self.reversed_range = reversed_range
        self.min_closed = min_closed != reversed_range
        self.max_closed = max_closed != reversed_range

    @classmethod
    def arguments(cls) -> dict[str, object]:
        """Every argument besides ``text_key``, with its default, in data-juicer's order."""
        b = cls.bounds
        return {**cls.options, **cls.extensions, b.low: b.low_default, b.high: b.high_default, **INTERVAL_ARGS}

    @classmethod
    def accepted_args(cls) -> list[str]:
        return ["text_key", *cls.arguments()]

    def check_options(self, values: Mapping[str, object]) -> None:
        """Check (and keep) the values of :attr:`options`; the default has none to check."""

    @abstractmethod
    def stat(self, text: str) -> float:
        """The statistic data-juicer stores under :attr:`stat_name`."""

    def keep_value(self, value: float) -> bool:
        """Whether a record with statistic ``value`` is kept."""
        keep = value >= self.low if self.min_closed else value > self.low
        if keep:
            keep = value <= self.high if self.max_closed else value < self.high
        return keep != self.reversed_range

    def keep(self, text: str) -> bool:
        """Whether a record whose ``text_key`` holds ``text`` is kept."""
        return self.keep_value(self.stat(text))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(text_key={self.text_key!r}, low={self.low!r}, high={self.high!r})"


class NativeMapper(NativeOp):
    """Rewrite the string in ``text_key``."""

    kind: ClassVar[OpKind] = "mapper"

    @abstractmethod
    def apply(self, text: str) -> str:
        """The rewritten text."""


class NativeDeduplicator(NativeOp):
    """Drop a record whose digest was already seen among the records that reached this op."""

    kind: ClassVar[OpKind] = "deduplicator"

    @abstractmethod
    def digest(self, text: str) -> bytes:
        """The value two records must share to count as duplicates."""
