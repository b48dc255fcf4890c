"""``alphanumeric_filter``: keep records whose alphanumeric ratio is in ``[min_ratio, max_ratio]``.

``alnum_ratio = #{c in text : c.isalnum()} / len(text)`` (``0.0`` for an empty text), as data-juicer
1.6.1's ``AlphanumericFilter`` with ``tokenization=False``.
"""

from __future__ import annotations

import sys
from typing import ClassVar

from crf_replaysim.ops._base import NativeFilter, check_no_tokenization, check_number
from crf_replaysim.ops._text import count_alnum


class AlphanumericFilter(NativeFilter):
    """Alphanumeric-character ratio within ``[min_ratio, max_ratio]``."""

    name: ClassVar[str] = "alphanumeric_filter"
    stat_name: ClassVar[str] = "alnum_ratio"

    def __init__(
        self,
        *,
        text_key: str,
        tokenization: bool = False,
        min_ratio: float = 0.25,
        max_ratio: float = sys.maxsize,
        min_closed_interval: bool = True,
        max_closed_interval: bool = True,
        reversed_range: bool = False,
    ) -> None:
        check_no_tokenization(self.name, tokenization)
        super().__init__(
            text_key=text_key,
            low=check_number(self.name, "min_ratio", min_ratio),
            high=check_number(self.name, "max_ratio", max_ratio),
            min_closed_interval=min_closed_interval,
            max_closed_interval=max_closed_interval,
            reversed_range=reversed_range,
        )

    def stat(self, text: str) -> float:
        return count_alnum(text) / len(text) if text else 0.0
