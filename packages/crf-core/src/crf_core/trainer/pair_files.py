"""Trace-replay pair files, read through crf-replaysim's schema-checked reader (``crf_replaysim.read_pairs``).

Every format crf-replaysim reads is accepted: its own records (``schema_version`` 1.x) and TRL's standard and
conversational preference rows. A bad line (bad JSON or encoding, wrong schema, a newer major schema version) is
skipped and reported with its line number, or, with ``strict``, fails the run. Chat pairs keep their conversation:
``prompt_messages``, ``chosen_messages`` and ``rejected_messages`` (tool calls and tool results included) and the
trace's tool schemas (``meta.tools``, as ``tools``), rendered by ``crf_core.trainer.pairs``; TRL standard rows
train on the flat prompt as written.
Precomputed reference log-probs may ride in a record's ``meta`` as ``ref_chosen_logps``/``ref_rejected_logps``.
crf-replaysim's typed ``LoadedPair`` becomes the trainer's :class:`~crf_core.trainer.pairs.PairRecord` directly.
"""

from __future__ import annotations

import logging
import os

from crf_core.trainer.pairs import PairRecord

__all__ = ["read_pair_file"]

logger = logging.getLogger(__name__)


def read_pair_file(path: str | os.PathLike[str], *, strict: bool = False) -> list[PairRecord]:
    """The trainer's records (``prompt``/``chosen``/``rejected`` and, for chat pairs, the three message lists and
    ``tools``) of a pair file; bad lines are logged and skipped (``strict``: the first raises
    ``crf_replaysim.RecordError``)."""
    from crf_replaysim import RecordError, read_pairs

    records: list[PairRecord] = []
    bad: list[RecordError] = []
    for item in read_pairs(path, strict=strict):
        if isinstance(item, RecordError):
            bad.append(item)
            continue
        records.append(PairRecord.from_loaded(item, len(records)))
    if bad:
        shown = "; ".join(str(err) for err in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        logger.warning(
            "%s: skipped %d bad line(s): %s%s. Set trace_replay_strict=True to fail instead",
            os.fspath(path),
            len(bad),
            shown,
            more,
        )
    return records
