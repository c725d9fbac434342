"""What a job names is resolved as the job's user (tierfs/cli/asuser.py), no Slurm needed:
symlinks and `..` as the kernel resolves them for that user, globs that cannot look into
folders the user cannot list, manifests that are regular files only, and one deadline
that kills the child whatever it is stuck on."""

import ctypes
import os
import subprocess
import time

import pytest

from tierfs.cli.asuser import (
    AsUserError,
    DeadlineExceeded,
    Identity,
    MAX_MANIFESTS,
    run_as,
)
from tierfs.config import MANIFEST_MAX_BYTES, format_size
from tierfs.mount.mountinfo import Mount
from tierfs.cli.slurm import Declared, Job, collect

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the job user needs root")

NOBODY = Job("1", "nobody", 65534, 65534)


def tree(public_dir):
    """public_dir/
         data/open/{a,b}.bin         0755 / 0644: nobody reads them
         data/closed/ (0700, root)   secret.bin inside
         data/mine.bin 0600 root     nobody cannot read it
         u/ (nobody's)  deep/x/y/    l -> deep/x/y
    """
    d = public_dir
    for p in ("data/open", "data/closed", "u/deep/x/y"):
        (d / p).mkdir(parents=True)
    for p in ("data", "data/open", "u", "u/deep", "u/deep/x", "u/deep/x/y"):
        (d / p).chmod(0o755)
    (d / "data/closed").chmod(0o700)
    for f in ("data/open/a.bin", "data/open/b.bin", "data/closed/secret.bin", "data/mine.bin"):
        (d / f).write_text(f)
        (d / f).chmod(0o644)
    (d / "data/mine.bin").chmod(0o600)
    (d / "u/l").symlink_to(d / "u/deep/x/y")
    for p in ("u", "u/deep", "u/deep/x", "u/deep/x/y"):
        os.lchown(d / p, 65534, 65534)
    return [Mount(str(d / "data"), "fuse.tierfs", {"user_id": "0"}),
            Mount(str(d / "u"), "fuse.tierfs", {"user_id": "0"})]


def test_symlink_and_dotdot_are_resolved_as_the_user(public_dir):
    table = tree(public_dir)
    p = public_dir
    # lexically u/l/../../../data/closed is data/closed; for the kernel l/.. is u/deep/x
    escape = f"{p}/u/l/../../../data/closed"
    paths, problems = collect(NOBODY, Declared(paths=(escape, f"{p}/data/closed",
                                                      f"{p}/data/closed/secret.bin")), table)
    assert paths == []
    assert problems == [f"missing for nobody: {escape}",
                        f"unreadable for nobody: {p}/data/closed",
                        f"unreadable for nobody: {p}/data/closed/secret.bin"]
    # a link the user may follow is followed, and the real path is what gets warmed
    paths, problems = collect(NOBODY, Declared(paths=(f"{p}/u/l/../../x",)), table)
    assert (paths, problems) == ([f"{p}/u/deep/x"], [])


def test_globs_do_not_reach_into_folders_the_user_cannot_list(public_dir):
    table = tree(public_dir)
    p = public_dir
    paths, problems = collect(NOBODY, Declared(paths=(f"{p}/data/**", f"{p}/data/*/*.bin")),
                              table)
    assert sorted(paths) == [f"{p}/data/open"]  # the folder nobody can read whole
    assert not any("closed/" in x or "secret" in x or "mine" in x for x in paths)
    # what was left out is named as the user sees it (the listing of data), nothing inside
    assert problems == [f"2 entries below {p}/data that nobody cannot read left out (first: "
                        f"{p}/data/closed)"]
    assert not any("secret" in x for x in problems)


def test_a_folder_read_whole_is_one_path_else_its_readable_files(public_dir):
    table = tree(public_dir)
    p = public_dir
    paths, problems = collect(NOBODY, Declared(paths=(f"{p}/data",)), table)
    assert paths == [f"{p}/data/open"]
    assert len(problems) == 1 and problems[0].startswith(f"2 entries below {p}/data that nobody")
    root = Job("1", "root", 0, 0)
    assert collect(root, Declared(paths=(f"{p}/data",)), table) == ([f"{p}/data"], [])


def test_manifests_are_regular_files_read_as_the_user(public_dir):
    table = tree(public_dir)
    p = public_dir
    fifos = [p / f"fifo{i}" for i in range(3)]
    for f in fifos:
        os.mkfifo(f)
        f.chmod(0o666)
    big = p / "big.warm"
    big.write_bytes(b"#" * (MANIFEST_MAX_BYTES + 1))
    big.chmod(0o644)
    link = p / "link.warm"
    good = p / "good.warm"
    good.write_text(f"# ok\n{p}/data/open/a.bin\n")
    good.chmod(0o644)
    link.symlink_to(good)
    started = time.monotonic()
    paths, problems = collect(NOBODY, Declared(manifests=(
        *map(str, fifos), "/dev/zero", str(big), str(link), "/etc/shadow")), table,
        deadline=time.monotonic() + 20)
    assert time.monotonic() - started < 10  # no FIFO was waited on (generous bound)
    assert paths == [f"{p}/data/open/a.bin"]
    assert problems == [*(f"manifest {f} is not a regular file" for f in fifos),
                        "manifest /dev/zero is not a regular file",
                        f"manifest {big} is larger than {format_size(MANIFEST_MAX_BYTES)}: split it",
                        "cannot read manifest /etc/shadow as nobody: Permission denied"]


def test_at_most_so_many_manifests(public_dir):
    table = tree(public_dir)
    m = public_dir / "m.warm"
    m.write_text(f"{public_dir}/data/open/a.bin\n")
    m.chmod(0o644)
    paths, problems = collect(NOBODY, Declared(manifests=(str(m),) * (MAX_MANIFESTS + 1)), table)
    assert paths == [f"{public_dir}/data/open/a.bin"]
    assert problems == [f"{MAX_MANIFESTS + 1} manifests, at most {MAX_MANIFESTS} are read: "
                        "the rest are left out"]


def _whoami(_):
    dumpable = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
    return [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups()),
            dumpable]


def test_the_child_is_the_user_for_good():
    who = Identity.of("nobody", 65534, 65534)
    uid, euid, gid, egid, groups, dumpable = run_as(who, _whoami, None, time.monotonic() + 20)
    assert (uid, euid, gid, egid) == (65534, 65534, 65534, 65534)
    assert groups == sorted(set(who.groups))
    assert dumpable == 0  # the user cannot ptrace it to change its answer


def _hang(_):
    time.sleep(60)


def _blocked_on_a_fifo(path):
    with open(path, "rb") as f:  # blocks until a writer comes: none will
        return f.read()


@pytest.mark.parametrize("work", [_hang, _blocked_on_a_fifo])
def test_one_deadline_kills_the_child(public_dir, work):
    fifo = public_dir / "fifo"
    os.mkfifo(fifo)
    fifo.chmod(0o666)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        run_as(Identity.of("nobody", 65534, 65534), work, str(fifo), started + 1.0)
    assert time.monotonic() - started < 5  # generous: the deadline was 1 s
    # the child is gone (killed and reaped): no process of nobody is left from us
    r = subprocess.run(["pgrep", "-u", "65534", "-P", str(os.getpid())], capture_output=True)
    assert r.stdout == b""


def _boom(_):
    raise ValueError("bad thing\nsecond line")


def test_an_error_in_the_child_is_one_line():
    with pytest.raises(AsUserError) as err:
        run_as(Identity.of("nobody", 65534, 65534), _boom, None, time.monotonic() + 20)
    assert str(err.value) == "bad thing"
