"""The control socket's directory: created private, refused when someone else owns it;
the /tmp fallback another user made first is left aside (issue 26, S6)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tierfs.mount.control import prepare_socket_dir
from tierfs.errors import StartupError
from tierfs.mount.mountinfo import is_mountpoint
from tierfs.runpaths import aside_dirs, control_socket, run_dir


def test_directory_is_created_private(tmp_path):
    prepare_socket_dir(str(tmp_path / "run" / "x.sock"))
    assert os.stat(tmp_path / "run").st_mode & 0o777 == 0o700


def test_a_directory_of_another_user_is_refused(tmp_path):
    other = tmp_path / "run"
    other.mkdir(mode=0o777)
    os.chown(other, 65534, 65534)  # the tests run as root (CI does)
    with pytest.raises(StartupError, match="belongs to uid 65534"):
        prepare_socket_dir(str(other / "x.sock"))


# ---- a /tmp/tierfs-UID another user made first (issue 26, S6)
VICTIM = 54321  # a uid with no /run/user/UID: its run dir is the /tmp fallback
SQUATTER = 65534
AS_USER = Path(__file__).resolve().parents[1] / "posix" / "as_user.py"


def as_user(uid: int, ops: list) -> list[dict]:
    """ops run by a child as uid (tests/posix/as_user.py)."""
    req = {"uid": uid, "gid": uid, "groups": [], "umask": 0o022, "ops": ops}
    r = subprocess.run([sys.executable, "-S", "-I", str(AS_USER)], input=json.dumps(req),
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _clean_victim_dirs() -> None:
    for name in os.listdir("/tmp"):
        if name == f"tierfs-{VICTIM}" or name.startswith(f"tierfs-{VICTIM}."):
            subprocess.run(["rm", "-rf", "--", f"/tmp/{name}"], check=False)


@pytest.fixture
def squatted():
    """/tmp/tierfs-VICTIM and a dir of the victim's name pattern beside it, for the
    squatter to make; and a dir VICTIM can reach (fusermount3 runs as the real uid) for
    the mount. All removed after."""
    assert not os.path.isdir(f"/run/user/{VICTIM}")
    _clean_victim_dirs()
    public = Path(tempfile.mkdtemp(prefix="tierfs-s6-"))
    public.chmod(0o755)
    try:
        yield f"/tmp/tierfs-{VICTIM}", f"/tmp/tierfs-{VICTIM}.00000000", public
    finally:
        _clean_victim_dirs()
        subprocess.run(["rm", "-rf", "--", str(public)], check=False)


def test_a_squatted_tmp_dir_is_left_aside_and_the_victim_mounts(squatted):
    fixed, fake, tmp_path = squatted
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    for d in (src, mnt):
        d.mkdir()
    os.chown(mnt, VICTIM, VICTIM)  # fusermount3 mounts only where the user may write
    (src / "hello").write_bytes(b"hello")
    sock = os.path.basename(control_socket(str(mnt), VICTIM))
    assert [r.get("err") for r in as_user(SQUATTER, [
        ["mkdir", fixed], ["chmod", fixed, 0o777], ["bind", f"{fixed}/{sock}"],
        ["mkdir", fake], ["bind", f"{fake}/{sock}"]])] == [None] * 5
    # the daemon of a mount the kernel records as VICTIM's (real uid VICTIM; effective
    # root: VICTIM cannot run this checkout's Python)
    r = subprocess.run(["setpriv", f"--ruid={VICTIM}", "--", sys.executable, "-m", "tierfs",
                        "mount", f"file://{src}", str(mnt), "--cache-dir", str(tmp_path / "c"),
                        "--allow-other"],
                       capture_output=True, text=True, timeout=60, cwd="/",
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    try:
        assert (mnt / "hello").read_bytes() == b"hello"
        [line] = [ln for ln in (tmp_path / "c" / "tierfs.log").read_text().splitlines()
                  if "WARNING" in ln]
        assert (f"{fixed} is not this user's (a directory of uid {SQUATTER}; another user "
                "made it first?): the control socket is in /tmp/tierfs-54321.") in line
        [own] = aside_dirs(VICTIM)
        st = os.lstat(own)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (VICTIM, 0o700)
        assert os.path.exists(f"{own}/{sock}")
        assert run_dir(VICTIM) == own and control_socket(str(mnt), VICTIM) == f"{own}/{sock}"
        # root's client finds the daemon (not the squatter's sockets) by the mount's owner
        r = subprocess.run([sys.executable, "-m", "tierfs", "status", "--json", str(mnt)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["mountpoint"] == str(mnt)
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, check=False)
        deadline = time.monotonic() + 30
        while is_mountpoint(str(mnt)) and time.monotonic() < deadline:
            time.sleep(0.05)
