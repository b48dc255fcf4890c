"""The teacher client: one chat-completions request at a time, put together from the modules beside it.

``POST {base_url}/chat/completions`` with ``{"model", "messages", "temperature"[, "max_tokens", "tools",
**extra_body]}``; the reply's ``choices[0].message`` becomes the teacher's action. Options:
:mod:`.settings`; credentials and redaction: :mod:`.credentials`; disk cache: :mod:`.response_cache`;
sharing identical requests in flight: :mod:`.inflight`; retries: :mod:`.retry`; parsing replies:
:mod:`.replies`; counters: :mod:`.stats`.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from crf_replaysim._http import ACCEPT_ENCODING, BodyDecodeError, BodyTooLarge, read_body, split_credentials
from crf_replaysim._version import __version__
from crf_replaysim.jsonl import loads_bounded
from crf_replaysim.messages import MessageError, validate_messages
from crf_replaysim.teacher.credentials import Credentials
from crf_replaysim.teacher.errors import (
    TeacherActionError,
    TeacherConfigError,
    TeacherError,
    TeacherHTTPError,
    TeacherResponseError,
    TeacherResponseTooLarge,
)
from crf_replaysim.teacher.inflight import InflightRequests
from crf_replaysim.teacher.replies import BODY_SNIPPET, TeacherReply, parse_completion, status_error
from crf_replaysim.teacher.response_cache import ResponseCache, request_key
from crf_replaysim.teacher.retry import RetryPolicy
from crf_replaysim.teacher.settings import (
    DEFAULT_API_KEY_ENV,
    DEFAULT_MAX_RESPONSE_BYTES,
    OPENROUTER_BASE_URL,
    NullContent,
    TeacherSettings,
)
from crf_replaysim.teacher.stats import TeacherStats

__all__ = ["TeacherClient"]

_ERROR_BODY_BYTES = 64 * 1024  # read of a non-200 body, for its snippet

logger = logging.getLogger(__name__)


class TeacherClient:
    """Async OpenAI-compatible chat-completions client for replay teachers.

    Use ``await client.complete(messages, tools=None)`` from any event loop, and
    ``await client.aclose()`` (or ``async with client:``) when done; the client can be reused
    in a later event loop after closing. Every option is on ``client.settings`` (a
    :class:`TeacherSettings`); the counters are ``client.stats`` (a :class:`TeacherStats`).

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
        null_content: NullContent = "keep",
        seed: int | None = None,
    ) -> None:
        try:
            split = split_credentials(base_url)
        except (httpx.InvalidURL, ValueError, TypeError):
            split = None  # TeacherSettings refuses the URL with the fix, after checking the model id
        self.settings = TeacherSettings(
            model,
            base_url=base_url if split is None else split.url,
            api_key_env=api_key_env,
            max_concurrency=max_concurrency,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_response_bytes=max_response_bytes,
            max_retries=max_retries,
            backoff_base_s=backoff_base_s,
            backoff_max_s=backoff_max_s,
            max_retry_after_s=max_retry_after_s,
            cache_dir=None if cache_dir is None else Path(cache_dir),
            temperature=temperature,
            max_tokens=max_tokens,
            extra_body=dict(extra_body or {}),
            null_content=null_content,
            seed=seed,
        )
        if split is None:  # not reached: TeacherSettings parses the URL as split_credentials does
            raise TeacherConfigError("base_url is not a valid URL. Fix: pass e.g. https://openrouter.ai/api/v1")
        self._credentials = Credentials.resolve(split, api_key_env)
        s = self.settings
        self._retry = RetryPolicy(
            s.max_retries, s.backoff_base_s, s.backoff_max_s, s.max_retry_after_s, random.Random(seed)
        )
        self._cache = ResponseCache(s.cache_dir)
        self._inflight: InflightRequests[TeacherReply] = InflightRequests()
        self._http: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = TeacherStats()

    # The options read most often, by their old attribute names (the rest: ``client.settings``).
    @property
    def model(self) -> str:
        return self.settings.model

    @property
    def base_url(self) -> str:
        return self.settings.base_url

    @property
    def api_key_env(self) -> str | None:
        return self.settings.api_key_env

    @property
    def max_concurrency(self) -> int:
        return self.settings.max_concurrency

    @property
    def null_content(self) -> NullContent:
        return self.settings.null_content

    @property
    def cache_dir(self) -> Path | None:
        return self.settings.cache_dir

    @property
    def chat_url(self) -> str:
        return self.settings.chat_url

    def __repr__(self) -> str:
        s = self.settings
        return (
            f"TeacherClient(model={s.model!r}, base_url={s.base_url!r}, api_key_env={s.api_key_env!r}, "
            f"max_concurrency={s.max_concurrency}, timeout_s={s.timeout_s}, max_retries={s.max_retries}, "
            f"max_response_bytes={s.max_response_bytes}, cache_dir={str(s.cache_dir) if s.cache_dir else None!r})"
        )

    def _headers(self) -> dict[str, str]:
        return {
            "Content-Type": "application/json",
            "Accept-Encoding": ACCEPT_ENCODING,
            "User-Agent": f"crf-replaysim/{__version__}",
            **self._credentials.authorization(),
        }

    def request_body(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The JSON body sent for ``messages`` (and ``tools``)."""
        s = self.settings
        sent = list(messages)
        if s.null_content == "empty":
            sent = [
                {**m, "content": ""} if m.get("role") == "assistant" and m.get("content") is None else m for m in sent
            ]
        body: dict[str, Any] = {"model": s.model, "messages": sent, "temperature": s.temperature}
        if s.max_tokens is not None:
            body["max_tokens"] = s.max_tokens
        if tools:
            body["tools"] = list(tools)
        body.update(s.extra_body)
        return body

    def cache_key(self, body: Mapping[str, Any]) -> str:
        """SHA-256 hex of the canonical request (URL without credentials + body). The API key is not part of it."""
        return request_key(self.chat_url, body)

    def _ensure_session(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._http is None or self._semaphore is None or self._loop is not loop:
            s = self.settings
            timeout = httpx.Timeout(s.timeout_s, connect=s.connect_timeout_s)
            limits = httpx.Limits(max_connections=s.max_concurrency, max_keepalive_connections=s.max_concurrency)
            self._http = httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False, trust_env=False)
            self._semaphore = asyncio.Semaphore(s.max_concurrency)
            self._loop = loop
            self._inflight.clear()
        return self._http, self._semaphore

    async def aclose(self) -> None:
        """Close the HTTP connection pool (the client may be used again afterwards)."""
        if self._http is not None:
            await self._http.aclose()
        self._http = self._semaphore = self._loop = None
        self._inflight.clear()

    async def __aenter__(self) -> TeacherClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _exchange(self, http: httpx.AsyncClient, body: Mapping[str, Any]) -> tuple[int, httpx.Headers, bytes]:
        """POST ``body``; the status, headers and body (capped; error bodies truncated for their snippet)."""
        limit = self.settings.max_response_bytes
        request = http.build_request("POST", self.chat_url, json=body, headers=self._headers())
        response = await http.send(request, stream=True)
        try:
            if response.status_code == 200:
                data = await read_body(response, limit)
            else:
                data = await read_body(response, min(limit, _ERROR_BODY_BYTES), truncate=True)
        finally:
            await response.aclose()
        return response.status_code, response.headers, data

    async def _attempt(self, body: Mapping[str, Any]) -> Any:
        """One POST under the ``timeout_s`` deadline; the decoded JSON of a 200 reply, or a ``TeacherError``."""
        http, semaphore = self._ensure_session()
        redact, timeout_s = self._credentials.redact, self.settings.timeout_s
        async with semaphore:
            self.stats.requests += 1
            try:
                status, headers, data = await asyncio.wait_for(self._exchange(http, body), timeout_s)
            except (asyncio.TimeoutError, httpx.TimeoutException) as err:
                raise TeacherHTTPError(
                    f"no reply within timeout_s={timeout_s} (a deadline for the whole request: connecting, "
                    f"sending, waiting and reading the body; {type(err).__name__})",
                    status=0,
                    retryable=True,
                ) from None
            except httpx.TransportError as err:
                raise TeacherHTTPError(
                    f"cannot reach {self.chat_url}: {type(err).__name__}: {redact(str(err))}",
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
        text = redact(data.decode("utf-8", errors="replace"))
        if status != 200:
            s = self.settings
            raise status_error(
                status,
                headers,
                text,
                chat_url=s.chat_url,
                base_url=s.base_url,
                api_key_env=s.api_key_env,
                redact=redact,
            )
        try:
            decoded = loads_bounded(text)  # NaN, lone surrogates and nesting past 100 levels refused, never raised
        except ValueError as err:
            raise TeacherResponseError(
                f"HTTP 200 from {self.chat_url} but the body is not JSON, or not usable ({err}): "
                f"{text[:BODY_SNIPPET]!r}"
            ) from None
        if "\\u" in text:
            decoded = self._credentials.redact_value(decoded)  # escaped forms of a secret are plain once decoded
        return decoded

    async def complete(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> TeacherReply:
        """The teacher's next assistant action after ``messages`` (OpenAI chat list), offering ``tools``.

        Identical requests made while one is in flight share its HTTP call (``stats.deduplicated``).
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
        reply = self._from_cache(key)
        if reply is not None:
            return reply
        self._ensure_session()
        reply = await self._inflight.share(key, lambda: self._fetch(key, body), self._count_join)
        return dataclasses.replace(reply, message=copy.deepcopy(reply.message))  # callers share no mutable state

    def _count_join(self) -> None:
        self.stats.deduplicated += 1

    def _from_cache(self, key: str) -> TeacherReply | None:
        """The cached reply for ``key``; a cached unusable action raises again (it was paid for once)."""
        cached = self._cache.read(key)
        if cached is None:
            return None
        redact = self._credentials.redact
        try:
            reply = parse_completion(cached, cached=True)
        except TeacherActionError as err:  # paid for once: the same unusable answer, at no cost
            self.stats.cache_hits += 1
            raise TeacherActionError(f"{redact(str(err))} (from the cache)", err.usage) from None
        except TeacherError as err:
            logger.warning("ignoring cache entry %s: %s", key, redact(str(err)))
            return None
        self.stats.cache_hits += 1
        return reply

    def _paid(self, key: str, data: Any) -> TeacherReply:
        """Parse a 200 reply; a chat completion, usable or not, is counted as paid and cached (a rerun gets the
        same answer from disk instead of a second bill)."""
        try:
            reply = parse_completion(data)
        except TeacherActionError as err:
            self.stats.count_usage(err.usage)
            self._cache.write(key, data)
            raise
        self.stats.count_usage(reply.usage)
        self._cache.write(key, data)
        return reply

    async def _fetch(self, key: str, body: Mapping[str, Any]) -> TeacherReply:
        """POST ``body`` with retries; cache and return the parsed reply."""

        async def attempt() -> TeacherReply:
            return self._paid(key, await self._attempt(body))

        return await self._retry.run(attempt, self._count_retry)

    def _count_retry(self) -> None:
        self.stats.retries += 1
