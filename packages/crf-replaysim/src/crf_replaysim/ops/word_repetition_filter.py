"""``word_repetition_filter``: keep records whose word n-gram repetition ratio is in range.

Words are the refined, lower-cased words of ``words_num_filter`` (no tokeniser). With ``n = rep_len`` and
``f_g`` the count of each distinct word n-gram ``g`` (``T = sum f_g``)::

    word_rep_ratio = sum(f_g for f_g > 1) / T      (0.0 when there are fewer than n words)

as data-juicer 1.6.1's ``WordRepetitionFilter`` with ``tokenization=False``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from typing import ClassVar

from crf_replaysim.ops._base import Bounds, NativeFilter, check_int, check_word_options
from crf_replaysim.ops._text import refined_words


class WordRepetitionFilter(NativeFilter):
    """Word n-gram repetition ratio within ``[min_ratio, max_ratio]``."""

    name: ClassVar[str] = "word_repetition_filter"
    stat_name: ClassVar[str] = "word_rep_ratio"
    bounds: ClassVar[Bounds] = Bounds("min_ratio", 0.0, "max_ratio", 0.5)
    options: ClassVar[Mapping[str, object]] = {"lang": "en", "tokenization": False, "rep_len": 10}

    rep_len: int

    def check_options(self, values: Mapping[str, object]) -> None:
        check_word_options(self.name, values["lang"], values["tokenization"])
        self.rep_len = check_int(self.name, "rep_len", values["rep_len"], minimum=1)

    def stat(self, text: str) -> float:
        words = refined_words(text, lower_case=True)
        n = self.rep_len
        total = len(words) - n + 1
        if total <= 0:
            return 0.0
        if n > 1 and len(set(itertools.pairwise(words))) == len(words) - 1:
            return 0.0  # a repeated n-gram starts with a repeated bigram; there is none
        # n-grams as tuples: words never contain a space, so tuples compare as data-juicer's " "-joined strings
        counts = Counter(zip(*(words[i:] for i in range(n)), strict=False)).values()  # ragged on purpose
        return sum(c for c in counts if c > 1) / total
