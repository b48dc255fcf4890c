"""Trace replay against a teacher, DPO pair records and their schema, and data-juicer-compatible normalisation. No torch.

Importing this package imports neither data-juicer nor Ray (nor torch): the teacher client, replay,
the pair reader and the normaliser are loaded on first attribute access, and the normaliser imports
data-juicer only for ``backend="data-juicer"``.

Training code reads pair files with :func:`read_pairs` (records or TRL rows, schema-checked, streaming,
bad lines as line-numbered :class:`RecordError`); :func:`example_pairs_path` names the shipped fixtures.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from crf_replaysim._version import __version__
from crf_replaysim.records import SCHEMA_VERSION, DPOPair, NormalizedDPOPair, RecordError

if TYPE_CHECKING:
    from crf_replaysim.normalize import DJNormalizer, normalize_jsonl
    from crf_replaysim.pairs import LoadedPair, example_pairs_path, load_pairs, read_pairs
    from crf_replaysim.replay import ReplaySummary, replay_jsonl
    from crf_replaysim.teacher import TeacherClient
    from crf_replaysim.traces import Trace, iter_traces

__all__ = [
    "SCHEMA_VERSION",
    "DJNormalizer",
    "DPOPair",
    "LoadedPair",
    "NormalizedDPOPair",
    "RecordError",
    "ReplaySummary",
    "TeacherClient",
    "Trace",
    "__version__",
    "example_pairs_path",
    "iter_traces",
    "load_pairs",
    "normalize_jsonl",
    "read_pairs",
    "replay_jsonl",
]

_LAZY = {
    "DJNormalizer": "crf_replaysim.normalize",
    "normalize_jsonl": "crf_replaysim.normalize",
    "LoadedPair": "crf_replaysim.pairs",
    "example_pairs_path": "crf_replaysim.pairs",
    "load_pairs": "crf_replaysim.pairs",
    "read_pairs": "crf_replaysim.pairs",
    "ReplaySummary": "crf_replaysim.replay",
    "replay_jsonl": "crf_replaysim.replay",
    "TeacherClient": "crf_replaysim.teacher",
    "Trace": "crf_replaysim.traces",
    "iter_traces": "crf_replaysim.traces",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'crf_replaysim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
