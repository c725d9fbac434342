"""What the daemon does to its own process so its memory stays its own (docs/security.md).

Its memory holds the S3 credentials, the peer secret and cached bytes of files other
users may not read. A core dump would write all of it to a file (88 MB, issue 26, S7), and
a process the kernel considers dumpable can be read through ptrace and /proc/PID/mem by
its own uid. So: RLIMIT_CORE 0 (no core, whatever `ulimit -c` or the unit says) and
PR_SET_DUMPABLE 0 (no core through a core_pattern pipe either, no ptrace attach by the
same uid, /proc/PID/environ and mem root's only). And the working directory is `/`, so the
daemon neither keeps the directory it was started in busy (a file system that cannot be
unmounted) nor writes anything relative there.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource

log = logging.getLogger(__name__)

PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3
# file names boto3 reads (perhaps again later, at a credential refresh): made absolute
# before the chdir, so a relative one keeps meaning what it meant where tierfs started
_FILE_VARS = ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_CA_BUNDLE")


def _prctl(option: int, arg: int = 0) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                    ctypes.c_ulong(0))
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(rc)


def dumpable() -> bool:
    return _prctl(PR_GET_DUMPABLE) != 0


def protect_process() -> None:
    """No core dumps, not dumpable, cwd `/`. Called once by the daemon process (after the
    fork of a background mount), before it reads a secret or mounts."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        _prctl(PR_SET_DUMPABLE, 0)
    except (OSError, AttributeError) as exc:  # not Linux: the rlimit still holds
        log.warning("could not make the daemon non-dumpable (%s)", exc)
    for var in _FILE_VARS:
        value = os.environ.get(var)
        if value and not os.path.isabs(value):
            os.environ[var] = os.path.abspath(value)
    os.chdir("/")
