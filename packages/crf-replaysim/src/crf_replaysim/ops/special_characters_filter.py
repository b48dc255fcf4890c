"""``special_characters_filter``: keep records whose special-character ratio is in ``[min_ratio, max_ratio]``.

``special_char_ratio = #{c in text : c special} / len(text)`` (``0.0`` for an empty text), where *special*
is data-juicer 1.6.1's set: ASCII punctuation, digits and whitespace, a list of typographic symbols and
every single-code-point emoji. Whitespace counts, so ordinary prose scores about 0.2-0.3 and code more:
indentation alone can push a short, ordinary function past 0.5.

crf-replaysim extension ``count_whitespace`` (default ``true``, data-juicer's statistic): with ``false`` the
ratio is taken over the characters that are not whitespace (``str.isspace``), so indentation and line breaks
count neither as special nor towards the length. Code of Python's standard library then scores at most
about 0.6 (median 0.2), junk ("!!!!", emoji floods, digit runs) still 0.8-1.0. The data-juicer backend runs
such a step natively (data-juicer's op has no such argument).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from crf_replaysim.ops._base import Bounds, NativeFilter, check_bool
from crf_replaysim.ops._text import count_special, count_visible_special


class SpecialCharactersFilter(NativeFilter):
    """Special-character ratio within ``[min_ratio, max_ratio]``."""

    name: ClassVar[str] = "special_characters_filter"
    stat_name: ClassVar[str] = "special_char_ratio"
    bounds: ClassVar[Bounds] = Bounds("min_ratio", 0.0, "max_ratio", 0.25)
    extensions: ClassVar[Mapping[str, object]] = {"count_whitespace": True}

    def check_options(self, values: Mapping[str, object]) -> None:
        self.count_whitespace = check_bool(self.name, "count_whitespace", values["count_whitespace"])

    def stat(self, text: str) -> float:
        if self.count_whitespace:
            return count_special(text) / len(text) if text else 0.0
        special, visible = count_visible_special(text)
        return special / visible if visible else 0.0
