"""The error the v0 cloud-executor skeletons raise (the seed's message, failure mode 9)."""

from __future__ import annotations


def skeleton_error(class_name: str) -> NotImplementedError:
    """``NotImplementedError("<class_name> is a v0 skeleton; full implementation pending.\\nUse LocalProcessExecutor ...")``."""
    return NotImplementedError(
        f"{class_name} is a v0 skeleton; full implementation pending.\nUse LocalProcessExecutor for testing."
    )
