"""The teacher's credentials (an API key from the environment, or the URL's ``user:password@``) and their redaction.

A credential is read once, checked to be header-safe, sent only in the ``Authorization`` header and
never over plain ``http://`` except to a loopback host. :meth:`Credentials.redact` replaces every form
of it (raw, JSON-escaped, ``/``-escaped, and for basic auth the user, the password, ``user:password``
and its base64) by ``<secret>`` in any text built from response data.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from typing import Any

import httpx

from crf_replaysim._http import SplitURL, is_loopback
from crf_replaysim.teacher.errors import TeacherConfigError

__all__ = ["REDACTED", "Credentials", "Secret", "header_problem"]

REDACTED = "<secret>"


class Secret:
    """Holds one credential; its repr and str never show it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return REDACTED

    __str__ = __repr__


def header_problem(value: str) -> str | None:
    """Why ``value`` cannot travel in an HTTP header as a token (position and code point only, never the value)."""
    for position, char in enumerate(value):
        if not "!" <= char <= "~":
            return f"character {position + 1} is U+{ord(char):04X}, not printable ASCII"
    return None


def _read_api_key(api_key_env: str | None) -> Secret | None:
    if api_key_env is None:
        return None
    if not isinstance(api_key_env, str) or not api_key_env:
        raise TeacherConfigError(f"api_key_env must name an environment variable or be None, got {api_key_env!r}")
    value = os.environ.get(api_key_env, "").strip()
    if not value:
        raise TeacherConfigError(
            f"environment variable {api_key_env} is not set or empty. Fix: export {api_key_env}=<your key>, "
            "or pass api_key_env=<VARIABLE> (CLI: --api-key-env) naming the variable that holds it, "
            "or api_key_env=None (CLI: --no-api-key) for an endpoint without authentication"
        )
    problem = header_problem(value)
    if problem:
        raise TeacherConfigError(
            f"the key in ${api_key_env} cannot be sent in an HTTP header: {problem} (a zero-width or control "
            f"character, a space or a non-ASCII letter, often pasted with the key). Fix: export {api_key_env} "
            "again with the key alone"
        )
    return Secret(value)


@dataclass(frozen=True, repr=False)
class Credentials:
    """At most one of a bearer ``api_key`` and ``basic_auth`` (user, password); both ``None``: no authentication."""

    api_key: Secret | None = None
    basic_auth: tuple[Secret, Secret] | None = None

    @classmethod
    def resolve(cls, url: SplitURL, api_key_env: str | None) -> Credentials:
        """The key named by ``api_key_env`` (``None``: no key) and the credentials taken out of the base URL.

        Refuses both at once, and either over plain ``http://`` to a host that is not loopback.
        """
        api_key = _read_api_key(api_key_env)
        basic = None if url.username is None else (Secret(url.username), Secret(url.password or ""))
        if api_key is not None and basic is not None:
            raise TeacherConfigError(
                "base_url carries user:password@ and an API key is configured too. Fix: use one of them "
                "(api_key_env=None / --no-api-key to keep the URL's credentials)"
            )
        credentials = cls(api_key, basic)
        parsed = httpx.URL(url.url)
        if parsed.scheme == "http" and credentials.present and not is_loopback(parsed.host):
            raise TeacherConfigError(
                f"refusing to send credentials over plain http:// to {parsed.host!r}, where anyone on the path can "
                "read them. Fix: use https://, or api_key_env=None (--no-api-key) for a server without "
                "authentication; plain http:// with a key is accepted only for loopback hosts (127.0.0.1, ::1, "
                "localhost)"
            )
        return credentials

    def __repr__(self) -> str:
        kind = "api_key" if self.api_key else "basic_auth" if self.basic_auth else "none"
        return f"Credentials({kind})"

    @property
    def present(self) -> bool:
        return self.api_key is not None or self.basic_auth is not None

    def _basic_token(self) -> str | None:
        if self.basic_auth is None:
            return None
        user, password = (part.reveal() for part in self.basic_auth)
        return base64.b64encode(f"{user}:{password}".encode()).decode("ascii")

    def authorization(self) -> dict[str, str]:
        """The ``Authorization`` header (empty without credentials)."""
        if self.api_key is not None:
            return {"Authorization": f"Bearer {self.api_key.reveal()}"}
        token = self._basic_token()
        return {} if token is None else {"Authorization": f"Basic {token}"}

    def _secrets(self) -> list[str]:
        values = [] if self.api_key is None else [self.api_key.reveal()]
        if self.basic_auth is not None:
            user, password = (part.reveal() for part in self.basic_auth)
            values += [v for v in (f"{user}:{password}", password, user) if v]  # the user may be the token itself
            values.append(base64.b64encode(f"{user}:{password}".encode()).decode("ascii"))
        return values

    def redact(self, text: str) -> str:
        """``text`` with every credential replaced by ``<secret>``, raw or JSON-escaped."""
        for value in self._secrets():
            for form in {value, json.dumps(value)[1:-1], value.replace("/", "\\/")}:
                if form in text:
                    text = text.replace(form, REDACTED)
        return text

    def redact_value(self, value: Any) -> Any:
        """A decoded JSON value with :meth:`redact` applied to every string (keys included)."""
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, list):
            return [self.redact_value(v) for v in value]
        if isinstance(value, dict):
            return {self.redact(k): self.redact_value(v) for k, v in value.items()}
        return value
