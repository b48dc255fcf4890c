"""Shared part of the regex-substitution mappers (``clean_email_mapper``, ``clean_links_mapper``)."""

from __future__ import annotations

from typing import Any, ClassVar

from crf_replaysim.ops._base import NativeMapper, RecipeError


class RegexSubstitutionMapper(NativeMapper):
    """Replace every match of ``pattern`` (``regex`` module, ``DOTALL``) by ``repl``.

    As in data-juicer 1.6.1, ``pattern=None`` selects the op's default pattern and a pattern written as a
    Python raw-string literal (``r'...'`` or ``r"..."``) is unwrapped first.
    """

    default_pattern: ClassVar[str]

    def __init__(self, *, text_key: str, pattern: str | None = None, repl: str = "") -> None:
        super().__init__(text_key=text_key)
        if pattern is None:
            pattern = self.default_pattern
        elif not isinstance(pattern, str):
            raise RecipeError(f"{self.name}: pattern must be a regular expression string or null, got {pattern!r}.")
        elif len(pattern) > 2 and pattern[:2] in ("r'", 'r"') and pattern[-1] == pattern[1]:
            pattern = pattern[2:-1]
        if not isinstance(repl, str):
            raise RecipeError(f"{self.name}: repl must be a string, got {repl!r}.")
        import regex  # data-juicer's regex engine (``\p{..}``, its ``\w``/``\b``); imported only when needed

        try:
            self.regex: Any = regex.compile(pattern, flags=regex.DOTALL)
        except regex.error as err:
            raise RecipeError(f"{self.name}: pattern {pattern!r} is not a valid regular expression ({err}).") from err
        self.repl = repl

    def apply(self, text: str) -> str:
        return self.regex.sub(self.repl, text)
