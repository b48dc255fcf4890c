"""What an endpoint's answer means: a chat completion becomes the teacher's action, an error status a
:class:`TeacherHTTPError` (retryable on 408, 429 and 5xx; a 3xx names the address to configure instead)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from crf_replaysim._checks import is_int
from crf_replaysim._http import split_credentials
from crf_replaysim.messages import MessageError, validate_messages
from crf_replaysim.teacher.errors import TeacherActionError, TeacherHTTPError, TeacherResponseError
from crf_replaysim.teacher.retry import parse_retry_after

__all__ = ["BODY_SNIPPET", "TeacherReply", "parse_completion", "reply_usage", "status_error"]

RETRY_STATUSES = frozenset({408, 429})
BODY_SNIPPET = 300
"""Characters of a reply body quoted in an error message."""


@dataclass(frozen=True)
class TeacherReply:
    """The teacher's action: an OpenAI assistant ``message`` (role, content, tool_calls) and reply metadata."""

    message: dict[str, Any]
    finish_reason: str | None
    model: str | None
    usage: dict[str, Any] | None
    cached: bool


def _retryable(status: int) -> bool:
    return status in RETRY_STATUSES or status >= 500


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


def reply_usage(data: Any) -> dict[str, Any] | None:
    """The ``usage`` object of a decoded reply, if it has one."""
    usage = data.get("usage") if isinstance(data, dict) else None
    return usage if isinstance(usage, dict) else None


def parse_completion(data: Any, *, cached: bool = False) -> TeacherReply:
    """The reply in a decoded chat-completions body (``choices[0].message``, its ``finish_reason``, ``model``,
    ``usage``). Raises ``TeacherHTTPError`` for an error object with an HTTP code, ``TeacherResponseError`` for
    a body that is no completion, ``TeacherActionError`` for a completion whose message is unusable."""
    if not isinstance(data, dict):
        raise TeacherResponseError(f"reply is a JSON {type(data).__name__}, expected an object with 'choices'")
    if "error" in data:
        err = data["error"]
        code = err.get("code") if isinstance(err, dict) else None
        msg = err.get("message") if isinstance(err, dict) else err
        if is_int(code) and 400 <= code < 600:
            raise TeacherHTTPError(f"endpoint reported error {code}: {str(msg)[:BODY_SNIPPET]}", code, _retryable(code))
        raise TeacherResponseError(f"endpoint reported an error: {str(msg)[:BODY_SNIPPET]}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise TeacherResponseError("reply has no 'choices' list; is base_url an OpenAI-compatible /v1 endpoint?")
    raw = choices[0].get("message")
    if not isinstance(raw, dict):
        raise TeacherResponseError("reply's choices[0] has no 'message' object")
    usage = reply_usage(data)
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
    return TeacherReply(message, finish if isinstance(finish, str) else None, model, usage, cached=cached)


def status_error(
    status: int,
    headers: httpx.Headers,
    text: str,
    *,
    chat_url: str,
    base_url: str,
    api_key_env: str | None,
    redact: Callable[[str], str],
) -> TeacherHTTPError:
    """The error for a non-200 answer; ``text`` is its (redacted) body, quoted up to ``BODY_SNIPPET`` characters,
    followed by the fix for 401/403 (the key), 404 (the URL) and 3xx (redirects are not followed)."""
    retryable = _retryable(status)
    hint = ""
    if status in (401, 403):
        hint = f" Fix: check the key in ${api_key_env} (or --api-key-env) is valid for {base_url}"
    elif status == 404:
        hint = " Fix: check base_url (it should end in /v1 or equivalent) and the model id"
    elif 300 <= status < 400:
        location = headers.get("Location", "")
        where = redact(split_credentials(location).url) if location.startswith("http") else location
        hint = (
            f" (redirect to {redact(where)!r}). crf-replaysim does not follow redirects: the key would "
            "travel with them. Fix: set base_url to the final address"
        )
        retryable = False
    return TeacherHTTPError(
        f"HTTP {status} from {chat_url}: {text[:BODY_SNIPPET]}{hint}",
        status=status,
        retryable=retryable,
        retry_after_s=parse_retry_after(headers.get("Retry-After")),
    )
