"""``clean_links_mapper``: replace URLs and link-like strings by ``repl`` (default: remove them).

The default pattern is data-juicer 1.6.1's (after kallewesterling/CleanText, itself John Gruber's liberal
URL regex): a scheme (``http:``, ``ftp://``, ...), ``www.`` or ``domain.tld/`` followed by non-space,
balanced-parenthesis characters, not ending in punctuation.
"""

from __future__ import annotations

from typing import ClassVar

from crf_replaysim.ops._regex_mapper import RegexSubstitutionMapper


class CleanLinksMapper(RegexSubstitutionMapper):
    """Remove or replace links."""

    name: ClassVar[str] = "clean_links_mapper"
    default_pattern: ClassVar[str] = (
        r"(?i)\b("
        r"(?:[a-z][\w-]+:(?:\/{1,3}|[a-z0-9%])|www\d{0,3}[.]|[a-z0-9.\-]+[.][a-z]{2,4}\/)"
        r"(?:[^\s()<>]+|\(([^\s()<>]+|(\([^\s()<>]+\)))*\))+"
        r"(?:\(([^\s()<>]+|(\([^\s()<>]+\)))*\)|[^\s`!()\[\]{};:\'\".,<>?«»“”‘’])"
        r")"
    )
