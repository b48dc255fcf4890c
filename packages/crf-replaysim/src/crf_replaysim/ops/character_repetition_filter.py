"""``character_repetition_filter``: keep records whose character n-gram repetition ratio is in range.

With ``n = rep_len`` and ``f_1 >= f_2 >= ...`` the counts of the ``d`` distinct character n-grams of the
text (``T = sum f_i = len(text) - n + 1`` of them), ``s`` the number of n-grams seen exactly once and
``k = min(floor(sqrt(d)), d - s)``::

    char_rep_ratio = (f_1 + ... + f_k) / T        (0.0 when the text is shorter than n)

as data-juicer 1.6.1's ``CharacterRepetitionFilter`` (from the BigScience / HF text-data-filtering code).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from typing import ClassVar

from crf_replaysim.ops._base import NativeFilter, check_int, check_number


class CharacterRepetitionFilter(NativeFilter):
    """Character n-gram repetition ratio within ``[min_ratio, max_ratio]``."""

    name: ClassVar[str] = "character_repetition_filter"
    stat_name: ClassVar[str] = "char_rep_ratio"

    def __init__(
        self,
        *,
        text_key: str,
        rep_len: int = 10,
        min_ratio: float = 0.0,
        max_ratio: float = 0.5,
        min_closed_interval: bool = True,
        max_closed_interval: bool = True,
        reversed_range: bool = False,
    ) -> None:
        self.rep_len = check_int(self.name, "rep_len", rep_len, minimum=1)
        super().__init__(
            text_key=text_key,
            low=check_number(self.name, "min_ratio", min_ratio),
            high=check_number(self.name, "max_ratio", max_ratio),
            min_closed_interval=min_closed_interval,
            max_closed_interval=max_closed_interval,
            reversed_range=reversed_range,
        )

    def stat(self, text: str) -> float:
        n = self.rep_len
        total = len(text) - n + 1
        if total <= 0:
            return 0.0
        counts = Counter(map(text.__getitem__, map(slice, range(total), range(n, total + n)))).values()
        distinct = len(counts)
        if distinct == total:  # every n-gram occurs once: nothing repeats
            return 0.0
        singles = list(counts).count(1)
        k = min(math.isqrt(distinct), distinct - singles)
        return sum(heapq.nlargest(k, counts)) / total if k > 0 else 0.0
