"""The workers' network: a namespace of their own with only loopback (Linux).

TensorFlow's gRPC server listens on all interfaces without any authentication;
in a network namespace that has only loopback, no other host can reach a
worker's port. Only the standard library: this module must load before
anything else is imported.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def isolate_network() -> None:
    """Moves this process into a new network namespace that has only loopback, up.

    The workers started afterwards inherit it. Without the privilege for a
    network namespace, a user namespace of this user's own grants it where
    the kernel allows that. Raises OSError saying why it cannot be done.
    """
    if sys.platform != "linux":
        raise OSError(f"network namespaces are a Linux feature; this is {sys.platform}")
    try:
        _unshare(CLONE_NEWNET)
    except PermissionError as refused:
        uid, gid = os.getuid(), os.getgid()
        try:
            _unshare(CLONE_NEWUSER | CLONE_NEWNET)  # single-threaded processes only
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", f"{uid} {uid} 1"),
                ("gid_map", f"{gid} {gid} 1"),
            ):
                with open(f"/proc/self/{name}", "w") as file:
                    file.write(text)
        except OSError as error:
            raise OSError(
                f"unshare: {refused.strerror}; in a user namespace: {error.strerror}"
            ) from None
    except OSError as error:
        raise OSError(f"unshare: {error.strerror}") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack_from("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def _unshare(flags: int) -> None:
    """libc unshare(2): Python 3.11 has no os.unshare."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
