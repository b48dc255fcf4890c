"""``special_characters_filter``: keep records whose special-character ratio is in ``[min_ratio, max_ratio]``.

``special_char_ratio = #{c in text : c special} / len(text)`` (``0.0`` for an empty text), where *special*
is data-juicer 1.6.1's set: ASCII punctuation, digits and whitespace, a list of typographic symbols and
every single-code-point emoji. Whitespace counts, so ordinary prose scores about 0.2-0.3 and code more.
"""

from __future__ import annotations

from typing import ClassVar

from crf_replaysim.ops._base import Bounds, NativeFilter
from crf_replaysim.ops._text import count_special


class SpecialCharactersFilter(NativeFilter):
    """Special-character ratio within ``[min_ratio, max_ratio]``."""

    name: ClassVar[str] = "special_characters_filter"
    stat_name: ClassVar[str] = "special_char_ratio"
    bounds: ClassVar[Bounds] = Bounds("min_ratio", 0.0, "max_ratio", 0.25)

    def stat(self, text: str) -> float:
        return count_special(text) / len(text) if text else 0.0
