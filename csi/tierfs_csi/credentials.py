"""The node-stage secret -> a 0600 AWS shared-credentials file and the daemon's environment.

tierfs reads only the standard AWS sources, so the daemon gets AWS_SHARED_CREDENTIALS_FILE
pointing at this file: the secret is never on a command line, in an environment (which
/proc/PID/environ would show) or in a log. Every AWS_* variable of the plugin is dropped,
so nothing of the plugin's own identity leaks into a volume.
"""

from __future__ import annotations

import os

from .options import OptionError

# secret key -> credentials-file key; the names other S3 CSI drivers use are accepted too
_KEYS = {
    "aws_access_key_id": "aws_access_key_id",
    "accessKeyId": "aws_access_key_id",
    "key_id": "aws_access_key_id",
    "aws_secret_access_key": "aws_secret_access_key",
    "secretAccessKey": "aws_secret_access_key",
    "access_key": "aws_secret_access_key",
    "aws_session_token": "aws_session_token",
    "sessionToken": "aws_session_token",
    "session_token": "aws_session_token",
}


def credentials_ini(secrets: dict[str, str]) -> str:
    """The file's text; OptionError names a bad key, never a value."""
    fields: dict[str, str] = {}
    for key, value in secrets.items():
        if key not in _KEYS:
            raise OptionError(f"unknown key {key!r} in the node-stage secret; expected "
                              "aws_access_key_id, aws_secret_access_key [, aws_session_token]")
        if not value.strip() or any(c in value for c in "\r\n"):
            raise OptionError(f"node-stage secret key {key!r}: empty or multi-line value")
        fields[_KEYS[key]] = value.strip()
    if {"aws_access_key_id", "aws_secret_access_key"} - fields.keys():
        raise OptionError("the node-stage secret needs both aws_access_key_id and "
                          "aws_secret_access_key")
    return "[default]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(fields.items()))


def write_private(path: str, text: str) -> None:
    """Write `text` to `path` as a 0600 file, atomically (no moment with other modes)."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is masked by the umask and ignored if it exists
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def daemon_env(credentials_file: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["AWS_CONFIG_FILE"] = os.devnull
    env["AWS_SHARED_CREDENTIALS_FILE"] = credentials_file or os.devnull
    if credentials_file:
        # with a secret, the secret is the identity: never the node's instance profile
        env["AWS_EC2_METADATA_DISABLED"] = "true"
    return env
