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
from collections.abc import Mapping
from typing import ClassVar

from crf_replaysim.ops._base import Bounds, NativeFilter, check_int


class CharacterRepetitionFilter(NativeFilter):
    """Character n-gram repetition ratio within ``[min_ratio, max_ratio]``."""

    name: ClassVar[str] = "character_repetition_filter"
    stat_name: ClassVar[str] = "char_rep_ratio"
    bounds: ClassVar[Bounds] = Bounds("min_ratio", 0.0, "max_ratio", 0.5)
    options: ClassVar[Mapping[str, object]] = {"rep_len": 10}

    rep_len: int

    def check_options(self, values: Mapping[str, object]) -> None:
        self.rep_len = check_int(self.name, "rep_len", values["rep_len"], minimum=1)

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
