"""The v0 cloud-executor skeleton: every method raises the seed's `NotImplementedError` (failure mode 9)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from crf_diloco.executors.base import OutputCallback


def skeleton_error(class_name: str) -> NotImplementedError:
    """``NotImplementedError("<class_name> is a v0 skeleton; full implementation pending.\\nUse LocalProcessExecutor ...")``."""
    return NotImplementedError(
        f"{class_name} is a v0 skeleton; full implementation pending.\nUse LocalProcessExecutor for testing."
    )


class SkeletonExecutor:
    """Base of the import-safe v0 executors: the `ServerlessExecutor` methods, each raising `skeleton_error`.

    Subclasses only declare their constructor (with the options the real backend will take), which raises too.
    """

    def __init__(self, **options: Any) -> None:
        raise skeleton_error(type(self).__name__)

    def launch_replicas(
        self,
        command: Sequence[str],
        *,
        world_size: int,
        uri: str,
        run_id: str | None = None,
        env: Mapping[str, str] | None = None,
        on_output: OutputCallback | None = None,
    ) -> NoReturn:
        """Not implemented in v0."""
        raise skeleton_error(type(self).__name__)

    def collect(self, handles: Sequence[Any], *, timeout: float | None = None) -> NoReturn:
        """Not implemented in v0."""
        raise skeleton_error(type(self).__name__)

    def terminate(self, handles: Sequence[Any]) -> NoReturn:
        """Not implemented in v0."""
        raise skeleton_error(type(self).__name__)
