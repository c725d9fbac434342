"""The pure parts of tierfs-csi: volume attributes -> tierfs options, the secret -> a
credentials file and the daemon's environment, volume ids -> state dirs."""

from __future__ import annotations

import os

import pytest
from tierfs_csi.credentials import credentials_ini, daemon_env
from tierfs_csi.options import OptionError, stage_spec
from tierfs_csi.records import Records


def test_attributes_become_tierfs_options():
    spec = stage_spec({"bucket": "data", "prefix": "/a/b/", "cache-size": "5G",
                       "allow_other": "false", "csi.storage.k8s.io/pod.name": "x"},
                      ["noatime", "_netdev"], False, "/staging")
    assert spec.source == "s3://data/a/b"
    assert spec.options == {"cache_size": "5G"}  # k8s keys and generic flags ignored
    assert spec.mount_args() == ["-o", "cache_size=5G", "--allow-other"]  # always on
    assert not spec.read_only
    ro = stage_spec({"bucket": "data", "read_only": "yes"}, [], False, "/staging")
    assert ro.read_only and ro.mount_args()[-2:] == ["--read-only", "--allow-other"]


@pytest.mark.parametrize("attrs,text", [
    ({"bucket": "Bad_Bucket!"}, "invalid bucket name"),
    ({"bucket": "data", "chunk_size": "3M"}, "chunk-size"),
    ({"bucket": "data", "metrics_addr": "nowhere"}, "metrics-addr"),
    ({"bucket": "data", "log_file": "/etc/passwd"}, "'log_file' cannot be set"),
    ({"bucket": "data", "metadata_ttl": "5s,cache_size=1G"}, "must not contain ','"),
    ({"bucket": "data", "foreground": "true"}, "unknown volume attribute 'foreground'"),
])
def test_bad_attributes_name_what_is_wrong(attrs, text):
    with pytest.raises(OptionError) as info:
        stage_spec(attrs, [], False, "/staging")
    assert text in str(info.value)


def test_secret_becomes_a_credentials_file():
    ini = credentials_ini({"accessKeyId": "AK", "secretAccessKey": "SK",
                           "aws_session_token": "TOKEN"})
    assert ini == ("[default]\naws_access_key_id = AK\naws_secret_access_key = SK\n"
                   "aws_session_token = TOKEN\n")
    with pytest.raises(OptionError, match="needs both"):
        credentials_ini({"aws_access_key_id": "AK"})
    with pytest.raises(OptionError, match="multi-line") as info:
        credentials_ini({"aws_access_key_id": "AK", "aws_secret_access_key": "S\n[x]"})
    assert "S\n[x]" not in str(info.value)


def test_daemon_environment_has_no_aws_variables_of_the_plugin(monkeypatch):
    monkeypatch.setenv("AWS_PROFILE", "admin")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "plugin-secret")
    env = daemon_env("/state/v/credentials")
    assert {k for k in env if k.startswith("AWS_")} == {
        "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_EC2_METADATA_DISABLED"}
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == "/state/v/credentials"
    assert daemon_env(None)["AWS_SHARED_CREDENTIALS_FILE"] == os.devnull
    assert "AWS_EC2_METADATA_DISABLED" not in daemon_env(None)


def test_volume_ids_name_their_dirs_safely():
    r = Records("/state")
    assert r.volume_dir("imagenet") == "/state/imagenet"
    assert r.cache_dir("imagenet") == "/state/imagenet/cache"
    for odd in ("..", "a/b", "../../etc", "x" * 200, "spaces in id"):
        d = r.volume_dir(odd)
        assert os.path.dirname(d) == "/state" and os.path.basename(d).startswith("id-")
    assert r.volume_dir("a/b") != r.volume_dir("a_b")
