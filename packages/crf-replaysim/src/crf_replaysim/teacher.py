"""Teacher client: OpenAI-compatible chat completions over httpx (OpenRouter by default).

``POST {base_url}/chat/completions`` with ``{"model", "messages", "temperature"[, "max_tokens",
"tools", **extra_body]}``; the reply's ``choices[0].message`` becomes the teacher's action.

Reliability: at most ``max_concurrency`` requests in flight; ``timeout_s`` is a deadline for each
whole HTTP request (connect, send, wait, read: a server dripping bytes cannot stretch it); each
response body is read streamed and decoded under a cap of ``max_response_bytes`` (gzip included,
so a compression bomb is stopped at the cap); up to ``max_retries`` retries on timeouts, connection
errors, HTTP 408/429 and 5xx, and 200 replies that are not a chat completion (no ``choices``: a proxy's
page, not a billed answer). A completion whose action is unusable (a malformed assistant message) was
paid for: it is not retried (the same request gets the same answer), its ``usage`` is counted, it is
cached, and it fails with :class:`TeacherActionError`. Redirects are not followed (the key would travel
with them): a 3xx fails with the address to configure instead.
The wait before retry ``k`` (0-based) is ``Retry-After`` when the server sends one (seconds or an
HTTP date, refused above ``max_retry_after_s``), else equal-jitter exponential backoff
``d/2 + U(0, d/2)`` with ``d = min(backoff_max_s, backoff_base_s * 2**k)``. Other 4xx fail at once.

Cache: with ``cache_dir``, each completion (usable or not) is stored under the SHA-256 of the canonical
request (URL + body, never the key); an identical request is answered from disk. Cache writes are
best effort: a failing one logs a single warning and the paid-for reply is still returned. Temporary
names are unique per process and write, so concurrent replays can share a cache. Identical
requests made while one is in flight wait for it instead of sending their own (rollouts of the
same task share their first contexts).

The API key is read from the environment variable ``api_key_env`` (``OPENROUTER_API_KEY`` by
default; ``None`` sends no key, for local servers), refused unless it is printable ASCII without
spaces (a header-safe token), and sent only in the ``Authorization`` header, never over plain
``http://`` except to a loopback host (a literal loopback address, or ``localhost`` resolving only to
loopback addresses), and never appears in a repr, a log
record, an error message, the cache or a reply: every response body has it replaced by
``<secret>`` before it is parsed. ``user:password@`` (or a token as the user alone) in ``base_url`` is
sent as basic auth and handled the same way: the user, the password and their encoding are secrets.

Paid usage: ``stats["prompt_tokens"]`` and ``stats["completion_tokens"]`` sum the ``usage`` of every
completion received over the network (unusable ones included; cache hits and shared in-flight answers
are not paid again). Every numeric option must be finite.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import dataclasses
import email.utils
import functools
import hashlib
import json
import logging
import math
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from crf_replaysim._http import (
    ACCEPT_ENCODING,
    BodyDecodeError,
    BodyTooLarge,
    is_loopback,
    read_body,
    split_credentials,
)
from crf_replaysim._version import __version__
from crf_replaysim.jsonl import loads_bounded, unique_temp_path
from crf_replaysim.messages import MessageError, validate_messages

__all__ = [
    "DEFAULT_API_KEY_ENV",
    "OPENROUTER_BASE_URL",
    "TeacherActionError",
    "TeacherClient",
    "TeacherConfigError",
    "TeacherError",
    "TeacherHTTPError",
    "TeacherReply",
    "TeacherResponseError",
    "TeacherResponseTooLarge",
    "TeacherRetriesExhausted",
]

OPENROUTER_BASE_URL = "https://openrouter.ai/api/v1"
DEFAULT_API_KEY_ENV = "OPENROUTER_API_KEY"
_RETRY_STATUSES = frozenset({408, 429})
_BODY_SNIPPET = 300
_ERROR_BODY_BYTES = 64 * 1024  # read of a non-200 body, for its snippet
DEFAULT_MAX_RESPONSE_BYTES = 8 * 2**20

logger = logging.getLogger(__name__)


class TeacherError(RuntimeError):
    """A teacher request failed. ``retryable``: whether another attempt may succeed."""

    retryable = False


class TeacherConfigError(TeacherError, ValueError):
    """The client is misconfigured (bad argument, missing API key)."""


class TeacherHTTPError(TeacherError):
    """The endpoint answered with an HTTP error status."""

    def __init__(self, message: str, status: int, retryable: bool, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.retry_after_s = retry_after_s


class TeacherResponseError(TeacherError):
    """The endpoint answered 200 with something that is not a usable chat completion (retried)."""

    retryable = True


class TeacherActionError(TeacherResponseError):
    """A chat completion arrived (and was paid for) but its assistant message is unusable; not retried.

    ``usage`` is the reply's token usage (``None`` if it had none).
    """

    retryable = False

    def __init__(self, message: str, usage: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.usage = usage


class TeacherResponseTooLarge(TeacherResponseError):
    """The response body passed ``max_response_bytes`` (after decompression); not retried."""

    retryable = False


class TeacherRetriesExhausted(TeacherError):
    """Every attempt failed with a retryable error; ``last_error`` is the final one."""

    def __init__(self, message: str, attempts: int, last_error: BaseException) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.last_error = last_error


class _Secret:
    """Holds the API key; its repr and str never show it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__


@dataclass(frozen=True)
class TeacherReply:
    """The teacher's action: an OpenAI assistant ``message`` (role, content, tool_calls) and reply metadata."""

    message: dict[str, Any]
    finish_reason: str | None
    model: str | None
    usage: dict[str, Any] | None
    cached: bool


def _positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        bound = ">= 0" if allow_zero else "> 0"
        raise TeacherConfigError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)


def _header_problem(value: str) -> str | None:
    """Why ``value`` cannot travel in an HTTP header as a token (position and code point only, never the value)."""
    for position, char in enumerate(value):
        if not "!" <= char <= "~":
            return f"character {position + 1} is U+{ord(char):04X}, not printable ASCII"
    return None


def _parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds, possibly fractional, or an HTTP date)."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _normalise_tool_calls(raw: Any) -> Any:
    if not isinstance(raw, list):
        return raw
    calls = []
    for call in raw:
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            fn = dict(call["function"])
            if isinstance(fn.get("arguments"), (dict, list)):  # some providers send parsed arguments
                fn["arguments"] = json.dumps(fn["arguments"], ensure_ascii=False)
            call = {"id": call.get("id"), "type": call.get("type") or "function", "function": fn}
        calls.append(call)
    return calls


def _parse_completion(data: Any) -> tuple[dict[str, Any], str | None, str | None, dict[str, Any] | None]:
    """``(assistant_message, finish_reason, model, usage)`` from a chat-completions body."""
    if not isinstance(data, dict):
        raise TeacherResponseError(f"reply is a JSON {type(data).__name__}, expected an object with 'choices'")
    if "error" in data:
        err = data["error"]
        code = err.get("code") if isinstance(err, dict) else None
        msg = err.get("message") if isinstance(err, dict) else err
        if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600:
            retryable = code in _RETRY_STATUSES or code >= 500
            raise TeacherHTTPError(f"endpoint reported error {code}: {str(msg)[:_BODY_SNIPPET]}", code, retryable)
        raise TeacherResponseError(f"endpoint reported an error: {str(msg)[:_BODY_SNIPPET]}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise TeacherResponseError("reply has no 'choices' list; is base_url an OpenAI-compatible /v1 endpoint?")
    raw = choices[0].get("message")
    if not isinstance(raw, dict):
        raise TeacherResponseError("reply's choices[0] has no 'message' object")
    usage = _reply_usage(data)
    message: dict[str, Any] = {"role": "assistant", "content": raw.get("content")}
    if raw.get("tool_calls"):
        message["tool_calls"] = _normalise_tool_calls(raw["tool_calls"])
    try:
        validate_messages([message], "reply.choices[0].message")
    except MessageError as err:
        raise TeacherActionError(
            f"teacher returned an unusable action (not retried: it was paid for): {err}", usage
        ) from None
    model = data.get("model") if isinstance(data.get("model"), str) else None
    finish = choices[0].get("finish_reason")
    return message, finish if isinstance(finish, str) else None, model, usage


def _reply_usage(data: Any) -> dict[str, Any] | None:
    """The ``usage`` object of a decoded reply, if it has one."""
    usage = data.get("usage") if isinstance(data, dict) else None
    return usage if isinstance(usage, dict) else None


def _tokens(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


NULL_CONTENT_MODES: tuple[str, ...] = ("keep", "empty")


class TeacherClient:
    """Async OpenAI-compatible chat-completions client for replay teachers.

    Use ``await client.complete(messages, tools=None)`` from any event loop, and
    ``await client.aclose()`` (or ``async with client:``) when done; the client can be reused
    in a later event loop after closing.

    ``null_content``: how an assistant message that only calls tools carries its ``content: null``
    in requests: ``"keep"`` (OpenAI's form) or ``"empty"`` (``""``, for servers such as
    llama-cpp-python's that answer HTTP 500 to a null content).
    """

    def __init__(
        self,
        model: str,
        *,
        base_url: str = OPENROUTER_BASE_URL,
        api_key_env: str | None = DEFAULT_API_KEY_ENV,
        max_concurrency: int = 8,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        max_retries: int = 5,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 60.0,
        max_retry_after_s: float = 300.0,
        cache_dir: str | Path | None = None,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        extra_body: Mapping[str, Any] | None = None,
        null_content: str = "keep",
        seed: int | None = None,
    ) -> None:
        if not isinstance(model, str) or not model.strip():
            raise TeacherConfigError(f"model must be a non-empty model id (e.g. 'openai/gpt-4o'), got {model!r}")
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise TeacherConfigError(f"base_url must start with http:// or https://, got {base_url!r}")
        try:
            split = split_credentials(base_url)
        except (httpx.InvalidURL, ValueError, TypeError):
            raise TeacherConfigError(
                "base_url is not a valid URL. Fix: pass e.g. https://openrouter.ai/api/v1"
            ) from None
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise TeacherConfigError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise TeacherConfigError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if isinstance(max_response_bytes, bool) or not isinstance(max_response_bytes, int) or max_response_bytes < 1:
            raise TeacherConfigError(f"max_response_bytes must be an int >= 1, got {max_response_bytes!r}")
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise TeacherConfigError(f"max_tokens must be None or an int >= 1, got {max_tokens!r}")
        reserved = {"model", "messages", "tools", "stream"} & set(extra_body or {})
        if reserved:
            raise TeacherConfigError(
                f"extra_body may not set {sorted(reserved)}; they come from the trace and model (no streaming)"
            )
        if null_content not in NULL_CONTENT_MODES:
            raise TeacherConfigError(f"null_content must be one of {NULL_CONTENT_MODES}, got {null_content!r}")
        self.model = model
        self.base_url = split.url.rstrip("/")
        self.api_key_env = api_key_env
        self.max_concurrency = max_concurrency
        self.timeout_s = _positive("timeout_s", timeout_s)
        self.connect_timeout_s = _positive("connect_timeout_s", connect_timeout_s)
        self.max_response_bytes = max_response_bytes
        self.max_retries = max_retries
        self.backoff_base_s = _positive("backoff_base_s", backoff_base_s, allow_zero=True)
        self.backoff_max_s = _positive("backoff_max_s", backoff_max_s, allow_zero=True)
        self.max_retry_after_s = _positive("max_retry_after_s", max_retry_after_s, allow_zero=True)
        self.temperature = _positive("temperature", temperature, allow_zero=True)
        self.max_tokens = max_tokens
        self.extra_body = dict(extra_body or {})
        self.null_content = null_content
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._api_key = self._read_api_key(api_key_env)
        self._basic_auth = None if split.username is None else (_Secret(split.username), _Secret(split.password or ""))
        self._check_credentials_transport()
        self._rng = random.Random(seed)
        self._http: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: dict[str, asyncio.Future[TeacherReply]] = {}
        self._waiters: dict[str, int] = {}
        self._cache_warned = False
        self.stats = {
            "requests": 0,
            "cache_hits": 0,
            "retries": 0,
            "deduplicated": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
        }

    @staticmethod
    def _read_api_key(api_key_env: str | None) -> _Secret | None:
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
        problem = _header_problem(value)
        if problem:
            raise TeacherConfigError(
                f"the key in ${api_key_env} cannot be sent in an HTTP header: {problem} (a zero-width or control "
                f"character, a space or a non-ASCII letter, often pasted with the key). Fix: export {api_key_env} "
                "again with the key alone"
            )
        return _Secret(value)

    def _check_credentials_transport(self) -> None:
        """Refuse credentials that would cross the network in clear text, or two kinds of them at once."""
        if self._api_key is not None and self._basic_auth is not None:
            raise TeacherConfigError(
                "base_url carries user:password@ and an API key is configured too. Fix: use one of them "
                "(api_key_env=None / --no-api-key to keep the URL's credentials)"
            )
        url = httpx.URL(self.base_url)
        if url.scheme == "http" and (self._api_key or self._basic_auth) and not is_loopback(url.host):
            raise TeacherConfigError(
                f"refusing to send credentials over plain http:// to {url.host!r}, where anyone on the path can "
                "read them. Fix: use https://, or api_key_env=None (--no-api-key) for a server without "
                "authentication; plain http:// with a key is accepted only for loopback hosts (127.0.0.1, ::1, "
                "localhost)"
            )

    def __repr__(self) -> str:
        return (
            f"TeacherClient(model={self.model!r}, base_url={self.base_url!r}, api_key_env={self.api_key_env!r}, "
            f"max_concurrency={self.max_concurrency}, timeout_s={self.timeout_s}, max_retries={self.max_retries}, "
            f"max_response_bytes={self.max_response_bytes}, cache_dir={str(self.cache_dir) if self.cache_dir else None!r})"
        )

    @property
    def chat_url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def _secrets(self) -> list[str]:
        values = [] if self._api_key is None else [self._api_key.reveal()]
        if self._basic_auth is not None:
            user, password = (part.reveal() for part in self._basic_auth)
            values += [v for v in (f"{user}:{password}", password, user) if v]  # the user may be the token itself
            values.append(base64.b64encode(f"{user}:{password}".encode()).decode("ascii"))
        return values

    def _redact(self, text: str) -> str:
        """``text`` with every credential replaced by ``<secret>``, raw or JSON-escaped."""
        for value in self._secrets():
            for form in {value, json.dumps(value)[1:-1], value.replace("/", "\\/")}:
                if form in text:
                    text = text.replace(form, "<secret>")
        return text

    def _redact_value(self, value: Any) -> Any:
        """A decoded JSON value with :meth:`_redact` applied to every string (keys included)."""
        if isinstance(value, str):
            return self._redact(value)
        if isinstance(value, list):
            return [self._redact_value(v) for v in value]
        if isinstance(value, dict):
            return {self._redact(k): self._redact_value(v) for k, v in value.items()}
        return value

    def _headers(self) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept-Encoding": ACCEPT_ENCODING,
            "User-Agent": f"crf-replaysim/{__version__}",
        }
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
        elif self._basic_auth is not None:
            user, password = (part.reveal() for part in self._basic_auth)
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        return headers

    def request_body(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The JSON body sent for ``messages`` (and ``tools``)."""
        sent = list(messages)
        if self.null_content == "empty":
            sent = [
                {**m, "content": ""} if m.get("role") == "assistant" and m.get("content") is None else m for m in sent
            ]
        body: dict[str, Any] = {"model": self.model, "messages": sent, "temperature": self.temperature}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if tools:
            body["tools"] = list(tools)
        body.update(self.extra_body)
        return body

    def cache_key(self, body: Mapping[str, Any]) -> str:
        """SHA-256 hex of the canonical request (URL without credentials + body). The API key is not part of it."""
        canonical = json.dumps(
            {"url": self.chat_url, "body": body}, sort_keys=True, ensure_ascii=False, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def _cache_file(self, key: str) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / key[:2] / f"{key}.json"

    def _cache_read(self, key: str) -> Any:
        path = self._cache_file(key)
        try:
            if path is None or not path.is_file():
                return None
            entry = json.loads(path.read_text(encoding="utf-8"))
            if entry.get("key") != key:
                raise ValueError("key mismatch")
            return entry["response"]
        except (ValueError, KeyError, AttributeError, OSError, RecursionError) as err:
            logger.warning("ignoring unreadable cache entry %s (%s); it will be rewritten", path, err)
            return None

    def _cache_write(self, key: str, response: Any) -> None:
        """Store a reply; best effort (the reply is paid for and returned even if the cache cannot take it)."""
        path = self._cache_file(key)
        if path is None:
            return
        tmp = unique_temp_path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"key": key, "response": response}, ensure_ascii=False), encoding="utf-8")
            os.replace(tmp, path)
        except (OSError, ValueError) as err:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if not self._cache_warned:
                self._cache_warned = True
                logger.warning(
                    "cannot write the response cache in %s (%s: %s); continuing without caching replies "
                    "(further cache errors are not reported). Fix: point cache_dir (--cache-dir) at a writable "
                    "directory",
                    self.cache_dir,
                    type(err).__name__,
                    err,
                )

    def _backoff(self, attempt: int) -> float:
        d = min(self.backoff_max_s, self.backoff_base_s * 2.0**attempt)
        return d / 2.0 + self._rng.uniform(0.0, d / 2.0)

    def _ensure_session(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._http is None or self._semaphore is None or self._loop is not loop:
            timeout = httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)
            limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
            self._http = httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False, trust_env=False)
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
            self._loop = loop
            self._inflight, self._waiters = {}, {}
        return self._http, self._semaphore

    async def aclose(self) -> None:
        """Close the HTTP connection pool (the client may be used again afterwards)."""
        if self._http is not None:
            await self._http.aclose()
        self._http = self._semaphore = self._loop = None
        self._inflight, self._waiters = {}, {}

    async def __aenter__(self) -> TeacherClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _exchange(self, http: httpx.AsyncClient, body: Mapping[str, Any]) -> tuple[int, httpx.Headers, bytes]:
        """POST ``body``; the status, headers and body (capped; error bodies truncated for their snippet)."""
        request = http.build_request("POST", self.chat_url, json=body, headers=self._headers())
        response = await http.send(request, stream=True)
        try:
            if response.status_code == 200:
                data = await read_body(response, self.max_response_bytes)
            else:
                data = await read_body(response, min(self.max_response_bytes, _ERROR_BODY_BYTES), truncate=True)
        finally:
            await response.aclose()
        return response.status_code, response.headers, data

    async def _attempt(self, body: Mapping[str, Any]) -> Any:
        """One POST under the ``timeout_s`` deadline; the decoded JSON of a 200 reply, or a ``TeacherError``."""
        http, semaphore = self._ensure_session()
        async with semaphore:
            self.stats["requests"] += 1
            try:
                status, headers, data = await asyncio.wait_for(self._exchange(http, body), self.timeout_s)
            except (asyncio.TimeoutError, httpx.TimeoutException) as err:
                raise TeacherHTTPError(
                    f"no reply within timeout_s={self.timeout_s} (a deadline for the whole request: connecting, "
                    f"sending, waiting and reading the body; {type(err).__name__})",
                    status=0,
                    retryable=True,
                ) from None
            except httpx.TransportError as err:
                raise TeacherHTTPError(
                    f"cannot reach {self.chat_url}: {type(err).__name__}: {self._redact(str(err))}",
                    status=0,
                    retryable=True,
                ) from None
            except BodyTooLarge as err:
                raise TeacherResponseTooLarge(
                    f"reply from {self.chat_url} is larger than max_response_bytes={err.limit} (after "
                    "decompression); not retried. Fix: lower max_tokens or raise max_response_bytes "
                    "(--max-response-bytes)"
                ) from None
            except BodyDecodeError as err:
                raise TeacherResponseError(f"unreadable reply from {self.chat_url}: {err}") from None
        text = self._redact(data.decode("utf-8", errors="replace"))
        if status != 200:
            self._raise_status(status, headers, text)
        try:
            decoded = loads_bounded(text)  # NaN, lone surrogates and nesting past 100 levels refused, never raised
        except ValueError as err:
            raise TeacherResponseError(
                f"HTTP 200 from {self.chat_url} but the body is not JSON, or not usable ({err}): "
                f"{text[:_BODY_SNIPPET]!r}"
            ) from None
        if "\\u" in text:
            decoded = self._redact_value(decoded)  # escaped forms of a secret are plain text only once decoded
        return decoded

    def _raise_status(self, status: int, headers: httpx.Headers, text: str) -> None:
        retryable = status in _RETRY_STATUSES or status >= 500
        snippet = text[:_BODY_SNIPPET]
        hint = ""
        if status in (401, 403):
            hint = f" Fix: check the key in ${self.api_key_env} (or --api-key-env) is valid for {self.base_url}"
        elif status == 404:
            hint = " Fix: check base_url (it should end in /v1 or equivalent) and the model id"
        elif 300 <= status < 400:
            location = headers.get("Location", "")
            where = self._redact(split_credentials(location).url) if location.startswith("http") else location
            hint = (
                f" (redirect to {self._redact(where)!r}). crf-replaysim does not follow redirects: the key would "
                "travel with them. Fix: set base_url to the final address"
            )
            retryable = False
        raise TeacherHTTPError(
            f"HTTP {status} from {self.chat_url}: {snippet}{hint}",
            status=status,
            retryable=retryable,
            retry_after_s=_parse_retry_after(headers.get("Retry-After")),
        )

    async def complete(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> TeacherReply:
        """The teacher's next assistant action after ``messages`` (OpenAI chat list), offering ``tools``.

        Identical requests made while one is in flight share its HTTP call (``stats["deduplicated"]``).
        Raises ``TeacherHTTPError`` for non-retryable statuses (3xx, 401, 403, 404, other 4xx),
        ``TeacherResponseTooLarge`` past ``max_response_bytes``, ``TeacherRetriesExhausted`` after
        ``max_retries`` retries of retryable failures. No error message contains a credential.
        """
        try:
            validate_messages(list(messages), "messages", min_items=1)
        except MessageError as err:
            raise TeacherConfigError(str(err)) from None
        body = self.request_body(messages, tools)
        key = self.cache_key(body)
        cached = self._cache_read(key)
        if cached is not None:
            try:
                message, finish, model, usage = _parse_completion(cached)
            except TeacherActionError as err:  # paid for once: the same unusable answer, at no cost
                self.stats["cache_hits"] += 1
                raise TeacherActionError(f"{self._redact(str(err))} (from the cache)", err.usage) from None
            except TeacherError as err:
                logger.warning("ignoring cache entry %s: %s", key, self._redact(str(err)))
            else:
                self.stats["cache_hits"] += 1
                return TeacherReply(message, finish, model, usage, cached=True)
        self._ensure_session()
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._fetch(key, body))
            self._inflight[key] = task
            self._waiters[key] = 0
            task.add_done_callback(functools.partial(self._forget, key))
        else:
            self.stats["deduplicated"] += 1
        self._waiters[key] += 1
        try:
            reply = await asyncio.shield(task)
        except asyncio.CancelledError:
            if self._waiters.get(key) == 1:  # the last caller gave up: stop the request too
                task.cancel()
            raise
        finally:
            if key in self._waiters:
                self._waiters[key] -= 1
        return dataclasses.replace(reply, message=copy.deepcopy(reply.message))  # callers share no mutable state

    def _paid(self, key: str, data: Any) -> tuple[dict[str, Any], str | None, str | None, dict[str, Any] | None]:
        """Parse a 200 reply; a chat completion, usable or not, is counted as paid and cached (a rerun gets the
        same answer from disk instead of a second bill)."""
        try:
            parsed = _parse_completion(data)
        except TeacherActionError as err:
            self._count_usage(err.usage)
            self._cache_write(key, data)
            raise
        self._count_usage(parsed[3])
        self._cache_write(key, data)
        return parsed

    def _count_usage(self, usage: dict[str, Any] | None) -> None:
        if usage:
            self.stats["prompt_tokens"] += _tokens(usage.get("prompt_tokens"))
            self.stats["completion_tokens"] += _tokens(usage.get("completion_tokens"))

    def _forget(self, key: str, task: object) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
            self._waiters.pop(key, None)

    async def _fetch(self, key: str, body: Mapping[str, Any]) -> TeacherReply:
        """POST ``body`` with retries; cache and return the parsed reply."""
        last: TeacherError | None = None
        for attempt in range(self.max_retries + 1):
            try:
                data = await self._attempt(body)
                message, finish, model, usage = self._paid(key, data)
            except TeacherError as err:
                if not err.retryable:
                    raise
                last = err
                delay = self._backoff(attempt)
                if isinstance(err, TeacherHTTPError) and err.retry_after_s is not None:
                    if err.retry_after_s > self.max_retry_after_s:
                        raise TeacherHTTPError(
                            f"{err} (server asks to wait {err.retry_after_s:.0f} s, above max_retry_after_s="
                            f"{self.max_retry_after_s:.0f}; retry later or raise the limit)",
                            status=err.status,
                            retryable=False,
                        ) from None
                    delay = err.retry_after_s
            else:
                return TeacherReply(message, finish, model, usage, cached=False)
            if attempt == self.max_retries:
                break
            self.stats["retries"] += 1
            logger.warning(
                "teacher attempt %d/%d failed: %s; retrying in %.2f s", attempt + 1, self.max_retries + 1, last, delay
            )
            await asyncio.sleep(delay)
        assert last is not None
        raise TeacherRetriesExhausted(
            f"teacher request failed {self.max_retries + 1} times; last error: {last}",
            attempts=self.max_retries + 1,
            last_error=last,
        )
