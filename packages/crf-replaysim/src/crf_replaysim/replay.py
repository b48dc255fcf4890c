"""Trace replay: ask a teacher what it would do at each assistant decision point of each trace.

For a trace with messages ``m[0..n)`` and each assistant message ``m[t]`` with ``t >= 1`` (a
decision point), the teacher is asked for its action given ``m[:t]`` (and the trace's tools). The
pair is ``prompt_messages = m[:t]``, ``chosen_messages = [teacher action]``,
``rejected_messages = [m[t]]`` with ``trace_id`` and ``turn = t``; ``chosen="recorded"`` swaps
the two sides. When both actions are the same (same text, same tool calls with equal JSON
arguments; see ``messages.action_key``) there is no preference to learn: the point is counted as
*identical* and skipped, unless ``keep_identical=True``.

Streaming: traces are read one line at a time and at most ``max_pending`` teacher requests are
outstanding; pairs are written in input order (trace, then turn). ``progress(n)`` is called
with the number of decision points handled so far. Output goes to a temporary
file renamed over ``output_path`` on success, so a failed run never leaves a half-written file
that looks finished.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from crf_replaysim.messages import action_key
from crf_replaysim.records import DPOPair, _dpo_pair_to_dj_record
from crf_replaysim.teacher import TeacherClient, TeacherError, TeacherHTTPError, TeacherReply
from crf_replaysim.traces import MalformedLine, Trace, iter_traces

__all__ = ["FATAL_STATUSES", "ReplaySummary", "build_pair", "replay_jsonl", "replay_jsonl_async"]

FATAL_STATUSES = frozenset({401, 403, 404})
"""HTTP statuses that would fail every request the same way: replay stops at the first one."""

ChosenSource = Literal["teacher", "recorded"]


@dataclass
class ReplaySummary:
    """What a replay run did. ``failed`` rows are ``(line, trace_id, turn, reason)``."""

    traces_read: int = 0
    decision_points: int = 0
    pairs_written: int = 0
    identical: int = 0
    failed: list[tuple[int, str, int, str]] = field(default_factory=list)
    malformed: list[tuple[int, str]] = field(default_factory=list)
    teacher_requests: int = 0
    cache_hits: int = 0
    deduplicated: int = 0
    retries: int = 0

    def format(self) -> str:
        """Closing summary for the CLI (one fact per line, every malformed line and failure listed)."""
        lines = [
            f"traces read:      {self.traces_read}",
            f"decision points:  {self.decision_points}",
            f"pairs written:    {self.pairs_written}",
            f"identical (teacher == recorded, skipped unless --keep-identical): {self.identical}",
            f"teacher requests: {self.teacher_requests} (cache hits {self.cache_hits}, "
            f"shared in flight {self.deduplicated}, retries {self.retries})",
            f"failed points:    {len(self.failed)}",
        ]
        lines += [f"  line {ln} trace {tid!r} turn {turn}: {why}" for ln, tid, turn, why in self.failed]
        lines.append(f"malformed lines:  {len(self.malformed)}")
        lines += [f"  line {ln}: {why}" for ln, why in self.malformed]
        return "\n".join(lines)


def build_pair(
    trace: Trace,
    turn: int,
    reply: TeacherReply,
    *,
    teacher_model: str,
    chosen: ChosenSource = "teacher",
    extra_meta: Mapping[str, Any] | None = None,
) -> DPOPair:
    """The DPO pair at decision point ``turn`` of ``trace`` given the teacher's ``reply``.

    ``meta`` records the teacher model, which side is which, the trace's line and its own meta,
    plus ``extra_meta``.
    """
    if chosen not in ("teacher", "recorded"):
        raise ValueError(f"chosen must be 'teacher' or 'recorded', got {chosen!r}")
    if not 1 <= turn < len(trace.messages) or trace.messages[turn]["role"] != "assistant":
        raise ValueError(f"turn {turn} of trace {trace.trace_id!r} is not an assistant decision point")
    meta = {
        "source": "crf-replaysim replay",
        "teacher_model": teacher_model,
        "teacher_reply_model": reply.model,
        "teacher_finish_reason": reply.finish_reason,
        "chosen_source": chosen,
        "rejected_source": "recorded" if chosen == "teacher" else "teacher",
        "trace_line": trace.line,
        "trace_meta": trace.meta,
        **(extra_meta or {}),
    }
    pair = DPOPair(
        prompt_messages=[dict(m) for m in trace.messages[:turn]],
        chosen_messages=[dict(reply.message)],
        rejected_messages=[dict(trace.messages[turn])],
        trace_id=trace.trace_id,
        turn=turn,
        meta=meta,
    )
    return pair if chosen == "teacher" else pair.swapped()


def _check_options(chosen: str, max_pending: int | None) -> None:
    if chosen not in ("teacher", "recorded"):
        raise ValueError(f"chosen must be 'teacher' or 'recorded', got {chosen!r}")
    if max_pending is not None and (
        isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1
    ):
        raise ValueError(f"max_pending must be None or an int >= 1, got {max_pending!r}")


async def replay_jsonl_async(
    traces_path: str | Path,
    output_path: str | Path,
    *,
    client: TeacherClient,
    chosen: ChosenSource = "teacher",
    keep_identical: bool = False,
    max_pending: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplaySummary:
    """Async :func:`replay_jsonl` for callers already inside an event loop (does not close ``client``)."""
    _check_options(chosen, max_pending)
    if not isinstance(client, TeacherClient):
        raise TypeError(f"client must be a TeacherClient, got {type(client).__name__}")
    traces_path, output_path = Path(traces_path), Path(output_path)
    if not traces_path.is_file():
        raise FileNotFoundError(f"traces file {traces_path} does not exist")
    window = max_pending or 4 * client.max_concurrency
    summary = ReplaySummary()
    before = dict(client.stats)
    pending: deque[tuple[Trace, int, asyncio.Task[TeacherReply]]] = deque()
    output_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = output_path.with_name(f".{output_path.name}.partial")
    done = [0]  # decision points handled, for progress(done)

    async def write_head(out: IO[str]) -> None:
        trace, turn, task = pending.popleft()
        try:
            reply = await task
        except TeacherHTTPError as err:
            if err.status in FATAL_STATUSES:
                raise
            summary.failed.append((trace.line, trace.trace_id, turn, str(err)))
        except TeacherError as err:
            summary.failed.append((trace.line, trace.trace_id, turn, str(err)))
        else:
            same = action_key(reply.message) == action_key(trace.messages[turn])
            summary.identical += same
            if keep_identical or not same:
                extra = {"identical": same} if keep_identical else None
                pair = build_pair(trace, turn, reply, teacher_model=client.model, chosen=chosen, extra_meta=extra)
                out.write(json.dumps(_dpo_pair_to_dj_record(pair), ensure_ascii=False) + "\n")
                summary.pairs_written += 1
        done[0] += 1
        if progress is not None:
            progress(done[0])

    try:
        with open(tmp_path, "w", encoding="utf-8") as out:
            for item in iter_traces(traces_path):
                if isinstance(item, MalformedLine):
                    summary.malformed.append((item.line, item.reason))
                    continue
                summary.traces_read += 1
                for turn in item.decision_points():
                    while len(pending) >= window:
                        await write_head(out)
                    summary.decision_points += 1
                    task = asyncio.ensure_future(client.complete(item.messages[:turn], item.tools))
                    pending.append((item, turn, task))
                while pending and pending[0][2].done():
                    await write_head(out)
            while pending:
                await write_head(out)
        os.replace(tmp_path, output_path)
    finally:
        for _, _, task in pending:
            task.cancel()
        await asyncio.gather(*(t for _, _, t in pending), return_exceptions=True)
        if tmp_path.exists():
            tmp_path.unlink()
    summary.teacher_requests = client.stats["requests"] - before["requests"]
    summary.cache_hits = client.stats["cache_hits"] - before["cache_hits"]
    summary.retries = client.stats["retries"] - before["retries"]
    summary.deduplicated = client.stats["deduplicated"] - before["deduplicated"]
    return summary


def replay_jsonl(
    traces_path: str | Path,
    output_path: str | Path,
    *,
    client: TeacherClient,
    chosen: ChosenSource = "teacher",
    keep_identical: bool = False,
    max_pending: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplaySummary:
    """Replay every trace of ``traces_path`` against ``client`` and write dj-record pairs to ``output_path``.

    Returns a :class:`ReplaySummary`. Malformed trace lines and teacher failures after retries are
    listed there (with line numbers), never dropped silently; an HTTP 401/403/404 aborts the run
    and leaves ``output_path`` untouched. Runs its own event loop and closes the client's
    connections at the end; inside a running loop use :func:`replay_jsonl_async`.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("replay_jsonl was called inside a running event loop; await replay_jsonl_async(...) instead")

    async def run() -> ReplaySummary:
        try:
            return await replay_jsonl_async(
                traces_path,
                output_path,
                client=client,
                chosen=chosen,
                keep_identical=keep_identical,
                max_pending=max_pending,
                progress=progress,
            )
        finally:
            await client.aclose()

    return asyncio.run(run())
