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


def stderr_is_journal() -> bool:
    """True when stderr is the journal stream systemd connected this service to
    ($JOURNAL_STREAM is its device:inode), not a terminal or a file it was redirected to."""
    dev, sep, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(2)
        return bool(sep) and (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError):
        return False


class JournalFormatter(logging.Formatter):
    """Lines for the journal: no time stamp (the journal has its own) and a "<N>" syslog
    priority prefix on every line, so `journalctl -p warning` finds tierfs's warnings."""

    def format(self, record: logging.LogRecord) -> str:
        level = record.levelno
        prio = (7 if level < logging.INFO else 6 if level < logging.WARNING else
                4 if level < logging.ERROR else 3 if level < logging.CRITICAL else 2)
        return "\n".join(f"<{prio}>{line}" for line in super().format(record).splitlines())
