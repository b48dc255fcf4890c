"""The resumable state of one replay: what an interrupted run keeps so the next one does not pay twice.

For an output ``DIR/NAME`` two hidden files live beside it while a replay runs:

* ``DIR/.NAME.partial``: the pair lines written so far, each flushed as soon as its decision point is
  handled (points are handled in input order, so this is a prefix of the final file plus retried ones);
* ``DIR/.NAME.journal``: a header (a fingerprint of the traces file and of every setting that shapes a
  pair: endpoint, model, sampling, ``chosen``, ...) and one line per handled decision point:
  ``{"line": L, "turn": t, "trace_id": ..., "outcome": "pair" | "identical" | "failed"}``.

The journal is locked (``fcntl.flock``) for the whole run, so a second replay into the same output is
refused instead of interleaving with the first. A finished run renames the partial file over the output
(in input order) and deletes the journal. An interrupted or failed run leaves both (unless it handled
nothing); the next run with the same traces and settings skips every point whose outcome was ``pair``
or ``identical``, asks again only for failed and pending points (answered from the response cache when
they had arrived), and writes the complete file. A half-written last line (a kill mid-write) is cut off both
files before the run appends anything, so a second interruption leaves them as readable as the first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, concurrent replays are not detected
    fcntl = None  # type: ignore[assignment]

from crf_replaysim.jsonl import loads_bounded, unique_temp_path

__all__ = ["ReplayBusyError", "ReplayState", "ReplayStateError", "state_paths"]

_JOURNAL_KIND = "crf-replaysim replay journal"
_JOURNAL_VERSION = 1
OUTCOMES = ("pair", "identical", "failed")


class ReplayStateError(RuntimeError):
    """The saved state of an interrupted replay cannot be resumed by this run."""


class ReplayBusyError(ReplayStateError):
    """Another replay is writing the same output."""


def state_paths(output: Path) -> tuple[Path, Path]:
    """``(partial, journal)`` paths of a replay into ``output``."""
    return output.with_name(f".{output.name}.partial"), output.with_name(f".{output.name}.journal")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class ReplayState:
    """Partial output and journal of a replay into ``output`` (see the module docstring)."""

    output: Path
    header: dict[str, Any]
    done: dict[tuple[int, int], str] = field(default_factory=dict)  # (trace line, turn) -> last outcome
    pair_keys: list[tuple[int, int]] = field(default_factory=list)  # order key of each partial line
    _journal: IO[bytes] | None = None
    _partial: IO[bytes] | None = None

    @property
    def partial_path(self) -> Path:
        return state_paths(self.output)[0]

    @property
    def journal_path(self) -> Path:
        return state_paths(self.output)[1]

    def open(self, *, resume: bool) -> None:
        """Lock the journal, then load the saved state (``resume``) or start afresh."""
        self.output.parent.mkdir(parents=True, exist_ok=True)
        journal = open(self.journal_path, "a+b")  # noqa: SIM115 - held open (and locked) until close()
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(journal.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise ReplayBusyError(
                        f"another crf-replaysim replay is writing {str(self.output)!r} (it holds "
                        f"{str(self.journal_path)!r}). Fix: wait for it to finish, or write to another output"
                    ) from None
            journal.seek(0)
            saved = journal.read()
            if resume and b"\n" in saved:  # no complete line: not even the header survived, nothing to resume
                self._load(saved)
                torn = len(saved) - (saved.rfind(b"\n") + 1)
                if torn:  # a kill mid-write: cut the fragment, or the next entry would be glued to it
                    journal.truncate(len(saved) - torn)
            else:
                journal.truncate(0)
                journal.write((json.dumps(self.header, sort_keys=True) + "\n").encode())
                journal.flush()
                self._reset_partial(0)
        except BaseException:
            journal.close()
            raise
        self._journal = journal
        self._partial = open(self.partial_path, "ab")  # noqa: SIM115 - closed in close()

    def _load(self, saved: bytes) -> None:
        complete = saved.split(b"\n")[:-1]  # a last line without "\n" was cut by a kill: ignored
        try:
            header = loads_bounded(complete[0].decode("utf-8")) if complete else None
        except ValueError:  # UnicodeDecodeError included
            header = None
        if not isinstance(header, dict) or header.get("journal") != _JOURNAL_KIND:
            raise ReplayStateError(
                f"{str(self.journal_path)!r} is not a replay journal this version can read. Fix: pass restart=True "
                "(CLI --restart) to discard the interrupted run's state"
            )
        if header != self.header:
            changed = sorted(k for k in set(header) | set(self.header) if header.get(k) != self.header.get(k))
            raise ReplayStateError(
                f"an interrupted replay into {str(self.output)!r} was started with other {', '.join(changed)} "
                "(traces file or settings). Fix: rerun it with the same traces and settings to resume, or pass "
                "restart=True (CLI --restart) to discard its state and start over"
            )
        for number, raw in enumerate(complete[1:], start=2):
            try:
                entry = loads_bounded(raw.decode("utf-8"))
                key = (int(entry["line"]), int(entry["turn"]))
                outcome = entry["outcome"]
                if outcome not in OUTCOMES:
                    raise ValueError(outcome)
            except (ValueError, KeyError, TypeError):
                raise ReplayStateError(
                    f"{str(self.journal_path)!r} line {number} is damaged. Fix: pass restart=True (CLI --restart)"
                ) from None
            self.done[key] = outcome
            if outcome == "pair":
                self.pair_keys.append(key)
        self._reset_partial(len(self.pair_keys))

    def _reset_partial(self, keep_lines: int) -> None:
        """Cut the partial file to its first ``keep_lines`` lines (the ones the journal vouches for)."""
        path = self.partial_path
        if keep_lines == 0:
            path.write_bytes(b"")
            return
        size = 0
        with open(path, "a+b") as fh:
            fh.seek(0)
            for _ in range(keep_lines):
                line = fh.readline()
                if not line.endswith(b"\n"):
                    raise ReplayStateError(
                        f"{str(path)!r} has fewer pairs than its journal records. Fix: pass restart=True "
                        "(CLI --restart); answers already paid for come back from the response cache"
                    )
                size += len(line)
            fh.truncate(size)

    @property
    def handled(self) -> int:
        """Decision points a previous run finished (pair or identical): they are not asked again."""
        return sum(1 for outcome in self.done.values() if outcome != "failed")

    def finished(self, line: int, turn: int) -> str | None:
        """The saved outcome of a point if it needs no new request (``pair``/``identical``), else None."""
        outcome = self.done.get((line, turn))
        return outcome if outcome in ("pair", "identical") else None

    def record(self, line: int, turn: int, trace_id: str, outcome: str, pair_line: bytes | None = None) -> None:
        """Save one handled point (its pair line first, so the journal never vouches for a missing pair)."""
        assert self._journal is not None, "open() first"
        assert self._partial is not None, "open() first"
        if pair_line is not None:
            self._partial.write(pair_line)
            self._partial.flush()
            self.pair_keys.append((line, turn))
        entry = {"line": line, "turn": turn, "trace_id": trace_id, "outcome": outcome}
        self._journal.write((json.dumps(entry, ensure_ascii=False) + "\n").encode())
        self._journal.flush()
        self.done[(line, turn)] = outcome

    def finish(self) -> None:
        """Put the pairs in input order over ``output`` and drop the state."""
        assert self._partial is not None, "open() first"
        self._partial.flush()
        os.fsync(self._partial.fileno())
        self._partial.close()
        if self.pair_keys == sorted(self.pair_keys):
            os.replace(self.partial_path, self.output)
        else:  # a resumed run answered points that had failed before: restore input order
            tmp = unique_temp_path(self.output)
            offsets = []
            with open(self.partial_path, "rb") as src:
                for _ in self.pair_keys:
                    offsets.append(src.tell())
                    src.readline()
                order = sorted(range(len(self.pair_keys)), key=self.pair_keys.__getitem__)
                with open(tmp, "wb") as dst:
                    for index in order:
                        src.seek(offsets[index])
                        dst.write(src.readline())
                    dst.flush()
                    os.fsync(dst.fileno())
            os.replace(tmp, self.output)
            self.partial_path.unlink()
        self._drop_journal()

    def close(self, *, keep: bool) -> None:
        """End a run that did not finish; ``keep`` the state for a later resume, or delete it."""
        if self._partial is not None:
            self._partial.close()
        if not keep:
            with contextlib.suppress(OSError):
                self.partial_path.unlink()
            self._drop_journal()
        elif self._journal is not None:
            self._journal.close()

    def _drop_journal(self) -> None:
        if self._journal is not None:
            with contextlib.suppress(OSError):
                self.journal_path.unlink()  # still locked: no other run can slip in between
            self._journal.close()
            self._journal = None
