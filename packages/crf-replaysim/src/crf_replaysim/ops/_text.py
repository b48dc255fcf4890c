"""Character classes and tokenisation-free word splitting shared by the native text ops.

They reproduce data-juicer 1.6.1's ``ops/common`` helpers: a character is *special* when it is in
:data:`SPECIAL_CHARACTERS`; a document splits into words on ``" "``, ``"\\n"`` and ``"\\t"`` only (empty
pieces dropped); a word is *refined* by stripping special characters from both ends (and dropping it when
nothing is left), optionally after lower-casing. Counting goes through ``bytes.translate`` on ASCII text,
which is exact because every ASCII character's class is the same in ``str`` and ``bytes``.
"""

from __future__ import annotations

import re

from crf_replaysim.ops._special_characters_data import SPECIAL_CHARACTER_RANGES

SPECIAL_CHARACTERS: frozenset[str] = frozenset(
    chr(cp) for lo, hi in SPECIAL_CHARACTER_RANGES for cp in range(lo, hi + 1)
)
_WORD_SEPARATORS = re.compile("[ \n\t]+")
_SEPARATOR_CHARS = " \n\t"
_ASCII_SPECIAL = bytes(cp for cp in range(128) if chr(cp) in SPECIAL_CHARACTERS)
_ASCII_SPECIAL_NOT_SEPARATOR = bytes(b for b in _ASCII_SPECIAL if chr(b) not in _SEPARATOR_CHARS)
_ASCII_NON_ALNUM = bytes(cp for cp in range(128) if not chr(cp).isalnum())
_ASCII_WORD_CHAR = "".join(re.escape(chr(cp)) for cp in range(128) if chr(cp) not in SPECIAL_CHARACTERS)
_ASCII_INNER_SPECIAL = "".join(re.escape(chr(b)) for b in _ASCII_SPECIAL_NOT_SEPARATOR)
# A refined word of ASCII text: from the first to the last non-special character of a separator-free run
# (the greedy middle cannot cross a separator, and a run without a non-special character yields nothing).
_ASCII_REFINED_WORD = re.compile(
    f"[{_ASCII_WORD_CHAR}](?:[{_ASCII_WORD_CHAR}{_ASCII_INNER_SPECIAL}]*[{_ASCII_WORD_CHAR}])?"
)
_DELETE_SPECIAL_NOT_SEPARATOR = {ord(c): None for c in SPECIAL_CHARACTERS if c not in _SEPARATOR_CHARS}
_ASCII_WHITESPACE = bytes(cp for cp in range(128) if chr(cp).isspace())
_ASCII_NOT_WHITESPACE_COMPLEMENT = bytes(cp for cp in range(128) if not chr(cp).isspace())
_ASCII_SPECIAL_VISIBLE = bytes(b for b in _ASCII_SPECIAL if not chr(b).isspace())
_is_special = SPECIAL_CHARACTERS.__contains__


def count_special(text: str) -> int:
    """Number of characters of ``text`` that are in :data:`SPECIAL_CHARACTERS`."""
    if text.isascii():
        raw = text.encode("ascii")
        return len(raw) - len(raw.translate(None, _ASCII_SPECIAL))
    return sum(map(_is_special, text))


def count_visible_special(text: str) -> tuple[int, int]:
    """``(special, visible)``: how many characters of ``text`` are not whitespace (``str.isspace()``), and how
    many of those are in :data:`SPECIAL_CHARACTERS`."""
    if text.isascii():
        raw = text.encode("ascii")
        visible = len(raw) - len(raw.translate(None, _ASCII_NOT_WHITESPACE_COMPLEMENT))
        return visible - len(raw.translate(None, _ASCII_WHITESPACE + _ASCII_SPECIAL_VISIBLE)), visible
    shown = [c for c in text if not c.isspace()]
    return sum(map(_is_special, shown)), len(shown)


def count_alnum(text: str) -> int:
    """Number of characters of ``text`` for which ``str.isalnum()`` holds."""
    if text.isascii():
        return len(text.encode("ascii").translate(None, _ASCII_NON_ALNUM))
    return sum(map(str.isalnum, text))


def split_words(text: str) -> list[str]:
    """Split on runs of space, newline and tab; no tokeniser (data-juicer's ``split_on_whitespace``)."""
    return [w for w in _WORD_SEPARATORS.split(text) if w]


def count_words(text: str) -> int:
    """``len(refined_words(text))``: words with at least one non-special character.

    Deleting the special characters that are not separators leaves exactly those words non-empty.
    """
    if text.isascii():
        return len(text.encode("ascii").translate(None, _ASCII_SPECIAL_NOT_SEPARATOR).split())
    return len(split_words(text.translate(_DELETE_SPECIAL_NOT_SEPARATOR)))


def strip_special(word: str) -> str:
    """``word`` without leading and trailing special characters."""
    start, end = 0, len(word)
    while start < end and word[start] in SPECIAL_CHARACTERS:
        start += 1
    while end > start and word[end - 1] in SPECIAL_CHARACTERS:
        end -= 1
    return word[start:end]


def refined_words(text: str, *, lower_case: bool = False) -> list[str]:
    """Words of ``text`` (optionally lower-cased) with special characters stripped from both ends; empties dropped."""
    if text.isascii():  # all ASCII: only ASCII special characters can be stripped, and lower() is per byte
        return _ASCII_REFINED_WORD.findall(text.lower() if lower_case else text)
    out: list[str] = []
    for word in split_words(text):
        if lower_case:
            word = word.lower()
        if word[0] in SPECIAL_CHARACTERS or word[-1] in SPECIAL_CHARACTERS:
            word = strip_special(word)
            if not word:
                continue
        out.append(word)
    return out
