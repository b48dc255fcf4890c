"""crf-core's one home of the int-but-not-bool checks (``crf_core._checks``), shared by channels, trainer and
rewards; test support (``crf_core._testing``) out of the public namespace."""

from __future__ import annotations

import pytest

from crf_core._checks import is_int, is_number


@pytest.mark.parametrize(
    ("value", "integer", "number"),
    [(3, True, True), (0, True, True), (True, False, False), (False, False, False), (2.5, False, True),
     (float("nan"), False, True), ("3", False, False), (None, False, False), (3 + 0j, False, False)],
)  # fmt: skip
def test_bool_is_neither_an_int_nor_a_number(value: object, integer: bool, number: bool) -> None:
    assert is_int(value) is integer
    assert is_number(value) is number


def test_test_support_is_private_and_its_old_path_warns() -> None:
    import importlib
    import sys

    from crf_core._testing import tiny_model

    sys.modules.pop("crf_core.trainer.tiny_model", None)
    with pytest.warns(DeprecationWarning, match="moved to crf_core._testing.tiny_model"):
        old = importlib.import_module("crf_core.trainer.tiny_model")
    assert old.build_char_tokenizer is tiny_model.build_char_tokenizer
    assert old.__all__ == tiny_model.__all__
