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
with them): a 3xx fails with the address to configure instead. Waits between retries: :mod:`.retry`.

Cache (:mod:`.response_cache`): with ``cache_dir``, each completion (usable or not) is stored under the
SHA-256 of the canonical request (URL + body, never the key); an identical request is answered from disk.
Identical requests made while one is in flight wait for it instead of sending their own
(:mod:`.inflight`; rollouts of the same task share their first contexts).

Credentials (:mod:`.credentials`): the API key is read from the environment variable ``api_key_env``
(``OPENROUTER_API_KEY`` by default; ``None`` sends no key, for local servers), refused unless it is
printable ASCII without spaces (a header-safe token), and sent only in the ``Authorization`` header,
never over plain ``http://`` except to a loopback host (a literal loopback address, or ``localhost``
resolving only to loopback addresses), and never appears in a repr, a log record, an error message,
the cache or a reply: every response body has it replaced by ``<secret>`` before it is parsed.
``user:password@`` (or a token as the user alone) in ``base_url`` is sent as basic auth and handled the
same way: the user, the password and their encoding are secrets.

Paid usage: ``stats.prompt_tokens`` and ``stats.completion_tokens`` (a :class:`TeacherStats`) sum the
``usage`` of every completion received over the network (unusable ones included; cache hits and shared
in-flight answers are not paid again). Every option (:class:`TeacherSettings`) is checked once; every
numeric option must be finite.
"""

from __future__ import annotations

from crf_replaysim.teacher.client import TeacherClient
from crf_replaysim.teacher.errors import (
    TeacherActionError,
    TeacherConfigError,
    TeacherError,
    TeacherHTTPError,
    TeacherResponseError,
    TeacherResponseTooLarge,
    TeacherRetriesExhausted,
)
from crf_replaysim.teacher.replies import TeacherReply
from crf_replaysim.teacher.settings import (
    DEFAULT_API_KEY_ENV,
    DEFAULT_MAX_RESPONSE_BYTES,
    NULL_CONTENT_MODES,
    OPENROUTER_BASE_URL,
    NullContent,
    TeacherSettings,
)
from crf_replaysim.teacher.stats import TeacherStats

__all__ = [
    "DEFAULT_API_KEY_ENV",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "NULL_CONTENT_MODES",
    "OPENROUTER_BASE_URL",
    "NullContent",
    "TeacherActionError",
    "TeacherClient",
    "TeacherConfigError",
    "TeacherError",
    "TeacherHTTPError",
    "TeacherReply",
    "TeacherResponseError",
    "TeacherResponseTooLarge",
    "TeacherRetriesExhausted",
    "TeacherSettings",
    "TeacherStats",
]
