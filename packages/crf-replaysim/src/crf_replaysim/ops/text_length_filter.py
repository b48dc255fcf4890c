"""``text_length_filter``: keep records whose text has ``min_len <= len(text) <= max_len`` characters.

Statistic ``text_len = len(text)`` (Unicode code points), as data-juicer 1.6.1's ``TextLengthFilter``.
"""

from __future__ import annotations

import sys
from typing import ClassVar

from crf_replaysim.ops._base import Bounds, NativeFilter


class TextLengthFilter(NativeFilter):
    """Length in characters within ``[min_len, max_len]``."""

    name: ClassVar[str] = "text_length_filter"
    stat_name: ClassVar[str] = "text_len"
    bounds: ClassVar[Bounds] = Bounds("min_len", 10, "max_len", sys.maxsize, integer=True)

    def stat(self, text: str) -> float:
        return len(text)
