"""Trace-replay pair files, read through crf-replaysim's schema-checked reader."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["read_pair_file"]


def read_pair_file(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records of a crf-replaysim pair file (JSONL); errors name the file and line."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"trace-replay pair file {str(file)!r} does not exist; write it with crf-replaysim")
    records = []
    with open(file, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{file}:{line_no} is not valid JSON ({exc.msg})") from exc
    return records
