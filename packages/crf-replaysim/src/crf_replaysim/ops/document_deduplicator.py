"""``document_deduplicator``: exact deduplication on the MD5 of one text field.

The digest is ``md5(t.strip().encode("utf-8"))`` where ``t`` is the text, lower-cased when ``lowercase``
and with whitespace runs, digit runs and ASCII punctuation removed when ``ignore_non_character``; the first
record with a digest is kept, later ones are dropped (data-juicer 1.6.1's ``DocumentDeduplicator``).
"""

from __future__ import annotations

import hashlib
import string
from typing import Any, ClassVar

from crf_replaysim.ops._base import NativeDeduplicator, check_bool


class DocumentDeduplicator(NativeDeduplicator):
    """Exact-match deduplication on ``text_key``."""

    name: ClassVar[str] = "document_deduplicator"

    def __init__(self, *, text_key: str, lowercase: bool = False, ignore_non_character: bool = False) -> None:
        super().__init__(text_key=text_key)
        self.lowercase = check_bool(self.name, "lowercase", lowercase)
        self.ignore_non_character = check_bool(self.name, "ignore_non_character", ignore_non_character)
        self._non_character: Any = None
        if self.ignore_non_character:
            import regex  # data-juicer's regex engine; imported only when needed

            self._non_character = regex.compile(r"\s+|\d+|[" + regex.escape(string.punctuation) + "]")

    def digest(self, text: str) -> bytes:
        if self.lowercase:
            text = text.lower()
        if self.ignore_non_character:
            text = self._non_character.sub("", text)
        return hashlib.md5(text.strip().encode("utf-8"), usedforsecurity=False).digest()
