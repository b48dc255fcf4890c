"""Loading and checking a data-juicer-format recipe before either backend runs it.

A recipe is a mapping with data-juicer's executor-level keys (``text_keys``, ``np``, ``skip_op_error``, ...)
and ``process``, a list of one-key mappings ``- op_name: {arg: value}``. The checks here catch the mistakes
that make a recipe drop everything or crash data-juicer (the seed's failure mode 6): ``text_key`` and
``text_keys`` swapped, text ops pointed at the chat-shaped ``*_messages`` lists, unknown fields.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import yaml

from crf_replaysim.ops._base import EXECUTOR_ONLY_ARGS, NativeOp, RecipeError

#: Flat-string fields of a DPO-pair record that text ops may read (data-juicer's ``text_key``).
FLAT_TEXT_FIELDS: tuple[str, ...] = ("prompt", "chosen", "rejected")
#: Derived text field: the pair's three flat strings as one JSON array, for pair-level deduplication.
PAIR_FIELD = "pair"
#: Chat-shaped fields (lists of OpenAI messages) that carry the same content as the flat strings.
MESSAGE_FIELDS: tuple[str, ...] = tuple(f"{field}_messages" for field in FLAT_TEXT_FIELDS)
TEXT_FIELDS: tuple[str, ...] = (*FLAT_TEXT_FIELDS, PAIR_FIELD)
DEFAULT_RECIPE_PATH = Path(__file__).resolve().parent.parent / "recipes" / "default.yaml"

RecipeSource = Union[None, str, "os.PathLike[str]", Mapping[str, Any]]


@dataclass(frozen=True)
class RecipeStep:
    """One ``process`` entry: op name, its arguments as written, the resolved ``text_key`` and a unique label."""

    name: str
    args: Mapping[str, Any]
    text_key: str
    label: str


@dataclass(frozen=True)
class Recipe:
    """A checked recipe: executor-level settings, the ordered steps, and where it came from."""

    settings: Mapping[str, Any]
    steps: tuple[RecipeStep, ...]
    source: str


def _field_problem(where: str, field: object) -> str | None:
    """Why ``field`` cannot be read by a text op, or ``None`` if it can."""
    if field in MESSAGE_FIELDS:
        flat = str(field).removesuffix("_messages")
        return (
            f"{where} points at {field!r}, a list of chat messages; data-juicer text ops read one flat string. "
            f"Use {flat!r} (the same content as a flat string); the normaliser keeps {field!r} in step with it."
        )
    if isinstance(field, (list, tuple)):
        return (
            f"{where} is a list ({list(field)!r}); an op reads exactly one field. Repeat the op once per field, "
            "e.g. one entry with `text_key: chosen` and one with `text_key: rejected`."
        )
    if field not in TEXT_FIELDS:
        return (
            f"{where} is {field!r}, which DPO-pair records do not have; text ops read one of "
            f"{', '.join(TEXT_FIELDS)} ({PAIR_FIELD!r} is prompt, chosen and rejected together, for pair dedup)."
        )
    return None


def _read_mapping(recipe: RecipeSource) -> tuple[Mapping[str, Any], str]:
    if recipe is None:
        recipe = DEFAULT_RECIPE_PATH
    if isinstance(recipe, Mapping):
        return recipe, "<dict recipe>"
    if not isinstance(recipe, (str, os.PathLike)):
        raise TypeError(f"recipe must be None, a path to a YAML file or a dict, got {type(recipe).__name__}")
    path = Path(recipe)
    if not path.is_file():
        raise FileNotFoundError(f"recipe file {str(path)!r} does not exist; pass a YAML path, a dict or None (default)")
    with path.open(encoding="utf-8") as handle:
        try:
            data = yaml.safe_load(handle)
        except yaml.YAMLError as err:
            raise RecipeError(f"recipe {str(path)!r} is not valid YAML: {err}") from err
    if not isinstance(data, Mapping):
        raise RecipeError(
            f"recipe {str(path)!r} must be a YAML mapping with a `process:` list, got {type(data).__name__}"
        )
    return data, str(path)


def load_recipe(recipe: RecipeSource) -> Recipe:
    """Read ``recipe`` (``None`` = the packaged default, a YAML path, or a dict) and check it.

    Raises :class:`RecipeError` naming the mistake and its fix.
    """
    data, source = _read_mapping(recipe)
    if "text_key" in data:
        raise RecipeError(
            f"{source}: top-level `text_key` (singular) is an op argument. At the top level data-juicer reads "
            "`text_keys` (plural), e.g. `text_keys: chosen`; inside each op write `text_key: chosen`."
        )
    if data.get("skip_op_error", False) is not False:
        raise RecipeError(
            f"{source}: skip_op_error must be false: with true, data-juicer swallows op errors and silently keeps or "
            "drops records. Set `skip_op_error: false`."
        )
    text_keys = data.get("text_keys")
    if isinstance(text_keys, str):
        text_keys = [text_keys]
    if text_keys is not None:
        if not isinstance(text_keys, list) or not text_keys or not all(isinstance(k, str) for k in text_keys):
            raise RecipeError(f"{source}: text_keys must be a field name or a list of them, got {data['text_keys']!r}")
        for key in text_keys:
            problem = _field_problem("top-level text_keys", key)
            if problem:
                raise RecipeError(f"{source}: {problem}")
    process = data.get("process")
    if not isinstance(process, list) or not process:
        raise RecipeError(
            f"{source}: `process:` must be a non-empty list of `- op_name: {{args}}` entries "
            "(for a passthrough use skip_dj=True)."
        )
    steps: list[RecipeStep] = []
    seen_labels: dict[str, int] = {}
    for position, entry in enumerate(process, start=1):
        if not isinstance(entry, Mapping) or len(entry) != 1:
            raise RecipeError(
                f"{source}: process entry {position} must be a one-key mapping `- op_name: {{args}}`, got {entry!r}"
            )
        ((name, args),) = entry.items()
        args = {} if args is None else args
        if not isinstance(name, str) or not isinstance(args, Mapping):
            raise RecipeError(f"{source}: process entry {position} ({name!r}) must map an op name to a dict of args")
        where = f"{source}: op {position} ({name})"
        if "text_keys" in args:
            raise RecipeError(
                f"{where}: `text_keys` (plural) is the executor-level setting; an op takes `text_key` (singular). "
                f"Write `text_key: {args['text_keys']!r}` (one field per op; repeat the op for each field)."
            )
        if args.get("skip_op_error", False) is not False:
            raise RecipeError(f"{where}: skip_op_error must be false (op errors would be swallowed silently).")
        if "text_key" in args:
            text_key = args["text_key"]
        elif text_keys is not None:
            text_key = text_keys[0]  # data-juicer: only the first text_keys entry becomes the ops' default
        else:
            raise RecipeError(
                f"{where}: no `text_key`, and the recipe has no top-level `text_keys`, so data-juicer would read the "
                "field 'text', which DPO-pair records lack. Add `text_key: chosen` (or rejected/prompt/pair) to the op."
            )
        problem = _field_problem("text_key", text_key)
        if problem:
            raise RecipeError(f"{where}: {problem}")
        label = f"{name}({text_key})"
        seen_labels[label] = seen_labels.get(label, 0) + 1
        if seen_labels[label] > 1:
            label = f"{label}#{seen_labels[label]}"
        steps.append(RecipeStep(name=name, args=dict(args), text_key=text_key, label=label))
    settings = {key: value for key, value in data.items() if key != "process"}
    return Recipe(settings=settings, steps=tuple(steps), source=source)


def build_native_op(step: RecipeStep, ops: Mapping[str, type[NativeOp]], source: str) -> NativeOp:
    """Instantiate the native op of ``step``; unknown ops and arguments raise :class:`RecipeError`."""
    cls = ops.get(step.name)
    if cls is None:
        raise RecipeError(
            f"{source}: unknown op {step.name!r}. The native backend implements {', '.join(sorted(ops))}. "
            "Fix the spelling, or run other data-juicer ops with backend='data-juicer'."
        )
    accepted = cls.accepted_args()
    kwargs = {k: v for k, v in step.args.items() if k not in EXECUTOR_ONLY_ARGS and k != "skip_op_error"}
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise RecipeError(
            f"{source}: op {step.name!r} has unknown argument(s) {', '.join(unknown)}; it accepts "
            f"{', '.join(accepted)} (plus executor settings {', '.join(sorted(EXECUTOR_ONLY_ARGS))})."
        )
    kwargs["text_key"] = step.text_key
    return cls(**kwargs)
