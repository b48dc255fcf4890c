"""The teacher package's parts on their own: typed stats, the settings record, credentials' redaction."""

from __future__ import annotations

import pytest

from crf_replaysim._http import split_credentials
from crf_replaysim.teacher import NULL_CONTENT_MODES, TeacherConfigError, TeacherSettings, TeacherStats
from crf_replaysim.teacher.credentials import Credentials


def test_stats_are_typed_counters_readable_by_name_and_subtractable():
    stats = TeacherStats()
    stats.requests += 3
    stats.count_usage({"prompt_tokens": 5, "completion_tokens": True})  # a bool is no token count
    before = stats.snapshot()
    stats.requests += 2
    stats.count_usage({"prompt_tokens": 4, "completion_tokens": -1})
    assert (stats["requests"], stats.prompt_tokens, stats.completion_tokens) == (5, 9, 0)
    assert stats.since(before) == TeacherStats(requests=2, prompt_tokens=4)
    assert before.requests == 3  # a snapshot does not move with the live counters
    with pytest.raises(KeyError, match=r"no counter 'request'.*Fix"):
        stats["request"]
    with pytest.raises(TypeError, match="snapshot"):
        stats.since({"requests": 1})  # type: ignore[arg-type]


def test_settings_refuse_printable_credentials_and_bad_options_with_the_fix():
    assert NULL_CONTENT_MODES == ("keep", "empty")
    settings = TeacherSettings("m", base_url="https://example.org/v1/", timeout_s=3)
    assert settings.base_url == "https://example.org/v1"
    assert settings.chat_url == "https://example.org/v1/chat/completions"
    assert isinstance(settings.timeout_s, float)
    bad = [
        ({"base_url": "https://alice:pw@example.org/v1"}, "must not carry user:password"),
        ({"extra_body": ["stream"]}, "extra_body must be a mapping"),
        ({"extra_body": {"stream": True}}, "may not set"),
        ({"null_content": "none"}, "null_content must be one of"),
        ({"max_tokens": True}, "max_tokens must be None or an int >= 1"),
        ({"max_retries": -1}, "max_retries must be an int >= 0"),
        ({"backoff_max_s": float("inf")}, "backoff_max_s must be a finite number >= 0"),
    ]
    for options, message in bad:
        with pytest.raises(TeacherConfigError, match=message):
            TeacherSettings("m", **options)


def test_credentials_redact_every_form_and_never_show_in_their_repr(monkeypatch):
    monkeypatch.setenv("CRF_PARTS_KEY", 'sk-a/b"c')
    creds = Credentials.resolve(split_credentials("https://example.org/v1"), "CRF_PARTS_KEY")
    assert creds.authorization() == {"Authorization": 'Bearer sk-a/b"c'}
    text = 'raw sk-a/b"c, json sk-a/b\\"c, slash sk-a\\/b"c'
    assert creds.redact(text) == "raw <secret>, json <secret>, slash <secret>"
    assert creds.redact_value({'sk-a/b"c': ['x sk-a/b"c']}) == {"<secret>": ["x <secret>"]}
    assert "sk-" not in repr(creds)
    basic = Credentials.resolve(split_credentials("http://127.0.0.1:9/v1".replace("//", "//tok@")), None)
    assert basic.authorization() == {"Authorization": "Basic dG9rOg=="}  # base64("tok:")
    assert basic.redact("tok and dG9rOg==") == "<secret> and <secret>"
