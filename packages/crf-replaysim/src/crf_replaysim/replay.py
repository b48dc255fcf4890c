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
with the number of decision points handled so far.

Nothing is lost: ``output_path`` naming the traces file (any path, symlink or hard link) is refused
before anything is opened; a bad trace line (bad JSON or UTF-8, lone surrogate, too deep, too long,
wrong schema) is listed by number and skipped; a reply that cannot form a pair fails only its point, and
a point whose pair could never be written (trace ``meta`` or ``tools`` nested too deep to fit in a pair's
``meta``, a recorded action that cannot be chosen, a pair longer than the readers' line limit) fails
before its request is sent.
Pairs go to a hidden partial file renamed over ``output_path`` at the end, so an error or Ctrl-C
leaves the previous output as it was, and the run's state (see :mod:`crf_replaysim._replay_state`)
lets the same command resume: points already answered are not asked again, and with a ``cache_dir``
neither are replies that arrived but were not yet written. A second replay into the same output is
refused while the first runs.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from crf_replaysim._checks import is_int
from crf_replaysim._replay_state import ReplayBusyError, ReplayState, ReplayStateError, file_sha256, state_paths
from crf_replaysim.jsonl import DEFAULT_MAX_LINE_BYTES, check_output
from crf_replaysim.messages import action_key
from crf_replaysim.records import DPOPair, RecordError
from crf_replaysim.teacher import TeacherClient, TeacherError, TeacherHTTPError, TeacherReply
from crf_replaysim.traces import MalformedLine, Trace, iter_traces

__all__ = [
    "CHOSEN_SOURCES",
    "FATAL_STATUSES",
    "ChosenSource",
    "ReplayBusyError",
    "ReplayStateError",
    "ReplaySummary",
    "build_pair",
    "pair_line",
    "replay_jsonl",
    "replay_jsonl_async",
    "replay_state_paths",
    "unwritable_point",
]

FATAL_STATUSES = frozenset({301, 302, 303, 307, 308, 401, 403, 404})
"""HTTP statuses that would fail every request the same way: replay stops at the first one."""

replay_state_paths = state_paths

ChosenSource = Literal["teacher", "recorded"]
"""Which action of a decision point is preferred: the teacher's, or the recorded (student's) one."""
CHOSEN_SOURCES: tuple[ChosenSource, ...] = get_args(ChosenSource)


@dataclass
class ReplaySummary:
    """What a replay run did. ``failed`` rows are ``(line, trace_id, turn, reason)``.

    ``decision_points``, ``pairs_written`` (lines of the output) and ``identical`` cover the whole output,
    ``resumed`` of those points an interrupted earlier run had finished; the teacher counters and the
    token totals (``usage`` of every completion received over the network this run, those that failed
    their point included: what was paid) cover this run only.
    """

    traces_read: int = 0
    decision_points: int = 0
    pairs_written: int = 0
    identical: int = 0
    failed: list[tuple[int, str, int, str]] = field(default_factory=list)
    malformed: list[tuple[int, str]] = field(default_factory=list)
    resumed: int = 0
    teacher_requests: int = 0
    cache_hits: int = 0
    deduplicated: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def format(self) -> str:
        """Closing summary for the CLI (one fact per line, every malformed line and failure listed)."""
        lines = [
            f"traces read:      {self.traces_read}",
            f"decision points:  {self.decision_points}",
            f"pairs written:    {self.pairs_written}",
            f"identical (teacher == recorded, skipped unless --keep-identical): {self.identical}",
            f"resumed:          {self.resumed} (finished by an interrupted run, not asked again)",
            f"teacher requests: {self.teacher_requests} (cache hits {self.cache_hits}, "
            f"shared in flight {self.deduplicated}, retries {self.retries})",
            f"teacher tokens:   prompt {self.prompt_tokens}, completion {self.completion_tokens} (paid this run)",
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

    ``meta`` records the teacher model, the reply's ``usage``, which side is which, the trace's line,
    its own meta and its tools (so a TRL export can hand them to the chat template), plus ``extra_meta``.
    """
    if chosen not in CHOSEN_SOURCES:
        raise ValueError(f"chosen must be 'teacher' or 'recorded', got {chosen!r}")
    if not 1 <= turn < len(trace.messages) or trace.messages[turn]["role"] != "assistant":
        raise ValueError(f"turn {turn} of trace {trace.trace_id!r} is not an assistant decision point")
    meta = {
        "source": "crf-replaysim replay",
        "teacher_model": teacher_model,
        "teacher_reply_model": reply.model,
        "teacher_finish_reason": reply.finish_reason,
        "teacher_usage": reply.usage,
        "chosen_source": chosen,
        "rejected_source": "recorded" if chosen == "teacher" else "teacher",
        "trace_line": trace.line,
        "trace_meta": trace.meta,
        **({"tools": trace.tools} if trace.tools else {}),
        **(extra_meta or {}),
    }
    teacher, recorded = [dict(reply.message)], [dict(trace.messages[turn])]
    return DPOPair(
        prompt_messages=[dict(m) for m in trace.messages[:turn]],
        chosen_messages=teacher if chosen == "teacher" else recorded,
        rejected_messages=recorded if chosen == "teacher" else teacher,
        trace_id=trace.trace_id,
        turn=turn,
        meta=meta,
    )


_STAND_IN = TeacherReply({"role": "assistant", "content": "stand-in"}, None, None, None, cached=False)


def pair_line(pair: DPOPair) -> bytes:
    """The output line of ``pair`` (its dj record as JSON, newline-terminated)."""
    return (json.dumps(pair.to_dj_record(), ensure_ascii=False) + "\n").encode("utf-8")


def unwritable_point(trace: Trace, turn: int, *, teacher_model: str, chosen: ChosenSource) -> str | None:
    """Why no pair of ``trace`` at ``turn`` could be written whatever the teacher answers, else ``None``.

    Builds the pair with a short stand-in for the teacher's action, so everything the trace contributes (its
    context, meta and tools inside the pair's meta, the recorded action as the chosen side) is checked, and
    its line length against the readers' limit, before a request is paid for.
    """
    try:
        line = pair_line(build_pair(trace, turn, _STAND_IN, teacher_model=teacher_model, chosen=chosen))
    except (RecordError, UnicodeEncodeError) as err:
        return f"no pair can be written for this point (checked before asking the teacher): {err}"
    if len(line) > DEFAULT_MAX_LINE_BYTES:
        return (
            f"its pair would be a {len(line)}-byte line, longer than readers accept ({DEFAULT_MAX_LINE_BYTES}); "
            "not asked. Fix: shorten the trace (its context is repeated in every pair)"
        )
    return None


def _check_options(chosen: str, max_pending: int | None) -> None:
    if chosen not in CHOSEN_SOURCES:
        raise ValueError(f"chosen must be 'teacher' or 'recorded', got {chosen!r}")
    if max_pending is not None and (not is_int(max_pending) or max_pending < 1):
        raise ValueError(f"max_pending must be None or an int >= 1, got {max_pending!r}")


def _fingerprint(traces_path: Path, client: TeacherClient, chosen: str, keep_identical: bool) -> dict[str, Any]:
    """What a resumed run must share with the interrupted one (the journal header)."""
    settings = {
        "chat_url": client.chat_url,
        "model": client.model,
        "request": client.request_body([{"role": "user", "content": ""}]) | {"messages": None},
        "null_content": client.null_content,
        "chosen": chosen,
        "keep_identical": keep_identical,
    }
    return {
        "journal": "crf-replaysim replay journal",
        "version": 1,
        "traces_sha256": file_sha256(traces_path),
        "settings": json.loads(json.dumps(settings, sort_keys=True, default=str)),
    }


async def replay_jsonl_async(
    traces_path: str | Path,
    output_path: str | Path,
    *,
    client: TeacherClient,
    chosen: ChosenSource = "teacher",
    keep_identical: bool = False,
    max_pending: int | None = None,
    progress: Callable[[int], None] | None = None,
    resume: bool = True,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> ReplaySummary:
    """Async :func:`replay_jsonl` for callers already inside an event loop (does not close ``client``)."""
    _check_options(chosen, max_pending)
    if not isinstance(client, TeacherClient):
        raise TypeError(f"client must be a TeacherClient, got {type(client).__name__}")
    traces_path, output_path = Path(traces_path), Path(output_path)
    check_output(output_path, [traces_path])
    if not traces_path.is_file():
        raise FileNotFoundError(f"traces file {traces_path} does not exist")
    for hidden in state_paths(output_path):
        check_output(hidden, [traces_path])
    window = max_pending or 4 * client.max_concurrency
    summary = ReplaySummary()
    before = client.stats.snapshot()
    state = ReplayState(output_path, _fingerprint(traces_path, client, chosen, keep_identical))
    state.open(resume=resume)
    pending: deque[tuple[Trace, int, asyncio.Task[TeacherReply]]] = deque()
    done = [0]  # decision points handled, for progress(done)

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0])

    async def write_head() -> None:
        trace, turn, task = pending.popleft()
        try:
            reply = await task
            same = action_key(reply.message) == action_key(trace.messages[turn])
            line = None
            if keep_identical or not same:
                extra = {"identical": same} if keep_identical else None
                pair = build_pair(trace, turn, reply, teacher_model=client.model, chosen=chosen, extra_meta=extra)
                line = pair_line(pair)
        except TeacherHTTPError as err:
            if err.status in FATAL_STATUSES:
                raise
            failure: str | None = str(err)
        except (TeacherError, RecordError, UnicodeEncodeError) as err:
            failure = str(err) if isinstance(err, TeacherError) else f"the reply cannot form a pair: {err}"
        else:
            failure = None
            state.record(trace.line, turn, trace.trace_id, "pair" if line else "identical", line)
        if failure is not None:
            summary.failed.append((trace.line, trace.trace_id, turn, failure))
            state.record(trace.line, turn, trace.trace_id, "failed")
        tick()

    finished = False
    try:
        for item in iter_traces(traces_path, max_line_bytes=max_line_bytes):
            if isinstance(item, MalformedLine):
                summary.malformed.append((item.line, item.reason))
                continue
            summary.traces_read += 1
            for turn in item.decision_points():
                summary.decision_points += 1
                if state.finished(item.line, turn):
                    summary.resumed += 1
                    tick()
                    continue
                problem = unwritable_point(item, turn, teacher_model=client.model, chosen=chosen)
                if problem is not None:
                    summary.failed.append((item.line, item.trace_id, turn, problem))
                    state.record(item.line, turn, item.trace_id, "failed")
                    tick()
                    continue
                while len(pending) >= window:
                    await write_head()
                task = asyncio.ensure_future(client.complete(item.messages[:turn], item.tools))
                pending.append((item, turn, task))
            while pending and pending[0][2].done():
                await write_head()
        while pending:
            await write_head()
        state.finish()
        finished = True
    finally:
        for _, _, task in pending:
            task.cancel()
        await asyncio.gather(*(t for _, _, t in pending), return_exceptions=True)
        if not finished:
            state.close(keep=bool(state.done))
    summary.failed.sort(key=lambda row: (row[0], row[2]))  # points refused before asking were listed early
    summary.pairs_written = len(state.pair_keys)
    summary.identical = sum(1 for outcome in state.done.values() if outcome == "identical")
    used = client.stats.since(before)
    summary.teacher_requests = used.requests
    summary.cache_hits = used.cache_hits
    summary.retries = used.retries
    summary.deduplicated = used.deduplicated
    summary.prompt_tokens = used.prompt_tokens
    summary.completion_tokens = used.completion_tokens
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
    resume: bool = True,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> ReplaySummary:
    """Replay every trace of ``traces_path`` against ``client`` and write dj-record pairs to ``output_path``.

    Returns a :class:`ReplaySummary`. Malformed trace lines and teacher failures after retries are
    listed there (with line numbers), never dropped silently; a redirect or HTTP 401/403/404 aborts
    the run and leaves ``output_path`` untouched. An interrupted or aborted run keeps its state and
    the next call with the same traces and settings resumes it (``resume=False``: discard the state
    and start over; other traces or settings raise :class:`ReplayStateError`). Runs its own event
    loop and closes the client's connections at the end; inside a running loop use
    :func:`replay_jsonl_async`.
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
                resume=resume,
                max_line_bytes=max_line_bytes,
            )
        finally:
            await client.aclose()

    return asyncio.run(run())
