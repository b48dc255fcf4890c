"""The teacher client's options, checked once: a frozen record that refuses a bad value with the fix."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import httpx

from crf_replaysim._checks import is_int, is_number
from crf_replaysim.teacher.errors import TeacherConfigError

__all__ = [
    "DEFAULT_API_KEY_ENV",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "NULL_CONTENT_MODES",
    "OPENROUTER_BASE_URL",
    "NullContent",
    "TeacherSettings",
]

OPENROUTER_BASE_URL = "https://openrouter.ai/api/v1"
DEFAULT_API_KEY_ENV = "OPENROUTER_API_KEY"
DEFAULT_MAX_RESPONSE_BYTES = 8 * 2**20

NullContent = Literal["keep", "empty"]
"""How a tools-only assistant message carries ``content: null`` in requests: ``"keep"`` (OpenAI's form) or
``"empty"`` (``""``, for servers such as llama-cpp-python's that answer HTTP 500 to a null content)."""
NULL_CONTENT_MODES: tuple[str, ...] = get_args(NullContent)

_RESERVED_BODY_KEYS = frozenset({"model", "messages", "tools", "stream"})


def _whole(name: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    """Refuse ``value`` unless it is an int (not a bool) ``>= minimum`` (or ``None`` when ``optional``)."""
    if optional and value is None:
        return
    if not is_int(value) or value < minimum:
        allowed = f"None or an int >= {minimum}" if optional else f"an int >= {minimum}"
        raise TeacherConfigError(f"{name} must be {allowed}, got {value!r}")


def _finite(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """``value`` as a float, refused unless it is a finite number ``> 0`` (``>= 0`` with ``allow_zero``)."""
    if not is_number(value) or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise TeacherConfigError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class TeacherSettings:
    """Every option of a teacher client but its credentials (which never sit in a printable record).

    ``base_url`` has no ``user:password@`` part (the client takes it out first) and no trailing ``/``;
    seconds and ``temperature`` are stored as floats. Meanings: see :class:`~crf_replaysim.teacher.TeacherClient`.
    """

    model: str
    base_url: str = OPENROUTER_BASE_URL
    api_key_env: str | None = DEFAULT_API_KEY_ENV
    max_concurrency: int = 8
    timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    max_retries: int = 5
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    max_retry_after_s: float = 300.0
    cache_dir: Path | None = None
    temperature: float = 0.0
    max_tokens: int | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    null_content: NullContent = "keep"
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise TeacherConfigError(f"model must be a non-empty model id (e.g. 'openai/gpt-4o'), got {self.model!r}")
        self._check_base_url()
        _whole("max_concurrency", self.max_concurrency, 1)
        _whole("max_retries", self.max_retries, 0)
        _whole("max_response_bytes", self.max_response_bytes, 1)
        _whole("max_tokens", self.max_tokens, 1, optional=True)
        if not isinstance(self.extra_body, Mapping):
            raise TeacherConfigError(f"extra_body must be a mapping or None, got {type(self.extra_body).__name__}")
        reserved = _RESERVED_BODY_KEYS & set(self.extra_body)
        if reserved:
            raise TeacherConfigError(
                f"extra_body may not set {sorted(reserved)}; they come from the trace and model (no streaming)"
            )
        if self.null_content not in NULL_CONTENT_MODES:
            raise TeacherConfigError(f"null_content must be one of {NULL_CONTENT_MODES}, got {self.null_content!r}")
        for name, allow_zero in (
            ("timeout_s", False),
            ("connect_timeout_s", False),
            ("backoff_base_s", True),
            ("backoff_max_s", True),
            ("max_retry_after_s", True),
            ("temperature", True),
        ):
            object.__setattr__(self, name, _finite(name, getattr(self, name), allow_zero=allow_zero))
        object.__setattr__(self, "extra_body", dict(self.extra_body))
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", Path(self.cache_dir))

    def _check_base_url(self) -> None:
        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise TeacherConfigError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        try:
            userinfo = httpx.URL(self.base_url).userinfo
        except (httpx.InvalidURL, ValueError, TypeError):
            raise TeacherConfigError(
                "base_url is not a valid URL. Fix: pass e.g. https://openrouter.ai/api/v1"
            ) from None
        if userinfo:
            raise TeacherConfigError(
                "TeacherSettings.base_url must not carry user:password@ (a settings record is printable). "
                "Fix: pass the URL to TeacherClient, which takes the credentials out"
            )
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))

    @property
    def chat_url(self) -> str:
        """``{base_url}/chat/completions``."""
        return f"{self.base_url}/chat/completions"
