"""JSON from the store, parsed so that nothing malformed escapes as anything but `CorruptObjectError`."""

from __future__ import annotations

import json
from typing import Any

from crf_diloco.errors import CorruptObjectError

__all__ = ["parse_json_object"]


def parse_json_object(blob: bytes, key: str) -> dict[str, Any]:
    """``blob`` as a JSON object, or `CorruptObjectError` naming ``key`` (bad UTF-8, bad JSON, too deep, not an object)."""
    try:
        obj = json.loads(blob)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CorruptObjectError(f"{key}: not valid JSON ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise CorruptObjectError(f"{key}: expected a JSON object, got {type(obj).__name__}")
    return obj
