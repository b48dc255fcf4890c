"""The package's public names resolve lazily, and the CLI starts without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import crf_diloco


def test_every_public_name_resolves() -> None:
    assert sorted(crf_diloco.__all__) == sorted(["__version__", *crf_diloco._MODULE_OF])
    for name in crf_diloco.__all__:
        assert getattr(crf_diloco, name) is not None


def test_cli_and_executors_do_not_import_torch() -> None:
    code = "import sys, crf_diloco.cli, crf_diloco.executors; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_unknown_attribute_raises() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        crf_diloco.NoSuchThing  # noqa: B018
