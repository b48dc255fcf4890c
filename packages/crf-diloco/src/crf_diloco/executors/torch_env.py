"""`with_torch_env`: each replica is its own ``torch.distributed`` world, described by torchrun's variables.

The convention (``crf-diloco launch`` wraps every replica's command this way):

- ``CRF_DILOCO_RANK`` / ``CRF_DILOCO_WORLD_SIZE`` number the *replicas* (the DiLoCo workers that meet only in the
  object store). Shard data across replicas with these.
- ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK`` / ``MASTER_ADDR`` /
  ``MASTER_PORT`` describe the ``torch.distributed`` world *inside one replica*, as torchrun would set them. A
  plain command is a one-process world: ``RANK=0``, ``WORLD_SIZE=1``, ``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``,
  ``MASTER_ADDR=127.0.0.1`` and a ``MASTER_PORT`` free on the replica's own machine (so
  ``init_process_group(init_method="env://")`` works, and two replicas on one host never share a port). A wrapped
  ``torchrun --nproc-per-node K ...`` overwrites them for its K workers with its own (``RANK`` 0..K-1); being a
  single-node torchrun it picks a free rendezvous port itself. Either way the replica rank never collides with
  torchrun's ``RANK``: it is only ever in ``CRF_DILOCO_RANK``.

The variables are set on the replica's machine by a standard-library ``python -c`` program that then ``exec``-s
the command (same process, so signals from the platform reach it); nothing needs to be installed for it.
"""

from __future__ import annotations

from collections.abc import Sequence

TORCH_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
"""The torchrun variables every replica gets (the launcher owns them: ``--env`` may not set them)."""

PROGRAM = (
    "import os,socket,sys;"
    "s=socket.socket();s.bind(('127.0.0.1',0));p=s.getsockname()[1];s.close();"
    "os.environ.update(RANK='0',WORLD_SIZE='1',LOCAL_RANK='0',LOCAL_WORLD_SIZE='1',GROUP_RANK='0',"
    "MASTER_ADDR='127.0.0.1',MASTER_PORT=str(p));"
    "os.execvp(sys.argv[1],sys.argv[1:])"
)
"""The ``python -c`` program that exports a one-process world's variables and ``exec``-s ``sys.argv[1:]``."""


def with_torch_env(argv: Sequence[str], *, python: str = "python") -> list[str]:
    """``[python, "-c", PROGRAM, *argv]``: ``argv`` run with torchrun's variables for a one-process world."""
    command = list(argv)
    if not command or not all(isinstance(a, str) and a for a in command[:1]):
        raise ValueError(f"argv must be a non-empty command with a program first, got {argv!r}")
    return [python, "-c", PROGRAM, *command]
