"""Fixtures for the units under a real systemd (systemd-nspawn, see nspawn.py).

  machine  (session) a booted container with systemd/*.service and *.timer installed as
           on a node: units in /usr/local/lib/systemd/system, /usr/local/bin/tierfs -> this
           checkout's .venv/bin/tierfs, /etc/tierfs and /var/cache/tierfs bound from a
           host temporary directory (.etc, .cache: pathlib paths on the host)
  mount_config  (function) a function that writes /etc/tierfs/NAME.toml (+ NAME.credentials,
           0600) for the `bucket` and returns NAME; units left running are stopped after
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import nspawn`

from nspawn import Container, rootfs  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


class Machine:
    def __init__(self, container: Container, etc: Path, cache: Path):
        self.c = container
        self.etc = etc
        self.cache = cache

    def __getattr__(self, name):
        return getattr(self.c, name)


@pytest.fixture(scope="session")
def machine(tmp_path_factory):
    root = rootfs()
    base = tmp_path_factory.mktemp("nspawn")
    etc, units, bin_, cache = (base / d for d in ("etc-tierfs", "units", "bin", "cache"))
    for d in (etc, units, bin_, cache):
        d.mkdir()
    etc.chmod(0o700)
    for unit in [*(REPO / "systemd").glob("*.service"), *(REPO / "systemd").glob("*.timer")]:
        (units / unit.name).write_text(unit.read_text())
    (bin_ / "tierfs").symlink_to(Path(sys.executable).with_name("tierfs"))
    binds = [(str(etc), "/etc/tierfs", True), (str(units), "/usr/local/lib/systemd/system", False),
             (str(bin_), "/usr/local/bin", False), (str(cache), "/var/cache/tierfs", True)]
    with Container(root, binds, base / "console.log") as container:
        yield Machine(container, etc, cache)


@pytest.fixture
def mount_config(machine, rgw, bucket):
    def write(server, bucket, credentials, **options) -> str:
        name = f"t{uuid.uuid4().hex[:8]}"
        lines = [f'source = "s3://{bucket}"', f'mountpoint = "/mnt/{name}"',
                 f'endpoint_url = "{server.endpoint}"', f'region = "{server.region}"',
                 f'cache_dir = "/var/cache/tierfs/{name}"']
        lines += [f"{k} = {v}" for k, v in options.items()]
        (machine.etc / f"{name}.toml").write_text("\n".join(lines) + "\n")
        if credentials == "file":  # LoadCredential=
            cred = machine.etc / f"{name}.credentials"
            cred.touch(mode=0o600)
            cred.write_text(f"[default]\naws_access_key_id = {server.access_key}\n"
                            f"aws_secret_access_key = {server.secret_key}\n")
        else:  # EnvironmentFile=
            env = machine.etc / f"{name}.env"
            env.touch(mode=0o600)
            env.write_text(f"AWS_ACCESS_KEY_ID={server.access_key}\n"
                           f"AWS_SECRET_ACCESS_KEY={server.secret_key}\n")
        machine.run("mkdir", "-p", f"/mnt/{name}")
        return name

    names: list[str] = []

    def make(*, server=None, bucket_name=None, credentials="file", **options) -> str:
        """TOML values as TOML text: make(writeback="true", cache_size='"1G"');
        server/bucket_name: another RGW and bucket than the fixtures'; credentials:
        "file" (NAME.credentials) or "env" (NAME.env)."""
        names.append(write(server or rgw, bucket_name or bucket, credentials, **options))
        return names[-1]

    yield make
    for name in names:  # a test that failed half-way leaves nothing running
        machine.run("systemctl", "stop", f"tierfs-warm@{name}.service", f"tierfs@{name}.service",
                    check=False)
        machine.run("systemctl", "reset-failed", f"tierfs@{name}.service",
                    f"tierfs-warm@{name}.service", check=False)
