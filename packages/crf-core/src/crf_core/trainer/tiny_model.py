"""Deprecated: the offline tiny policies moved to ``crf_core._testing.tiny_model`` (test support, not API).

This alias keeps ``from crf_core.trainer.tiny_model import build_char_tokenizer, build_tiny_causal_lm`` working for
code written against it (every name is read from the new module); it will be removed.
"""

from __future__ import annotations

import warnings
from typing import Any

from crf_core._testing import tiny_model as _moved

__all__ = list(_moved.__all__)

warnings.warn(
    "crf_core.trainer.tiny_model moved to crf_core._testing.tiny_model (test support, not API); import it from there",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
