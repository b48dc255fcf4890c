"""The code in a completion: a linear-time scan for the first fenced Python block.

No regular expression: a lazy ``.*?`` between fences, retried from every opening fence, is
quadratic on text with many fences or whitespace runs, and completions are written by the policy.
Each function here reads its input a bounded number of times.
"""

from __future__ import annotations

__all__ = ["extract_code"]

_FENCE = "```"
_PYTHON_TAGS = ("", "python", "py", "python3", "py3")


def extract_code(completion: str) -> str:
    """The body of the first fenced block tagged python (or untagged); else the completion itself.

    A block is ```` ``` ```` plus a tag (``python``, ``py``, ``python3``, ``py3`` or none, any case)
    on its own line, up to the next ```` ``` ```` or, when the completion was cut off before the
    closing fence, the end of the text. Fences with other tags (```` ```text ````) are skipped.
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    start = 0
    while True:
        fence = completion.find(_FENCE, start)
        if fence < 0:
            return completion
        line_end = completion.find("\n", fence)
        if line_end < 0:
            return completion
        tag = completion[fence + len(_FENCE) : line_end].strip().lower()
        body_start = line_end + 1
        close = completion.find(_FENCE, body_start)
        if tag in _PYTHON_TAGS:
            return completion[body_start:] if close < 0 else completion[body_start:close]
        if close < 0:
            return completion
        start = close + len(_FENCE)  # skip the other block, closing fence included
