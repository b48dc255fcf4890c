"""``words_num_filter``: keep records with ``min_num <= num_words <= max_num``, without a tokeniser.

``num_words`` is the number of whitespace-separated words (split on space, newline and tab) that keep at
least one character once special characters are stripped from their ends, as data-juicer 1.6.1's
``WordsNumFilter`` with ``tokenization=False``. ``lang`` only matters to data-juicer's tokeniser.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import ClassVar

from crf_replaysim.ops._base import Bounds, NativeFilter, check_word_options
from crf_replaysim.ops._text import count_words


class WordsNumFilter(NativeFilter):
    """Word count within ``[min_num, max_num]``."""

    name: ClassVar[str] = "words_num_filter"
    stat_name: ClassVar[str] = "num_words"
    bounds: ClassVar[Bounds] = Bounds("min_num", 10, "max_num", sys.maxsize, integer=True)
    options: ClassVar[Mapping[str, object]] = {"lang": "en", "tokenization": False}

    def check_options(self, values: Mapping[str, object]) -> None:
        check_word_options(self.name, values["lang"], values["tokenization"])

    def stat(self, text: str) -> float:
        return count_words(text)
