"""``whitespace_normalization_mapper``: strip the text, then turn every unusual whitespace into ``" "``.

The replaced characters are data-juicer 1.6.1's ``VARIOUS_WHITESPACES``: tab, no-break and typographic
spaces (U+2000-U+200A, U+202F, U+205F, U+3000), zero-width characters (U+200B-U+200D, U+2060), U+0084 and
the object replacement character U+FFFC. Newlines are kept; tabs are not (mind code and Makefiles).
"""

from __future__ import annotations

from typing import ClassVar

from crf_replaysim.ops._base import NativeMapper

_VARIOUS_WHITESPACES = (
    0x09, 0x20, 0x84, 0xA0, 0x202F, 0x205F, 0x2060, 0x3000, 0xFFFC,
    *range(0x2000, 0x200B),  # en quad .. hair space
    0x200B, 0x200C, 0x200D,  # zero-width space, non-joiner, joiner
)  # fmt: skip
_TO_SPACE = {cp: " " for cp in _VARIOUS_WHITESPACES}


class WhitespaceNormalizationMapper(NativeMapper):
    """``text.strip()`` with every character of ``VARIOUS_WHITESPACES`` replaced by a space."""

    name: ClassVar[str] = "whitespace_normalization_mapper"

    def apply(self, text: str) -> str:
        return text.strip().translate(_TO_SPACE)
