"""Structural contract with PRIME-RL (both LossInputs generations), checked against a vendored fixture.

The fixture transcribes PRIME-RL's ``LossInputs``/``LossOutputs`` fields, the ``CustomLossConfig``
loader and the ``DefaultLossConfig`` knobs at two commits; these tests run without prime-rl installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import crf_primerl.composer_loss as composer_loss
from crf_primerl.composer_loss import LOSS_KWARGS, LossInputs, LossOutputs, loss_fn

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency tomli is the same parser
    import tomli as tomllib

CONTRACT = json.loads((Path(__file__).parent / "fixtures" / "prime_rl_loss_contract.json").read_text())
GENERATIONS = sorted(CONTRACT["generations"])


def _annotation_kind(annotation: Any) -> tuple[bool, bool]:
    """(is a Tensor, admits None) for a resolved dataclass field annotation."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return (Tensor in args, type(None) in args)
    return (annotation is Tensor, False)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_loss_inputs_fields_cover_each_generation(generation: str) -> None:
    ours = {f.name: f for f in dataclasses.fields(LossInputs)}
    hints = typing.get_type_hints(LossInputs)
    for spec in CONTRACT["generations"][generation]["loss_inputs"]:
        assert spec["name"] in ours, f"LossInputs lacks {generation} field {spec['name']}"
        is_tensor, admits_none = _annotation_kind(hints[spec["name"]])
        assert is_tensor, spec["name"]
        assert admits_none == spec["optional"], spec["name"]
        has_default = ours[spec["name"]].default is not dataclasses.MISSING
        assert has_default == spec["optional"], f"{spec['name']}: optional fields default to None, required ones do not"


def test_loss_inputs_is_keyword_only() -> None:
    # The generations order the teacher field differently, so positional construction must not be possible.
    assert all(f.kw_only for f in dataclasses.fields(LossInputs))
    with pytest.raises(TypeError):
        LossInputs(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.ones(1, dtype=torch.bool))  # type: ignore[call-arg]


@pytest.mark.parametrize("generation", GENERATIONS)
def test_upstream_shaped_inputs_are_accepted(generation: str, make_sample: Any) -> None:
    """An object built like PRIME-RL's own ``LossInputs`` (its field order, positional) is read correctly."""
    specs = CONTRACT["generations"][generation]["loss_inputs"]
    upstream_cls = dataclasses.make_dataclass(
        "LossInputs",
        [(s["name"], Any, dataclasses.field(default=None)) if s["has_default"] else (s["name"], Any) for s in specs],
    )
    sample = make_sample(seq=64, teacher=True)
    teacher_field = next(s["name"] for s in specs if s["name"] in ("teacher_logprobs", "ref_logprobs"))
    values = dict(sample, **{teacher_field: sample["teacher_logprobs"]})
    upstream_inputs = upstream_cls(*(values[s["name"]] for s in specs if not s["has_default"]))
    ours = loss_fn(LossInputs(**sample), teacher_weight=0.3)
    theirs = loss_fn(upstream_inputs, teacher_weight=0.3)
    assert torch.equal(ours.loss, theirs.loss)
    assert ours.metrics.keys() == theirs.metrics.keys()


@pytest.mark.parametrize("generation", GENERATIONS)
def test_loss_outputs_fields_match(generation: str) -> None:
    names = [f.name for f in dataclasses.fields(LossOutputs)]
    assert names == [s["name"] for s in CONTRACT["generations"][generation]["loss_outputs"]]


@pytest.mark.parametrize("generation", GENERATIONS)
def test_loss_fn_defaults_match_default_loss_config(generation: str) -> None:
    """Every ``DefaultLossConfig`` knob is a ``loss_fn`` keyword with the same default and the same ``>= 0`` bound."""
    params = inspect.signature(loss_fn).parameters
    one = torch.zeros(1)
    inputs = LossInputs(trainer_logprobs=one, inference_logprobs=one, advantages=one, loss_mask=one.bool())
    for name, spec in CONTRACT["generations"][generation]["default_loss_config"].items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default == spec["default"], name
        assert spec["ge"] == 0
        with pytest.raises(ValueError, match=f"{name} must be >= 0"):
            loss_fn(inputs, **{name: -spec["default"] - 1e-3})


def test_loss_fn_signature_is_inputs_plus_keywords() -> None:
    """PRIME-RL calls ``custom_fn(inputs, **kwargs)``: one positional parameter, every keyword defaulted."""
    params = list(inspect.signature(loss_fn).parameters.values())
    assert params[0].name == "inputs"
    assert params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    keywords = [p for p in params[1:] if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert all(p.default is not inspect.Parameter.empty for p in keywords)
    assert {p.name: p.default for p in keywords} == LOSS_KWARGS
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD  # only to name unknown keys in the error


def test_import_path_resolves_like_custom_loss_config(make_sample: Any) -> None:
    """Resolve ``import_path`` the way PRIME-RL's ``import_object`` does and call it with TOML-style kwargs."""
    import_path = "crf_primerl.composer_loss.loss_fn"
    module_name, _, attr = import_path.rpartition(".")
    resolved = getattr(importlib.import_module(module_name), attr)
    assert resolved is loss_fn
    kwargs: dict[str, Any] = {"dppo_mask_high": 0.3, "kl_tau": 0.01, "teacher_weight": 0.5}  # as parsed from TOML
    out = resolved(LossInputs(**make_sample(seq=32, teacher=True)), **kwargs)
    assert out.loss.dim() == 0
    assert set(CONTRACT["generations"]["mid-2026"]["default_metrics"]) <= set(out.metrics)


def test_module_all_is_the_public_api() -> None:
    assert set(composer_loss.__all__) == {"LOSS_KWARGS", "LossInputs", "LossOutputs", "loss_fn"}


def test_import_is_fast_and_light() -> None:
    """Importing the loss module after torch takes milliseconds and pulls in nothing heavy."""
    probe = (
        "import sys, time, torch\n"
        "before = set(sys.modules)\n"
        "t = time.perf_counter()\n"
        "import crf_primerl.composer_loss\n"
        "print(time.perf_counter() - t)\n"
        "print(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    seconds_line, modules_line = result.stdout.strip().splitlines()
    new_modules = set(modules_line.split())
    heavy = {"transformers", "trl", "numpy", "pandas", "prime_rl", "crf_core", "difflib", "jaxtyping", "beartype"}
    assert not {m.split(".")[0] for m in new_modules} & heavy, sorted(new_modules)
    assert float(seconds_line) < 0.25, f"import took {float(seconds_line):.3f} s"


def test_head_config_format_selects_this_loss(make_sample: Any) -> None:
    """prime-rl HEAD's ``[trainer.loss] type = "custom"``, ``import_path``, ``[trainer.loss.kwargs]`` (a fixture TOML):
    the table has exactly the fields of HEAD's ``CustomLossConfig``, the path resolves as ``import_object`` does,
    the kwargs are ``loss_fn`` keywords, and the run with them reproduces the defaults bit for bit."""
    config = tomllib.loads((Path(__file__).parent / "fixtures" / "prime_rl_head_rl.toml").read_text())
    loss = config["trainer"]["loss"]
    assert loss["type"] == CONTRACT["custom_loss_config"]["type"] == "custom"
    assert set(loss) - {"type"} == set(CONTRACT["custom_loss_config"]["fields"])
    module_name, _, attr = loss["import_path"].rpartition(".")
    custom_fn = getattr(importlib.import_module(module_name), attr)
    assert custom_fn is loss_fn
    assert set(loss["kwargs"]) <= set(LOSS_KWARGS)
    head = CONTRACT["generations"]["head"]
    assert head["commit"].startswith("559b447")
    specs = head["loss_inputs"]
    upstream_cls = dataclasses.make_dataclass(
        "LossInputs",
        [(s["name"], Any, dataclasses.field(default=None)) if s["has_default"] else (s["name"], Any) for s in specs],
    )
    sample = make_sample(seq=96, seed=3)
    inputs = upstream_cls(*(sample.get(s["name"]) for s in specs if not s["has_default"]))  # a GRPO run: ref None
    configured = custom_fn(inputs, **loss["kwargs"])  # what HEAD's setup_rl_loss_fn does: custom_fn(inputs, **kwargs)
    default = loss_fn(inputs)
    assert torch.equal(configured.loss, default.loss)
    # teacher distillation at HEAD is prime-rl's own algorithm, not a kwarg of this loss
    assert config["orchestrator"]["algo"]["type"] == "opd"
    assert not {"teacher_weight", "teacher_tau"} & set(loss["kwargs"])
