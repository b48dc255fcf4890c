"""``alphanumeric_filter``: keep records whose alphanumeric ratio is in ``[min_ratio, max_ratio]``.

``alnum_ratio = #{c in text : c.isalnum()} / len(text)`` (``0.0`` for an empty text), as data-juicer
1.6.1's ``AlphanumericFilter`` with ``tokenization=False``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import ClassVar

from crf_replaysim.ops._base import Bounds, NativeFilter, check_no_tokenization
from crf_replaysim.ops._text import count_alnum


class AlphanumericFilter(NativeFilter):
    """Alphanumeric-character ratio within ``[min_ratio, max_ratio]``."""

    name: ClassVar[str] = "alphanumeric_filter"
    stat_name: ClassVar[str] = "alnum_ratio"
    bounds: ClassVar[Bounds] = Bounds("min_ratio", 0.25, "max_ratio", sys.maxsize)
    options: ClassVar[Mapping[str, object]] = {"tokenization": False}

    def check_options(self, values: Mapping[str, object]) -> None:
        check_no_tokenization(self.name, values["tokenization"])

    def stat(self, text: str) -> float:
        return count_alnum(text) / len(text) if text else 0.0
