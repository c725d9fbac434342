"""systemd's sd_notify protocol without libsystemd: one datagram to $NOTIFY_SOCKET.

Under a `Type=notify` unit systemd sets NOTIFY_SOCKET; elsewhere (a shell, the tests'
subprocess mounts, the background daemon of `tierfs mount`) it is unset and every call
is a no-op. A name starting with '@' is in the abstract namespace (a leading NUL byte).
Failures are logged, never raised: the mount must not die because systemd is not
listening.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*fields: str) -> bool:
    """Send KEY=VALUE fields (READY=1, STOPPING=1, STATUS=..., EXTEND_TIMEOUT_USEC=...).

    Returns True when a datagram was sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or not fields:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        log.warning("NOTIFY_SOCKET=%r is neither a path nor abstract: not notifying", address)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(fields).encode())
    except OSError as exc:
        log.warning("cannot notify systemd on %s: %s", address.lstrip("\0"), exc)
        return False
    return True


def extend_timeout(seconds: float) -> str:
    """The EXTEND_TIMEOUT_USEC= field that gives the current phase (start, stop) `seconds`
    more; systemd never shortens its own timeout because of it."""
    return f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}"
