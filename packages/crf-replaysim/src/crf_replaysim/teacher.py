"""Teacher client: OpenAI-compatible chat completions over httpx (OpenRouter by default).

``POST {base_url}/chat/completions`` with ``{"model", "messages", "temperature"[, "max_tokens",
"tools", **extra_body]}``; the reply's ``choices[0].message`` becomes the teacher's action.

Reliability: at most ``max_concurrency`` requests in flight; a per-request timeout; up to
``max_retries`` retries on timeouts, connection errors, malformed replies, HTTP 408/429 and 5xx.
The wait before retry ``k`` (0-based) is ``Retry-After`` when the server sends one (seconds or an
HTTP date, refused above ``max_retry_after_s``), else equal-jitter exponential backoff
``d/2 + U(0, d/2)`` with ``d = min(backoff_max_s, backoff_base_s * 2**k)``. Other 4xx fail at once.

Cache: with ``cache_dir``, each successful reply is stored under the SHA-256 of the canonical
request (URL + body, never the key); an identical request is answered from disk. Identical
requests made while one is in flight wait for it instead of sending their own (rollouts of the
same task share their first contexts).

The API key is read from the environment variable ``api_key_env`` (``OPENROUTER_API_KEY`` by
default; ``None`` sends no key, for local servers). It is sent only in the ``Authorization``
header and never appears in a repr, a log record or an error message.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import email.utils
import functools
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from crf_replaysim._version import __version__
from crf_replaysim.messages import MessageError, validate_messages

__all__ = [
    "DEFAULT_API_KEY_ENV",
    "OPENROUTER_BASE_URL",
    "TeacherClient",
    "TeacherConfigError",
    "TeacherError",
    "TeacherHTTPError",
    "TeacherReply",
    "TeacherResponseError",
    "TeacherRetriesExhausted",
]

OPENROUTER_BASE_URL = "https://openrouter.ai/api/v1"
DEFAULT_API_KEY_ENV = "OPENROUTER_API_KEY"
_RETRY_STATUSES = frozenset({408, 429})
_BODY_SNIPPET = 300

logger = logging.getLogger(__name__)


class TeacherError(RuntimeError):
    """A teacher request failed."""


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
    """The endpoint answered 200 with something that is not a usable chat completion."""


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise TeacherConfigError(f"{name} must be a number {bound}, got {value!r}")
    return float(value)


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
    message: dict[str, Any] = {"role": "assistant", "content": raw.get("content")}
    if raw.get("tool_calls"):
        message["tool_calls"] = _normalise_tool_calls(raw["tool_calls"])
    try:
        validate_messages([message], "reply.choices[0].message")
    except MessageError as err:
        raise TeacherResponseError(f"teacher returned an unusable action: {err}") from None
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
    model = data.get("model") if isinstance(data.get("model"), str) else None
    finish = choices[0].get("finish_reason")
    return message, finish if isinstance(finish, str) else None, model, usage


class TeacherClient:
    """Async OpenAI-compatible chat-completions client for replay teachers.

    Use ``await client.complete(messages, tools=None)`` from any event loop, and
    ``await client.aclose()`` (or ``async with client:``) when done; the client can be reused
    in a later event loop after closing.
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
        max_retries: int = 5,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 60.0,
        max_retry_after_s: float = 300.0,
        cache_dir: str | Path | None = None,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        extra_body: Mapping[str, Any] | None = None,
        seed: int | None = None,
    ) -> None:
        if not isinstance(model, str) or not model.strip():
            raise TeacherConfigError(f"model must be a non-empty model id (e.g. 'openai/gpt-4o'), got {model!r}")
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise TeacherConfigError(f"base_url must start with http:// or https://, got {base_url!r}")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise TeacherConfigError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise TeacherConfigError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise TeacherConfigError(f"max_tokens must be None or an int >= 1, got {max_tokens!r}")
        reserved = {"model", "messages", "tools"} & set(extra_body or {})
        if reserved:
            raise TeacherConfigError(f"extra_body may not set {sorted(reserved)}; they come from the trace and model")
        self.model = model
        self.base_url = base_url.rstrip("/")
        self.api_key_env = api_key_env
        self.max_concurrency = max_concurrency
        self.timeout_s = _positive("timeout_s", timeout_s)
        self.connect_timeout_s = _positive("connect_timeout_s", connect_timeout_s)
        self.max_retries = max_retries
        self.backoff_base_s = _positive("backoff_base_s", backoff_base_s, allow_zero=True)
        self.backoff_max_s = _positive("backoff_max_s", backoff_max_s, allow_zero=True)
        self.max_retry_after_s = _positive("max_retry_after_s", max_retry_after_s, allow_zero=True)
        self.temperature = _positive("temperature", temperature, allow_zero=True)
        self.max_tokens = max_tokens
        self.extra_body = dict(extra_body or {})
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._api_key = self._read_api_key(api_key_env)
        self._rng = random.Random(seed)
        self._http: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: dict[str, asyncio.Future[TeacherReply]] = {}
        self._waiters: dict[str, int] = {}
        self.stats = {"requests": 0, "cache_hits": 0, "retries": 0, "deduplicated": 0}

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
        return _Secret(value)

    def __repr__(self) -> str:
        return (
            f"TeacherClient(model={self.model!r}, base_url={self.base_url!r}, api_key_env={self.api_key_env!r}, "
            f"max_concurrency={self.max_concurrency}, timeout_s={self.timeout_s}, max_retries={self.max_retries}, "
            f"cache_dir={str(self.cache_dir) if self.cache_dir else None!r})"
        )

    @property
    def chat_url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def _redact(self, text: str) -> str:
        if self._api_key is not None and self._api_key.reveal() in text:
            text = text.replace(self._api_key.reveal(), "<secret>")
        return text

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "User-Agent": f"crf-replaysim/{__version__}"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
        return headers

    def request_body(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The JSON body sent for ``messages`` (and ``tools``)."""
        body: dict[str, Any] = {"model": self.model, "messages": list(messages), "temperature": self.temperature}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if tools:
            body["tools"] = list(tools)
        body.update(self.extra_body)
        return body

    def cache_key(self, body: Mapping[str, Any]) -> str:
        """SHA-256 hex of the canonical request (URL + body). The API key is not part of it."""
        canonical = json.dumps(
            {"url": self.chat_url, "body": body}, sort_keys=True, ensure_ascii=False, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def _cache_file(self, key: str) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / key[:2] / f"{key}.json"

    def _cache_read(self, key: str) -> Any:
        path = self._cache_file(key)
        if path is None or not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
            if entry.get("key") != key:
                raise ValueError("key mismatch")
            return entry["response"]
        except (ValueError, KeyError, AttributeError, OSError) as err:
            logger.warning("ignoring unreadable cache entry %s (%s); it will be rewritten", path, err)
            return None

    def _cache_write(self, key: str, response: Any) -> None:
        path = self._cache_file(key)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{id(response)}")
        tmp.write_text(json.dumps({"key": key, "response": response}, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)

    def _backoff(self, attempt: int) -> float:
        d = min(self.backoff_max_s, self.backoff_base_s * 2.0**attempt)
        return d / 2.0 + self._rng.uniform(0.0, d / 2.0)

    def _ensure_session(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._http is None or self._semaphore is None or self._loop is not loop:
            timeout = httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)
            limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
            self._http = httpx.AsyncClient(timeout=timeout, limits=limits)
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

    async def _attempt(self, body: Mapping[str, Any]) -> Any:
        """One POST; returns the decoded JSON of a 200 reply or raises a ``TeacherError``."""
        http, semaphore = self._ensure_session()
        async with semaphore:
            self.stats["requests"] += 1
            try:
                resp = await http.post(self.chat_url, json=body, headers=self._headers())
            except httpx.TimeoutException as err:
                raise TeacherHTTPError(
                    f"no reply within timeout_s={self.timeout_s} ({type(err).__name__})", status=0, retryable=True
                ) from None
            except httpx.TransportError as err:
                raise TeacherHTTPError(
                    f"cannot reach {self.chat_url}: {type(err).__name__}: {self._redact(str(err))}",
                    status=0,
                    retryable=True,
                ) from None
        if resp.status_code != 200:
            retryable = resp.status_code in _RETRY_STATUSES or resp.status_code >= 500
            snippet = self._redact(resp.text)[:_BODY_SNIPPET]
            hint = ""
            if resp.status_code in (401, 403):
                hint = f" Fix: check the key in ${self.api_key_env} (or --api-key-env) is valid for {self.base_url}"
            elif resp.status_code == 404:
                hint = " Fix: check base_url (it should end in /v1 or equivalent) and the model id"
            raise TeacherHTTPError(
                f"HTTP {resp.status_code} from {self.chat_url}: {snippet}{hint}",
                status=resp.status_code,
                retryable=retryable,
                retry_after_s=_parse_retry_after(resp.headers.get("Retry-After")),
            )
        try:
            return resp.json()
        except ValueError:
            raise TeacherResponseError(
                f"HTTP 200 from {self.chat_url} but the body is not JSON: {self._redact(resp.text)[:_BODY_SNIPPET]!r}"
            ) from None

    async def complete(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> TeacherReply:
        """The teacher's next assistant action after ``messages`` (OpenAI chat list), offering ``tools``.

        Identical requests made while one is in flight share its HTTP call (``stats["deduplicated"]``).
        Raises ``TeacherHTTPError`` for non-retryable statuses (401, 403, 404, other 4xx),
        ``TeacherRetriesExhausted`` after ``max_retries`` retries of retryable failures.
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
            except TeacherError as err:
                logger.warning("ignoring cache entry %s: %s", key, err)
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
                message, finish, model, usage = _parse_completion(data)
            except TeacherHTTPError as err:
                if not err.retryable:
                    raise
                last = err
                delay = self._backoff(attempt)
                if err.retry_after_s is not None:
                    if err.retry_after_s > self.max_retry_after_s:
                        raise TeacherHTTPError(
                            f"{err} (server asks to wait {err.retry_after_s:.0f} s, above max_retry_after_s="
                            f"{self.max_retry_after_s:.0f}; retry later or raise the limit)",
                            status=err.status,
                            retryable=False,
                        ) from None
                    delay = err.retry_after_s
            except TeacherResponseError as err:
                last = err
                delay = self._backoff(attempt)
            else:
                self._cache_write(key, data)
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
