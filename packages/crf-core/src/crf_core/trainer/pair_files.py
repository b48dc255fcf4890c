"""Trace-replay pair files, read through crf-replaysim's schema-checked reader (``crf_replaysim.read_pairs``).

Every format crf-replaysim reads is accepted: its own records (``schema_version`` 1.x) and TRL's standard and
conversational preference rows. A bad line (bad JSON or encoding, wrong schema, a newer major schema version) is
skipped and reported with its line number, or, with ``strict``, fails the run. Chat pairs keep their conversation:
``prompt_messages``, ``chosen_messages`` and ``rejected_messages`` (tool calls and tool results included) and the
trace's tool schemas (``meta.tools``, as ``tools``), rendered by ``crf_core.trainer.pairs``; TRL standard rows
train on the flat prompt as written.
Precomputed reference log-probs may ride in a record's ``meta`` as ``ref_chosen_logps``/``ref_rejected_logps``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["read_pair_file"]

logger = logging.getLogger(__name__)

_REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def read_pair_file(path: str | os.PathLike[str], *, strict: bool = False) -> list[dict[str, Any]]:
    """The trainer's records (``prompt``/``chosen``/``rejected`` and, for chat pairs, the three message lists and
    ``tools``) of a pair file; bad lines are logged and skipped (``strict``: the first raises
    ``crf_replaysim.RecordError``)."""
    from crf_replaysim import RecordError, read_pairs

    records: list[dict[str, Any]] = []
    bad: list[RecordError] = []
    for item in read_pairs(path, strict=strict):
        if isinstance(item, RecordError):
            bad.append(item)
            continue
        pair = item.pair
        record: dict[str, Any] = {"prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected}
        if item.chat:
            record["prompt_messages"] = pair.prompt_messages
            record["chosen_messages"] = pair.chosen_messages
            record["rejected_messages"] = pair.rejected_messages
            tools = pair.meta.get("tools")
            if isinstance(tools, list) and all(isinstance(t, dict) for t in tools):
                record["tools"] = tools
        record.update({key: pair.meta[key] for key in _REFERENCE_KEYS if key in pair.meta})
        records.append(record)
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
