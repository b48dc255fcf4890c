"""``clean_email_mapper``: replace e-mail addresses by ``repl`` (default: remove them).

Default pattern (data-juicer 1.6.1): a local part of ``[A-Za-z0-9.\\-+_]``, ``@``, a lower-case domain
``[a-z0-9.\\-+_]+`` and a lower-case top-level domain ``\\.[a-z]+``.
"""

from __future__ import annotations

from typing import ClassVar

from crf_replaysim.ops._regex_mapper import RegexSubstitutionMapper


class CleanEmailMapper(RegexSubstitutionMapper):
    """Remove or replace e-mail addresses."""

    name: ClassVar[str] = "clean_email_mapper"
    default_pattern: ClassVar[str] = r"[A-Za-z0-9.\-+_]+@[a-z0-9.\-+_]+\.[a-z]+"
