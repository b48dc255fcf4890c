"""On-disk cache of teacher replies, keyed by the SHA-256 of the canonical request (URL + body, never a key).

Layout: ``{cache_dir}/{key[:2]}/{key}.json`` holding ``{"key": key, "response": <decoded reply>}``.
Writes go to a temporary name unique per process and write, then replace the entry, so concurrent
replays can share one cache. Reads and writes are best effort: an unreadable entry is ignored (and
rewritten by the next answer), a failing write logs one warning for the cache's lifetime.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from crf_replaysim.jsonl import unique_temp_path

__all__ = ["ResponseCache", "request_key"]

logger = logging.getLogger(__name__)


def request_key(url: str, body: Mapping[str, Any]) -> str:
    """SHA-256 hex of ``{"url": url, "body": body}`` as canonical JSON (sorted keys, no spaces)."""
    canonical = json.dumps({"url": url, "body": body}, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class ResponseCache:
    """Replies stored under ``directory`` (``None``: no cache; every read misses, every write is dropped)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._warned = False

    def _file(self, key: str) -> Path | None:
        return None if self.directory is None else self.directory / key[:2] / f"{key}.json"

    def read(self, key: str) -> Any:
        """The stored reply for ``key``, or ``None`` (absent, unreadable, or stored under another key)."""
        path = self._file(key)
        try:
            if path is None or not path.is_file():
                return None
            entry = json.loads(path.read_text(encoding="utf-8"))
            if entry.get("key") != key:
                raise ValueError("key mismatch")
            return entry["response"]
        except (ValueError, KeyError, AttributeError, OSError, RecursionError) as err:
            logger.warning("ignoring unreadable cache entry %s (%s); it will be rewritten", path, err)
            return None

    def write(self, key: str, response: Any) -> None:
        """Store a reply; best effort (the reply is paid for and returned even if the cache cannot take it)."""
        path = self._file(key)
        if path is None:
            return
        tmp = unique_temp_path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"key": key, "response": response}, ensure_ascii=False), encoding="utf-8")
            os.replace(tmp, path)
        except (OSError, ValueError) as err:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if not self._warned:
                self._warned = True
                logger.warning(
                    "cannot write the response cache in %s (%s: %s); continuing without caching replies "
                    "(further cache errors are not reported). Fix: point cache_dir (--cache-dir) at a writable "
                    "directory",
                    self.directory,
                    type(err).__name__,
                    err,
                )
