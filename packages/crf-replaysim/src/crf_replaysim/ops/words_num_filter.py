"""``words_num_filter``: keep records with ``min_num <= num_words <= max_num``, without a tokeniser.

``num_words`` is the number of whitespace-separated words (split on space, newline and tab) that keep at
least one character once special characters are stripped from their ends, as data-juicer 1.6.1's
``WordsNumFilter`` with ``tokenization=False``. ``lang`` only matters to data-juicer's tokeniser.
"""

from __future__ import annotations

import sys
from typing import ClassVar

from crf_replaysim.ops._base import NativeFilter, RecipeError, check_int, check_no_tokenization
from crf_replaysim.ops._text import count_words


class WordsNumFilter(NativeFilter):
    """Word count within ``[min_num, max_num]``."""

    name: ClassVar[str] = "words_num_filter"
    stat_name: ClassVar[str] = "num_words"

    def __init__(
        self,
        *,
        text_key: str,
        lang: str = "en",
        tokenization: bool = False,
        min_num: int = 10,
        max_num: int = sys.maxsize,
        min_closed_interval: bool = True,
        max_closed_interval: bool = True,
        reversed_range: bool = False,
    ) -> None:
        if not isinstance(lang, str):
            raise RecipeError(f"{self.name}: lang must be a language code string such as 'en', got {lang!r}.")
        check_no_tokenization(self.name, tokenization)
        super().__init__(
            text_key=text_key,
            low=check_int(self.name, "min_num", min_num, minimum=0),
            high=check_int(self.name, "max_num", max_num, minimum=0),
            min_closed_interval=min_closed_interval,
            max_closed_interval=max_closed_interval,
            reversed_range=reversed_range,
        )

    def stat(self, text: str) -> float:
        return count_words(text)
