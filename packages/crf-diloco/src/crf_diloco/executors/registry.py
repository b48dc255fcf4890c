"""The executors ``crf-diloco launch --executor NAME`` offers, read by the CLI (no per-executor branch there).

Each executor module declares one `Launcher` as its module-level ``LAUNCHER``: its name, where its replicas run
(here or remotely, which decides whether the script travels inside the command and what the replicas install),
its own command-line options and how to build the executor from the parsed arguments. `launchers` finds every
``LAUNCHER`` of the ``crf_diloco.executors`` package, so adding an executor is one module (its class and its
``LAUNCHER``), its tests and its docs.
"""

from __future__ import annotations

import argparse
import importlib
import math
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from crf_diloco.executors.base import ServerlessExecutor

__all__ = [
    "BuildContext",
    "Launcher",
    "cancel_option",
    "launcher",
    "launchers",
    "number",
    "option_dests",
    "positive_int",
]


@dataclass(frozen=True)
class BuildContext:
    """What the CLI settled before building an executor.

    Attributes:
        uri: the store URI (absolute when a local path).
        requirements: what remote replicas install (``--pip``, or crf-diloco with the store's extra; empty for
            ``--no-pip`` and for executors whose replicas run here).
        wheels: wheels shipped with remote replicas (this checkout's crf-diloco when the index lacks it).
    """

    uri: str
    requirements: list[str] = field(default_factory=list)
    wheels: list[Path] = field(default_factory=list)


AddOptions = Callable[[argparse._ArgumentGroup], None]
Build = Callable[[argparse.Namespace, BuildContext], ServerlessExecutor[Any]]


def _no_options(group: argparse._ArgumentGroup) -> None:
    del group


@dataclass(frozen=True)
class Launcher:
    """How ``crf-diloco launch --executor NAME`` offers and builds one executor.

    Attributes:
        name: the ``--executor`` choice.
        title: the heading of its options in ``--help``.
        build: the executor, from the parsed arguments and the `BuildContext` (its SDK is imported here).
        add_options: adds its own options (``--NAME-...``) to its argument group; every default None or [].
        remote: its replicas run elsewhere: the script travels inside the command (`script_command`), they install
            the requirements, the store must be one they all reach, and the shared cloud options
            (``--image``, ``--pip``, ``--secret``, ...) apply.
        requirements_in_command: the replica command installs the requirements itself (``uv run --with``, as on
            Hugging Face Jobs); otherwise the executor installs them (Modal's image).
        same_machine: the replicas run on this machine (a ``--no-python`` program must be on this PATH).
        order: its place among the choices (``local`` first).
    """

    name: str
    title: str
    build: Build
    add_options: AddOptions = _no_options
    remote: bool = False
    requirements_in_command: bool = False
    same_machine: bool = False
    order: int = 100


@cache
def launchers() -> tuple[Launcher, ...]:
    """Every executor module's ``LAUNCHER``, in ``order``."""
    import crf_diloco.executors as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        entry = getattr(module, "LAUNCHER", None)
        if isinstance(entry, Launcher):
            found.append(entry)
    names = [entry.name for entry in found]
    if len(set(names)) != len(names):
        raise RuntimeError(f"two executor modules declare the same launcher name: {sorted(names)}")
    return tuple(sorted(found, key=lambda entry: (entry.order, entry.name)))


def launcher(name: str) -> Launcher:
    """The `Launcher` called ``name`` (``KeyError`` naming the choices when there is none)."""
    for entry in launchers():
        if entry.name == name:
            return entry
    raise KeyError(f"no executor {name!r}; choose one of {[entry.name for entry in launchers()]}")


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def number(*, minimum: float, inclusive: bool) -> Callable[[str], float]:
    """An argparse type: a finite number ``>= minimum`` (``> minimum`` when not ``inclusive``)."""
    bound = f"{'>=' if inclusive else '>'} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}") from None
        if not math.isfinite(value) or (value < minimum if inclusive else value <= minimum):
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}")
        return value

    parse.__name__ = f"number {bound}"
    return parse


def option_dests(add_options: AddOptions) -> Sequence[str]:
    """The ``dest`` of every option ``add_options`` adds (to refuse them with another executor)."""
    group = argparse.ArgumentParser(add_help=False).add_argument_group()
    add_options(group)
    return [action.dest for action in group._group_actions]


def cancel_option(args: argparse.Namespace) -> dict[str, Any]:
    """``cancel_on_failure`` as a keyword for a remote executor, when ``--[no-]cancel-on-failure`` was given."""
    return {} if args.cancel_on_failure is None else {"cancel_on_failure": args.cancel_on_failure}
