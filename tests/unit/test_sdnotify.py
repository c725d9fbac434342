"""sdnotify: the datagram systemd reads from $NOTIFY_SOCKET (path or abstract '@' name),
and nothing at all when the variable is unset or systemd is not listening."""

import logging
import os
import socket
import uuid

import pytest

from tierfs.mount import sdnotify
@pytest.fixture
def listener(tmp_path, request):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "abstract":
        name = f"tierfs-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        address = "@" + name
    else:
        address = str(tmp_path / "notify")
        sock.bind(address)
    sock.settimeout(10)
    try:
        yield sock, address
    finally:
        sock.close()


@pytest.mark.parametrize("listener", ["path", "abstract"], indirect=True)
def test_fields_arrive_as_one_datagram(listener, monkeypatch):
    sock, address = listener
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    assert sdnotify.notify("READY=1", "STATUS=mounted s3://b/ on /mnt") is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=mounted s3://b/ on /mnt"


def test_unset_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False


@pytest.mark.parametrize("value", ["relative/name", ""])
def test_unusable_address_is_ignored(monkeypatch, value):
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.notify("READY=1") is False


def test_nobody_listening_is_logged_not_raised(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert sdnotify.notify("STOPPING=1") is False
    assert "cannot notify systemd" in caplog.text
    assert not os.path.exists(tmp_path / "gone")


def test_extend_timeout_is_in_microseconds():
    assert sdnotify.extend_timeout(90) == "EXTEND_TIMEOUT_USEC=90000000"
    assert sdnotify.extend_timeout(0.5) == "EXTEND_TIMEOUT_USEC=500000"


def test_stderr_is_the_journal_only_when_its_device_and_inode_match(monkeypatch):
    st = os.fstat(2)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    assert sdnotify.stderr_is_journal() is True
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
    assert sdnotify.stderr_is_journal() is False
    for value in ("", "garbage", "1:"):
        monkeypatch.setenv("JOURNAL_STREAM", value)
        assert sdnotify.stderr_is_journal() is False
    monkeypatch.delenv("JOURNAL_STREAM")
    assert sdnotify.stderr_is_journal() is False


def test_journal_lines_carry_their_priority_and_no_time():
    fmt = sdnotify.JournalFormatter("%(levelname)s %(name)s: %(message)s")

    def line(level, msg):
        return fmt.format(logging.LogRecord("tierfs.mount.daemon", level, __file__, 1, msg, None, None))

    assert line(logging.INFO, "mounted") == "<6>INFO tierfs.mount.daemon: mounted"
    assert line(logging.WARNING, "w") == "<4>WARNING tierfs.mount.daemon: w"
    assert line(logging.ERROR, "two\nlines") == "<3>ERROR tierfs.mount.daemon: two\n<3>lines"
    assert line(logging.DEBUG, "d").startswith("<7>")
