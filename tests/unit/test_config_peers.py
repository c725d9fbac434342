"""config: the peer tier's options (peers, peer_listen, peer_advertise, peer_secret_file,
peer_bandwidth, peer_timeout, peer_max_concurrent, peer_tls_*) from keywords, `-o`, TOML
and the real command line; every bad value is one UsageError line naming the option; the
secret's bytes are read by read_peer_secret only and never show in the config."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tierfs.config import build_config, build_config_with_file, parse_o_options, read_peer_secret
from tierfs.errors import UsageError

SRC, MP = "s3://bucket", "/mnt/data"
SECRET = b"0123456789abcdef-the-fleet-secret"
NOBODY = 65534


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "peer.secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    return str(path)


def private(tmp_path, name: str, data: bytes = b"x" * 32, mode: int = 0o600) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


def cfg(secret: str, **kw):
    return build_config(SRC, MP, {"peers": "dns:tierfs-peers.ns.svc.cluster.local:7480",
                                  "peer_listen": "10.0.0.1:7480", "peer_secret_file": secret,
                                  **kw})


def one_line_error(secret: str | None, **kw) -> str:
    options = {"peers": "slurm", "peer_listen": "10.0.0.1:7480", **kw}
    if secret is not None and "peer_secret_file" not in options:
        options["peer_secret_file"] = secret
    with pytest.raises(UsageError) as err:
        build_config(SRC, MP, {k: v for k, v in options.items() if v is not None})
    msg = str(err.value)
    assert "\n" not in msg and SECRET.decode() not in msg
    return msg


def test_defaults_and_good_values(secret):
    c = build_config(SRC, MP, {})
    assert c.peers is None and c.peer_listen is None and c.peer_timeout == 2.0
    assert c.peer_bandwidth is None and c.peer_max_concurrent == 32

    c = cfg(secret)
    assert c.peer_listen == ("10.0.0.1", 7480) and c.peer_advertise == ("10.0.0.1", 7480)
    assert c.peer_secret_file == secret and c.peer_tls_cert is None
    c = cfg(secret, peer_listen="0.0.0.0:7480", peer_advertise="10.1.2.3:7480",
            peer_bandwidth="500M/s", peer_timeout="500ms", peer_max_concurrent="64")
    assert c.peer_listen == ("0.0.0.0", 7480) and c.peer_advertise == ("10.1.2.3", 7480)
    assert c.peer_bandwidth == 500 << 20 and c.peer_timeout == 0.5
    assert c.peer_max_concurrent == 64
    assert cfg(secret, peer_bandwidth="1G").peer_bandwidth == 1 << 30
    assert cfg(secret, peer_bandwidth="unlimited").peer_bandwidth is None
    for spec in ("file:/etc/tierfs/peers", "slurm", "dns:localhost:1"):
        assert cfg(secret, peers=spec).peers == spec
    assert cfg(secret, peer_advertise="node-7.cluster:9000").peer_advertise == ("node-7.cluster",
                                                                                9000)


def test_tls_files_all_three(secret, tmp_path):
    cert, ca = private(tmp_path, "cert.pem", mode=0o644), private(tmp_path, "ca.pem", mode=0o644)
    key = private(tmp_path, "key.pem")
    c = cfg(secret, peer_tls_cert=cert, peer_tls_key=key, peer_tls_ca=ca)
    assert (c.peer_tls_cert, c.peer_tls_key, c.peer_tls_ca) == (cert, key, ca)


def test_o_form_and_toml_form(secret, tmp_path):
    o = parse_o_options([f"peers=dns:peers.example:7480,peer_listen=0.0.0.0:7480,"
                         f"peer-advertise=10.0.0.9:7480,peer_secret_file={secret},"
                         f"peer_bandwidth=200M,peer_timeout=3s,peer_max_concurrent=8"])
    c = build_config(SRC, MP, o)
    assert c.peers == "dns:peers.example:7480" and c.peer_advertise == ("10.0.0.9", 7480)
    assert c.peer_bandwidth == 200 << 20 and c.peer_timeout == 3.0 and c.peer_max_concurrent == 8

    toml = tmp_path / "m.toml"
    toml.write_text(f'source = "{SRC}"\nmountpoint = "{MP}"\npeers = "slurm"\n'
                    f'peer-listen = "10.0.0.2:7480"\npeer_secret_file = "{secret}"\n'
                    f'peer_bandwidth = "1G"\npeer_timeout = 1.5\npeer_max_concurrent = 16\n')
    c = build_config_with_file(str(toml), None, None, {})
    assert c.peers == "slurm" and c.peer_listen == ("10.0.0.2", 7480)
    assert c.peer_bandwidth == 1 << 30 and c.peer_timeout == 1.5 and c.peer_max_concurrent == 16

    toml.write_text(f'source = "{SRC}"\nmountpoint = "{MP}"\npeers = "slurm"\n'
                    f'peer_listen = 7480\npeer_secret_file = "{secret}"\n')
    with pytest.raises(UsageError, match="peer_listen: expected a string"):
        build_config_with_file(str(toml), None, None, {})


@pytest.mark.parametrize("kw, needle", [
    ({"peers": "consul:x"}, "invalid peers 'consul:x': expected file:PATH, dns:NAME:PORT or slurm"),
    ({"peers": "file:relative"}, "invalid peers 'file:relative': expected file:/ABSOLUTE/PATH"),
    ({"peers": "dns:name"}, "expected dns:NAME:PORT"),
    ({"peers": "dns:name:0"}, "expected dns:NAME:PORT"),
    ({"peers": "dns:a b:80"}, "expected dns:NAME:PORT"),
    ({"peers": "slurm\n"}, "control character"),
    ({"peer_listen": None}, "peer-listen is required with --peers"),
    ({"peer_listen": "nope"}, "invalid peer-listen 'nope': expected HOST:PORT"),
    ({"peer_listen": "10.0.0.1:70000"}, "invalid peer-listen"),
    ({"peer_listen": "0.0.0.0:7480"}, "peer-advertise is required"),
    ({"peer_listen": "[::]:7480"}, "peer-advertise is required"),
    ({"peer_advertise": "0.0.0.0:7480"}, "invalid peer-advertise '0.0.0.0'"),
    ({"peer_advertise": "[::]:7480"}, "invalid peer-advertise '::'"),
    ({"peer_bandwidth": "fast"}, "invalid peer-bandwidth 'fast'"),
    ({"peer_bandwidth": "1K"}, "invalid peer-bandwidth '1K': must be at least 64K"),
    ({"peer_timeout": "0"}, "invalid peer-timeout '0': must be more than 0s"),
    ({"peer_timeout": "1h"}, "invalid peer-timeout '1h': must be at most 10m"),
    ({"peer_max_concurrent": "0"}, "invalid peer-max-concurrent '0': must be at least 1"),
    ({"peer_max_concurrent": "2000"}, "must be at most 1024"),
    ({"peer_secret_file": "relative/secret"}, "invalid peer-secret-file 'relative/secret': "
                                              "expected an absolute path"),
    ({"peer_tls_cert": "/etc/hostname"}, "give all three or none"),
])
def test_each_bad_value_is_one_line(secret, kw, needle):
    assert needle in one_line_error(secret, **kw)


def test_the_secret_file_is_required(tmp_path):
    assert "peer-secret-file is required with --peers" in one_line_error(None)


@pytest.mark.parametrize("setup, needle", [
    (lambda p: None, "No such file or directory"),
    (lambda p: os.mkdir(p), "not a regular file"),
    (lambda p: private_at(p, mode=0o640), "mode 0640 lets others read it; chmod 600"),
    (lambda p: private_at(p, mode=0o604), "mode 0604 lets others read it"),
    (lambda p: private_at(p, data=b"short\n"), "6 bytes, expected 16 - 4096"),
    (lambda p: private_at(p, data=b"x" * 15 + b"\n"), "15 bytes (without a trailing newline)"),
    (lambda p: private_at(p, data=b"x" * 4097), "4097 bytes, expected 16 - 4096"),
    (lambda p: (private_at(p), os.chown(p, NOBODY, NOBODY)), "owned by uid 65534"),
])
def test_a_bad_secret_file_is_one_line(tmp_path, setup, needle):
    path = str(tmp_path / "secret")
    setup(path)
    msg = one_line_error(None, peer_secret_file=path)
    assert needle in msg and "peer-secret-file" in msg


def private_at(path: str, data: bytes = b"y" * 32, mode: int = 0o600) -> None:
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def test_a_secret_behind_symlinks_as_kubernetes_mounts_it(tmp_path):
    # a Secret volume: KEY -> ..data/KEY, ..data -> ..2026_12_03_21_00_00.123/
    real = tmp_path / "..2026_12_03_21_00_00.123"
    real.mkdir()
    private_at(str(real / "secret"), data=SECRET)
    (tmp_path / "..data").symlink_to(real.name)
    (tmp_path / "secret").symlink_to("..data/secret")
    c = cfg(str(tmp_path / "secret"))
    assert read_peer_secret(c) == SECRET


def test_tls_key_must_be_private(secret, tmp_path):
    cert, ca = private(tmp_path, "cert.pem", mode=0o644), private(tmp_path, "ca.pem", mode=0o644)
    key = private(tmp_path, "key.pem", mode=0o644)
    msg = one_line_error(secret, peer_tls_cert=cert, peer_tls_key=key, peer_tls_ca=ca)
    assert "invalid peer-tls-key" in msg and "chmod 600" in msg
    os.chmod(key, 0o600)
    msg = one_line_error(secret, peer_tls_cert=cert, peer_tls_key=key,
                         peer_tls_ca=str(tmp_path / "missing.pem"))
    assert "invalid peer-tls-ca" in msg and "No such file" in msg


@pytest.mark.parametrize("kw", [{"peer_listen": "10.0.0.1:7480"}, {"peer_timeout": "3s"},
                                {"peer_tls_ca": "/etc/hostname"}])
def test_peer_options_without_peers_are_refused(kw):
    with pytest.raises(UsageError, match=r"only with --peers") as err:
        build_config(SRC, MP, kw)
    assert "\n" not in str(err.value)


def test_the_secret_is_read_only_by_read_peer_secret(secret):
    c = cfg(secret)
    assert read_peer_secret(c) == SECRET  # the trailing newline dropped
    for text in (repr(c), str(c), repr(c.model_dump())):
        assert SECRET.decode() not in text
    os.chmod(secret, 0o644)  # changed after the check: refused when read
    with pytest.raises(UsageError, match="lets others read it") as err:
        read_peer_secret(c)
    assert SECRET.decode() not in str(err.value)
    with pytest.raises(UsageError, match="required with --peers"):
        read_peer_secret(build_config(SRC, MP, {}))


def test_the_real_command_line_prints_one_line(tmp_path, secret):
    os.chmod(secret, 0o644)
    r = subprocess.run([sys.executable, "-m", "tierfs", "mount", SRC, str(tmp_path), "-o",
                        f"peers=slurm,peer_listen=10.0.0.1:7480,peer_secret_file={secret}"],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    lines = r.stderr.splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert lines[0].startswith("tierfs: error: invalid peer-secret-file")
    assert "chmod 600" in lines[0] and SECRET.decode() not in r.stderr
