"""A classic-BPF seccomp filter for the sandbox: deny the system calls that escape the rlimits.

RLIMIT_AS bounds a process's address space, but memory can be held outside it: ``memfd_create``
files, SysV shared-memory segments and message queues, and tmpfs mounts in a nested user
namespace. Namespaces and mounts are also the kernel's widest attack surface. This filter (given
to bubblewrap with ``--seccomp FD``, applied to the sandboxed process and everything it starts)
makes these calls fail with ``EPERM``:

* ``memfd_create``, ``memfd_secret``, ``shmget``, ``shmat``, ``msgget`` (memory outside RLIMIT_AS:
  anonymous files, SysV segments kept after detaching, SysV message queues), ``fallocate`` (space
  reserved without writing, which RLIMIT_FSIZE does not count, on any fd, inherited or not);
* ``socket``/``socketpair`` of any family but ``AF_INET``, ``AF_INET6`` (the sandbox's own loopback),
  ``AF_UNIX`` of type ``SOCK_STREAM`` and ``AF_NETLINK``/``NETLINK_ROUTE``: no ``AF_VSOCK`` (not
  isolated by a network namespace), ``AF_PACKET``, ``AF_ALG``, ... and no Unix datagram or
  seqpacket sockets, whose queues pin kernel memory outside every limit (what stream sockets can
  hold is bounded by their buffers, ``RLIMIT_NOFILE`` and the in-flight limit of the sandbox's uid);
* ``unshare``, ``setns``, ``clone``/``clone3`` with a namespace flag, ``mount`` and the new mount
  API, ``pivot_root`` (namespaces and mounts);
* ``ptrace``, ``process_vm_readv/writev``, ``bpf``, ``userfaultfd``, ``perf_event_open``,
  ``keyctl``/``add_key``/``request_key``, ``io_uring_*`` (kernel attack surface).

``clone3`` passes its flags in memory, which BPF cannot read, so it fails with ``ENOSYS`` and the C
library falls back to ``clone`` (threads and ``fork`` keep working). System calls of another ABI
(i386 on x86-64, x32) kill the process. Layout of ``struct seccomp_data``: ``nr`` at offset 0,
``arch`` at 4, ``args[0..2]`` at 16, 24, 32 (their low 32 bits on these little-endian machines). Source:
linux ``include/uapi/linux/seccomp.h``, ``filter.h``, ``audit.h``; syscall tables
``arch/x86/entry/syscalls/syscall_64.tbl`` and ``include/uapi/asm-generic/unistd.h`` (arm64).
"""

from __future__ import annotations

import errno
import functools
import platform
import struct

__all__ = ["seccomp_filter"]

_LD_ABS_W = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_AND = 0x54  # BPF_ALU | BPF_AND | BPF_K
_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000
_ERRNO = 0x00050000
_NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET

# name: (x86_64, aarch64); the numbers from 424 up are shared by every architecture.
_DENIED = {
    "memfd_create": (319, 279),
    "fallocate": (285, 47),
    "memfd_secret": (447, 447),
    "shmget": (29, 194),
    "shmat": (30, 196),
    "msgget": (68, 186),
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "bpf": (321, 280),
    "userfaultfd": (323, 282),
    "perf_event_open": (298, 241),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
}
_CLONE = (56, 220)
_SOCKET, _SOCKETPAIR = (41, 198), (53, 199)
_ARG0, _ARG1, _ARG2 = 16, 24, 32  # offsets of the low 32 bits of args[0..2]
_AF_UNIX, _AF_INET, _AF_INET6, _AF_NETLINK = 1, 2, 10, 16
_SOCK_STREAM, _SOCK_TYPE_MASK = 1, 0xF  # the type without SOCK_NONBLOCK / SOCK_CLOEXEC
_NETLINK_ROUTE = 0
_CLONE3 = 435
# machine -> (AUDIT_ARCH_*, column in _DENIED, first number of a foreign ABI sharing the arch value or None)
_ARCHES = {"x86_64": (0xC000003E, 0, 0x40000000), "aarch64": (0xC00000B7, 1, None), "arm64": (0xC00000B7, 1, None)}


@functools.cache
def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The filter as packed ``struct sock_filter`` records for ``machine`` (default: this one), or None if unsupported."""
    arch = _ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, column, foreign_abi = arch
    deny = sorted({numbers[column] for numbers in _DENIED.values()})
    # Instructions as (code, jump-if-true, jump-if-false, k), jumps as offsets or label names; a str is a label.
    prog: list[tuple[int, str | int, str | int, int] | str] = [
        (_LD_ABS_W, 0, 0, 4),
        (_JEQ, 1, 0, audit_arch),
        (_RET, 0, 0, _KILL_PROCESS),
        (_LD_ABS_W, 0, 0, 0),
    ]
    if foreign_abi is not None:
        prog.append((_JGE, "eperm", 0, foreign_abi))
    prog += [(_JEQ, "eperm", 0, nr) for nr in deny]
    prog += [(_JEQ, "socket", 0, nr[column]) for nr in (_SOCKET, _SOCKETPAIR)]
    prog += [
        (_JEQ, "enosys", 0, _CLONE3),
        (_JEQ, 0, "allow", _CLONE[column]),
        (_LD_ABS_W, 0, 0, _ARG0),
        (_JSET, "eperm", "allow", _NAMESPACE_FLAGS),
        "socket",  # socket(domain, type, protocol) and socketpair(...): only the families programs need
        (_LD_ABS_W, 0, 0, _ARG0),
        (_JEQ, "allow", 0, _AF_INET),
        (_JEQ, "allow", 0, _AF_INET6),
        (_JEQ, "unix", 0, _AF_UNIX),
        (_JEQ, "netlink", "eperm", _AF_NETLINK),
        "unix",  # stream sockets only: datagram queues pin kernel memory outside every limit
        (_LD_ABS_W, 0, 0, _ARG1),
        (_AND, 0, 0, _SOCK_TYPE_MASK),
        (_JEQ, "allow", "eperm", _SOCK_STREAM),
        "netlink",  # NETLINK_ROUTE only (getaddrinfo asks it for the interfaces)
        (_LD_ABS_W, 0, 0, _ARG2),
        (_JEQ, "allow", "eperm", _NETLINK_ROUTE),
        "allow",
        (_RET, 0, 0, _ALLOW),
        "eperm",
        (_RET, 0, 0, _ERRNO | errno.EPERM),
        "enosys",
        (_RET, 0, 0, _ERRNO | errno.ENOSYS),
    ]
    labels: dict[str, int] = {}
    code: list[tuple[int, str | int, str | int, int]] = []
    for item in prog:
        if isinstance(item, str):
            labels[item] = len(code)
        else:
            code.append(item)

    def offset(at: int, target: str | int) -> int:
        jump = target if isinstance(target, int) else labels[target] - at - 1
        assert 0 <= jump < 256, "a BPF jump reaches at most 255 instructions"
        return jump

    return b"".join(struct.pack("=HBBI", op, offset(i, jt), offset(i, jf), k) for i, (op, jt, jf, k) in enumerate(code))
