"""Remove a directory tree that an untrusted program built: any depth, any permissions, never following links.

``shutil.rmtree`` recurses on the Python stack and on path strings, so 1,500 nested directories
(paths longer than ``PATH_MAX``) make it raise. This walks with directory file descriptors
(``openat``-style ``dir_fd`` calls on names, never whole paths), keeps its own stack, opens with
``O_NOFOLLOW`` (a symlink planted in the tree is unlinked, never entered), and gives directories it
cannot enter or empty ``rwx`` for the owner first. It never raises; it returns what it could not remove.
"""

from __future__ import annotations

import contextlib
import os
import stat

__all__ = ["remove_tree"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _open_dir(name: str, parent_fd: int | None) -> int | None:
    for attempt in range(2):
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except PermissionError:
            if attempt:
                return None
            with contextlib.suppress(OSError):
                os.chmod(name, stat.S_IRWXU, dir_fd=parent_fd, follow_symlinks=False)
        except OSError:
            return None
    return None


def _entries(fd: int) -> list[tuple[str, bool]]:
    """(name, is a real directory) for every entry of the open directory ``fd``."""
    out: list[tuple[str, bool]] = []
    with contextlib.suppress(OSError), os.scandir(fd) as it:
        for entry in it:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            out.append((entry.name, is_dir))
    return out


def remove_tree(path: str) -> bool:
    """Delete ``path`` and everything under it; True when it is gone. Never raises.

    Each directory is listed once (linear in the number of entries) and entered at most once.
    """
    root_fd = _open_dir(path, None)
    if root_fd is None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return not os.path.lexists(path)
    # Frames: fd of a directory, its name in the parent, the parent's fd (None: the root), entries left to remove.
    stack: list[tuple[int, str, int | None, list[tuple[str, bool]]]] = [(root_fd, path, None, [])]
    _prepare(root_fd, stack[-1][3])
    while stack:
        fd, name, parent_fd, pending = stack[-1]
        while pending:
            entry, is_dir = pending.pop()
            child = _open_dir(entry, fd) if is_dir else None
            if child is not None:
                stack.append((child, entry, fd, []))
                _prepare(child, stack[-1][3])
                break
            with contextlib.suppress(OSError):
                os.unlink(entry, dir_fd=fd)
        else:
            stack.pop()
            os.close(fd)
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=parent_fd)
    return not os.path.lexists(path)


def _prepare(fd: int, pending: list[tuple[str, bool]]) -> None:
    with contextlib.suppress(OSError):
        os.chmod(fd, stat.S_IRWXU)  # so its entries can be unlinked
    pending.extend(_entries(fd))
