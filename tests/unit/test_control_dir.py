"""The control socket's directory: created private, refused when someone else owns it."""

from __future__ import annotations

import os

import pytest

from tierfs.control import prepare_socket_dir
from tierfs.errors import StartupError


def test_directory_is_created_private(tmp_path):
    prepare_socket_dir(str(tmp_path / "run" / "x.sock"))
    assert os.stat(tmp_path / "run").st_mode & 0o777 == 0o700


def test_a_directory_of_another_user_is_refused(tmp_path):
    other = tmp_path / "run"
    other.mkdir(mode=0o777)
    os.chown(other, 65534, 65534)  # the tests run as root (CI does)
    with pytest.raises(StartupError, match="belongs to uid 65534"):
        prepare_socket_dir(str(other / "x.sock"))
