"""``text_length_filter``: keep records whose text has ``min_len <= len(text) <= max_len`` characters.

Statistic ``text_len = len(text)`` (Unicode code points), as data-juicer 1.6.1's ``TextLengthFilter``.
"""

from __future__ import annotations

import sys
from typing import ClassVar

from crf_replaysim.ops._base import NativeFilter, check_int


class TextLengthFilter(NativeFilter):
    """Length in characters within ``[min_len, max_len]``."""

    name: ClassVar[str] = "text_length_filter"
    stat_name: ClassVar[str] = "text_len"

    def __init__(
        self,
        *,
        text_key: str,
        min_len: int = 10,
        max_len: int = sys.maxsize,
        min_closed_interval: bool = True,
        max_closed_interval: bool = True,
        reversed_range: bool = False,
    ) -> None:
        super().__init__(
            text_key=text_key,
            low=check_int(self.name, "min_len", min_len, minimum=0),
            high=check_int(self.name, "max_len", max_len, minimum=0),
            min_closed_interval=min_closed_interval,
            max_closed_interval=max_closed_interval,
            reversed_range=reversed_range,
        )

    def stat(self, text: str) -> float:
        return len(text)
