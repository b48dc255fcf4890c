"""Deterministic synthetic DPO-pair records for the normaliser's parity tests and benchmark.

``synthetic_dj_records(n, seed)`` yields ``n`` valid dj records (built with
:func:`crf_replaysim.records._dpo_pair_to_dj_record`) mixing prose, code, tool calls, unicode (accents,
CJK, emoji, RTL, combining marks, zero-width and no-break spaces, tabs), junk (punctuation runs, digits,
replacement characters), degenerate repetition, e-mail addresses and URLs, texts at the default recipe's
length/word-count edges, exact duplicate pairs and pairs that share only their ``chosen`` side.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

from crf_replaysim._checks import is_int
from crf_replaysim.records import DPOPair, _dpo_pair_to_dj_record

_WORDS = [
    "the",
    "a",
    "model",
    "test",
    "file",
    "function",
    "returns",
    "value",
    "error",
    "fix",
    "patch",
    "run",
    "build",
    "module",
    "import",
    "class",
    "method",
    "check",
    "output",
    "input",
    "list",
    "dict",
    "string",
    "number",
    "loop",
    "branch",
    "commit",
    "diff",
    "review",
    "agent",
    "tool",
    "call",
    "result",
    "because",
    "when",
    "then",
    "should",
    "could",
    "would",
    "please",
    "let",
    "me",
    "look",
    "at",
    "this",
    "first",
]
_CODE = (
    "def f(x):\n    return x + 1",
    "for i in range(10):\n\tprint(i)",
    "if (a && b) { return c[0]; }",
    "assert result == {'ok': True, 'n': 3}",
    "import os, sys\npath = os.path.join(root, 'src')",
    "x = np.zeros((4, 4)); y = x @ x.T",
    "SELECT id, name FROM users WHERE age > 30;",
)
_UNICODE = (
    "café naïve résumé",
    "日本語のテキストです",
    "Ελληνικά κείμενα ΣΟΦΙΑΣ",
    "مرحبا بالعالم",
    "emoji 😀🎉👍 ok",
    "e\u0301 combining a\u0308",
    "zero\u200bwidth\u00a0nbsp\u3000ideo",
    "tab\there\u2003em\u2009thin",
    "İstanbul ß straße ﬁne",
    "«quotes» “curly” ‘single’ — dash … ellipsis",
)
_JUNK = (
    "!!!!!!!!!!!!",
    "????",
    "1234567890 0987654321",
    "\ufffd\ufffd\ufffd\ufffd",
    "#$%^&*()_+",
    "....",
    "🔥🔥🔥🔥🔥🔥",
)
_EDGE = (
    "",
    " ",
    "123456789",
    "1234567890",
    "abcdefghij",
    "abcdefghijk",
    "two words",
    "three words here",
    "four words right here",
    "ab!!",
    "abc!!",
    "a!",
    "\t\n",
    "x" * 9,
    "x" * 10,
)
_CONTACT = (
    "mail me at jane.doe+dpo@example.com today",
    "see https://example.org/path?q=1 for details",
    "docs at www.python.org/doc and ftp://files.example.net/x",
    "CAPS@EXAMPLE.COM is not matched, lower@example.com is",
    "link (https://en.wikipedia.org/wiki/Foo_(bar)) here",
)


def _prose(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def _text(rng: random.Random, kind: str) -> str:
    if kind == "prose":
        return _prose(rng, 4, 80)
    if kind == "code":
        return _prose(rng, 2, 12) + "\n" + "\n".join(rng.choice(_CODE) for _ in range(rng.randint(1, 4)))
    if kind == "unicode":
        return " ".join([rng.choice(_UNICODE), _prose(rng, 0, 10), rng.choice(_UNICODE)])
    if kind == "junk":
        return "".join(rng.choice(_JUNK) for _ in range(rng.randint(1, 8)))
    if kind == "repeat":
        line = _prose(rng, 3, 8)
        return " ".join([line] * rng.randint(3, 30))
    if kind == "edge":
        return rng.choice(_EDGE)
    if kind == "contact":
        return _prose(rng, 2, 10) + " " + rng.choice(_CONTACT)
    raise ValueError(f"unknown text kind {kind!r}")


_CHOSEN_KINDS = ("prose",) * 6 + ("code",) * 3 + ("unicode", "contact", "repeat", "edge", "junk")
_REJECTED_KINDS = ("prose",) * 4 + ("code",) * 2 + ("unicode", "contact", "repeat", "repeat", "edge", "junk", "junk")


def _assistant(rng: random.Random, text: str, turn: int) -> dict[str, Any]:
    if rng.random() < 0.15:
        args = json.dumps({"cmd": rng.choice(_CODE)[:30]})
        call = {"id": f"call_{turn}", "type": "function", "function": {"name": "run", "arguments": args}}
        return {"role": "assistant", "content": text if text.strip() else None, "tool_calls": [call]}
    if not text:
        text = " "  # an assistant message needs some content
    if rng.random() < 0.1:
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}
    return {"role": "assistant", "content": text}


def synthetic_dj_records(n: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Yield ``n`` deterministic dj records (see the module docstring for what they contain)."""
    if not is_int(n) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    rng = random.Random(seed)
    history: list[dict[str, Any]] = []
    for index in range(n):
        roll = rng.random()
        if history and roll < 0.04:  # exact duplicate pair
            record = json.loads(json.dumps(rng.choice(history)))
        else:
            prompt = [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": _text(rng, rng.choice(("prose", "code", "unicode", "contact")))},
            ]
            if history and roll < 0.07:  # same chosen, another prompt: not a duplicate pair
                chosen_messages = json.loads(json.dumps(rng.choice(history)["chosen_messages"]))
            else:
                chosen_messages = [_assistant(rng, _text(rng, rng.choice(_CHOSEN_KINDS)), index)]
            rejected_messages = [_assistant(rng, _text(rng, rng.choice(_REJECTED_KINDS)), index)]
            pair = DPOPair(
                prompt_messages=prompt,
                chosen_messages=chosen_messages,
                rejected_messages=rejected_messages,
                trace_id=f"synthetic-{seed}-{index}",
                turn=1,
                meta={"source": "synthetic", "index": index},
            )
            record = _dpo_pair_to_dj_record(pair)
        if len(history) < 512:
            history.append(record)
        else:
            history[rng.randrange(512)] = record
        yield record
