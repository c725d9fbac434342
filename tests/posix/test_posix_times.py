"""Timestamps (issue 11 cause 5): atime, mtime and ctime of the node AND of its parent
directories after every operation, in the default and --writeback modes.

Each case of TIMES names a setup, an operation and, for each path it watches, what each of
(atime, mtime, ctime) must be afterwards:
  N    now: within [t0, t1] (posixkit.SLACK_NS either side), t0/t1 taken around the call
  K    now as the kernel gives it for UTIME_NOW: FUSE sends the kernel's coarse clock
       (current_time(), one tick behind), so within [t0 - posixkit.COARSE_NS, t1]
  =    unchanged
  int  exactly this many nanoseconds since the epoch (utimensat's explicit values)
Before the operation every watched path that exists gets old atime/mtime (posixkit.age), so
a move to "now" shows without sleeping; posixkit.after_ctimes() then waits a few ms until
the clock is past every ctime, so a ctime that did not move cannot pass as "now"."""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import posixkit as px
import pytest

T_A = 1_234_567_890_123_456_789  # explicit atime/mtime (ns kept)
T_M = 1_300_000_000_987_654_321

NEW = ("N", "N", "N")
CHANGED = ("=", "N", "N")      # a directory that gained or lost an entry; a written file
CTIME = ("=", "=", "N")        # chmod, chown, rename (the node itself)
SAME = ("=", "=", "=")
TRUNCATED = ("=", "K", "N")    # truncate: the kernel may pass its own (coarse) now as mtime


@dataclass
class Case:
    op: Callable[[Path], object]
    expect: dict[str, tuple]                    # path relative to the test dir ("." = it)
    setup: Callable[[Path], object] = lambda d: None
    moved: dict[str, str] = field(default_factory=dict)  # after-path -> before-path


def _file(d, name="f", data=b"0123456789"):
    px.creat(d / name, 0o644, data)


def _dirs(*names):
    def setup(d):
        for n in names:
            os.mkdir(d / n)
    return setup


def _seq(*fns):
    def run(d):
        for fn in fns:
            fn(d)
    return run


def _write(d):
    fd = os.open(d / "f", os.O_WRONLY)
    try:
        os.pwrite(fd, b"xy", 3)
    finally:
        os.close(fd)


def _append(d):
    with open(d / "f", "ab") as f:
        f.write(b"more")


def _ftruncate(d):
    fd = os.open(d / "f", os.O_WRONLY)
    try:
        os.ftruncate(fd, 4)
    finally:
        os.close(fd)


def _o_trunc(d):
    os.close(os.open(d / "f", os.O_WRONLY | os.O_TRUNC))


def _read(d):
    with open(d / "f", "rb") as f:
        assert f.read() == b"0123456789"


TIMES: dict[str, Case] = {
    # new nodes: all three now; the parent's mtime and ctime now
    "creat": Case(lambda d: px.creat(d / "n", 0o644), {"n": NEW, ".": CHANGED}),
    "creat_and_write": Case(lambda d: px.creat(d / "n", 0o644, b"data"), {"n": NEW, ".": CHANGED}),
    "mkdir": Case(lambda d: os.mkdir(d / "n"), {"n": NEW, ".": CHANGED}),
    "mkfifo": Case(lambda d: os.mkfifo(d / "n"), {"n": NEW, ".": CHANGED}),
    "mknod_chr": Case(lambda d: os.mknod(d / "n", stat.S_IFCHR | 0o600, os.makedev(1, 7)),
                      {"n": NEW, ".": CHANGED}),
    "mknod_reg": Case(lambda d: os.mknod(d / "n", stat.S_IFREG | 0o600), {"n": NEW, ".": CHANGED}),
    "bind": Case(lambda d: px.bind_socket(d / "n"), {"n": NEW, ".": CHANGED}),
    "symlink": Case(lambda d: os.symlink("f", d / "n"), {"n": NEW, ".": CHANGED}),
    "creat_in_subdir": Case(lambda d: px.creat(d / "s/n"), {"s/n": NEW, "s": CHANGED, ".": SAME},
                            setup=_dirs("s")),
    # removal: the parent changes
    "unlink": Case(lambda d: os.unlink(d / "f"), {".": CHANGED}, setup=_file),
    "unlink_fifo": Case(lambda d: os.unlink(d / "p"), {".": CHANGED},
                        setup=lambda d: os.mkfifo(d / "p")),
    "unlink_symlink": Case(lambda d: os.unlink(d / "l"), {".": CHANGED, "f": SAME},
                           setup=_seq(_file, lambda d: os.symlink("f", d / "l"))),
    "rmdir": Case(lambda d: os.rmdir(d / "s"), {".": CHANGED}, setup=_dirs("s")),
    "rmdir_in_subdir": Case(lambda d: os.rmdir(d / "s/t"), {"s": CHANGED, ".": SAME},
                            setup=_dirs("s", "s/t")),
    # rename: both parents change; the node's ctime only
    "rename_file": Case(lambda d: os.rename(d / "f", d / "g"), {"g": CTIME, ".": CHANGED},
                        setup=_file, moved={"g": "f"}),
    "rename_file_over_another": Case(
        lambda d: os.rename(d / "f", d / "g"), {"g": CTIME, ".": CHANGED},
        setup=_seq(_file, lambda d: _file(d, "g")), moved={"g": "f"}),
    "rename_file_across_dirs": Case(
        lambda d: os.rename(d / "a/f", d / "b/g"),
        {"b/g": CTIME, "a": CHANGED, "b": CHANGED, ".": SAME},
        setup=_seq(_dirs("a", "b"), lambda d: _file(d / "a")), moved={"b/g": "a/f"}),
    "rename_dir_across_dirs": Case(
        lambda d: os.rename(d / "a/x", d / "b/x"),
        {"b/x": CTIME, "a": CHANGED, "b": CHANGED, ".": SAME},
        setup=_dirs("a", "b", "a/x"), moved={"b/x": "a/x"}),
    "rename_symlink": Case(lambda d: os.rename(d / "l", d / "m"), {"m": CTIME, ".": CHANGED},
                           setup=lambda d: os.symlink("f", d / "l"), moved={"m": "l"}),
    "rename_fifo": Case(lambda d: os.rename(d / "p", d / "q"), {"q": CTIME, ".": CHANGED},
                        setup=lambda d: os.mkfifo(d / "p"), moved={"q": "p"}),
    # attribute changes: the node's ctime only, nothing of the parent
    "chmod_file": Case(lambda d: os.chmod(d / "f", 0o600), {"f": CTIME, ".": SAME}, setup=_file),
    "chmod_dir": Case(lambda d: os.chmod(d / "s", 0o700), {"s": CTIME, ".": SAME},
                      setup=_dirs("s")),
    "chmod_fifo": Case(lambda d: os.chmod(d / "p", 0o600), {"p": CTIME, ".": SAME},
                       setup=lambda d: os.mkfifo(d / "p")),
    "chown_file": Case(lambda d: os.chown(d / "f", 1234, 5678), {"f": CTIME, ".": SAME},
                       setup=_file),
    "chown_dir": Case(lambda d: os.chown(d / "s", 1234, 5678), {"s": CTIME, ".": SAME},
                      setup=_dirs("s")),
    "lchown_symlink": Case(lambda d: os.chown(d / "l", 1234, 5678, follow_symlinks=False),
                           {"l": CTIME, "f": SAME, ".": SAME},
                           setup=_seq(_file, lambda d: os.symlink("f", d / "l"))),
    # utimensat: the values given (ns kept), UTIME_NOW, UTIME_OMIT; ctime now
    "utime_explicit": Case(lambda d: px.utimensat(d / "f", T_A, T_M), {"f": (T_A, T_M, "N"),
                                                                       ".": SAME}, setup=_file),
    "utime_explicit_dir": Case(lambda d: px.utimensat(d / "s", T_A, T_M),
                               {"s": (T_A, T_M, "N"), ".": SAME}, setup=_dirs("s")),
    "utime_explicit_fifo": Case(lambda d: px.utimensat(d / "p", T_A, T_M),
                                {"p": (T_A, T_M, "N")}, setup=lambda d: os.mkfifo(d / "p")),
    "utime_os_utime_ns": Case(lambda d: os.utime(d / "f", ns=(T_A, T_M)), {"f": (T_A, T_M, "N")},
                              setup=_file),
    "utime_now": Case(lambda d: os.utime(d / "f"), {"f": ("K", "K", "N"), ".": SAME},
                      setup=_file),
    "utime_now_now": Case(lambda d: px.utimensat(d / "f", "now", "now"), {"f": ("K", "K", "N")},
                          setup=_file),
    "utime_atime_now_mtime_omit": Case(lambda d: px.utimensat(d / "f", "now", "omit"),
                                       {"f": ("K", "=", "N")}, setup=_file),
    "utime_atime_omit_mtime_explicit": Case(lambda d: px.utimensat(d / "f", "omit", T_M),
                                            {"f": ("=", T_M, "N")}, setup=_file),
    "utime_atime_explicit_mtime_now": Case(lambda d: px.utimensat(d / "f", T_A, "now"),
                                           {"f": (T_A, "K", "N")}, setup=_file),
    "utime_omit_omit": Case(lambda d: px.utimensat(d / "f", "omit", "omit"), {"f": SAME},
                            setup=_file),
    "utime_symlink_nofollow": Case(
        lambda d: px.utimensat(d / "l", T_A, T_M, follow=False),
        {"l": (T_A, T_M, "N"), "f": SAME, ".": SAME},
        setup=_seq(_file, lambda d: os.symlink("f", d / "l"))),
    "utime_through_symlink": Case(
        lambda d: px.utimensat(d / "l", T_A, T_M), {"f": (T_A, T_M, "N"), "l": SAME},
        setup=_seq(_file, lambda d: os.symlink("f", d / "l"))),
    # data: mtime and ctime now, atime kept, the parent untouched
    "write": Case(_write, {"f": CHANGED, ".": SAME}, setup=_file),
    "append": Case(_append, {"f": CHANGED, ".": SAME}, setup=_file),
    "truncate_shrink": Case(lambda d: os.truncate(d / "f", 3), {"f": TRUNCATED, ".": SAME},
                            setup=_file),
    "truncate_grow": Case(lambda d: os.truncate(d / "f", 100), {"f": TRUNCATED}, setup=_file),
    "truncate_same_size": Case(lambda d: os.truncate(d / "f", 10), {"f": TRUNCATED}, setup=_file),
    "truncate_empty_to_zero": Case(lambda d: os.truncate(d / "f", 0), {"f": TRUNCATED},
                                   setup=lambda d: _file(d, data=b"")),
    "ftruncate": Case(_ftruncate, {"f": TRUNCATED, ".": SAME}, setup=_file),
    "open_o_trunc": Case(_o_trunc, {"f": TRUNCATED, ".": SAME}, setup=_file),
    # reads change nothing (noatime)
    "read": Case(_read, {"f": SAME, ".": SAME}, setup=_file),
    "readdir": Case(lambda d: os.listdir(d / "s"), {"s": SAME}, setup=_seq(_dirs("s"),
                                                                        lambda d: _file(d / "s"))),
    "readlink": Case(lambda d: os.readlink(d / "l"), {"l": SAME},
                     setup=lambda d: os.symlink("f", d / "l")),
}

NAMES = ("atime", "mtime", "ctime")


@pytest.mark.parametrize("case", list(TIMES))
def test_times(d, case):
    c = TIMES[case]
    c.setup(d)
    before_path = {p: c.moved.get(p, p) for p in c.expect}
    existing = [d / b for b in before_path.values() if os.path.lexists(d / b)]
    # children before the directory: aging a child changes no time of its parent
    px.age(*sorted(existing, key=lambda p: -len(p.parts)))
    before = {p: os.lstat(d / b) for p, b in before_path.items() if os.path.lexists(d / b)}
    t0 = px.after_ctimes(*existing)
    c.op(d)
    t1 = time.time_ns()
    bad = []
    for p, want in c.expect.items():
        st = os.lstat(d / p)
        got = (st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns)
        old = before.get(p)
        for i, (w, g) in enumerate(zip(want, got)):
            if w in ("N", "K"):
                lo = t0 - (px.COARSE_NS if w == "K" else 0)
                ok = px.is_now(g, lo, t1)
                what = f"now [{px.fmt_ns(lo)}, {px.fmt_ns(t1)}]"
            elif w == "=":
                assert old is not None, f"{p} is new: '=' makes no sense"
                w = (old.st_atime_ns, old.st_mtime_ns, old.st_ctime_ns)[i]
                ok = g == w
                what = f"unchanged {px.fmt_ns(w)}"
            else:
                ok = g == w
                what = px.fmt_ns(w)
            if not ok:
                bad.append(f"{p}: {NAMES[i]} {px.fmt_ns(g)}, expected {what}")
    assert not bad, f"{case}:\n  " + "\n  ".join(bad)


def test_times_of_an_open_file_follow_writes_through_fstat(d):
    px.creat(d / "f", 0o644, b"abc")
    px.age(d / "f")
    fd = os.open(d / "f", os.O_RDWR)
    try:
        t0 = px.after_ctimes(d / "f")
        os.write(fd, b"x")
        t1 = time.time_ns()
        st = os.fstat(fd)
        assert st.st_atime_ns == px.OLD_ATIME_NS
        assert px.is_now(st.st_mtime_ns, t0, t1), px.fmt_ns(st.st_mtime_ns)
        assert px.is_now(st.st_ctime_ns, t0, t1), px.fmt_ns(st.st_ctime_ns)
    finally:
        os.close(fd)


def test_utime_nanoseconds_survive_the_attribute_cache(d, pmount):
    """A second process (as nobody, which passes through the same kernel inode) and a fresh
    lookup after the parent's listing changed see the same nanoseconds."""
    px.creat(d / "f")
    os.utime(d / "f", ns=(T_A, T_M))
    px.creat(d / "other")  # the parent changes; its entries are looked up again
    r = px.as_user([["stat", d / "f"]])[0]["ok"]
    assert (r["atime_ns"], r["mtime_ns"]) == (T_A, T_M)
    names = sorted(os.listdir(d))
    assert names == ["f", "other"]
    st = os.stat(d / "f")
    assert (st.st_atime_ns, st.st_mtime_ns) == (T_A, T_M)


# a directory another client made as a prefix only (no marker object)
PRELOAD = {"prefix_dir/a": (b"a", {})}


def test_prefix_directory_times_follow_changes_inside(pmount):
    p = pmount.m.path / "prefix_dir"
    assert os.listdir(p) == ["a"]
    px.age(p)
    t0 = px.after_ctimes(p)
    px.creat(p / f"new-{pmount.mode}")
    t1 = time.time_ns()
    st = os.stat(p)
    assert st.st_atime_ns == px.OLD_ATIME_NS
    assert px.is_now(st.st_mtime_ns, t0, t1), px.fmt_ns(st.st_mtime_ns)
    assert px.is_now(st.st_ctime_ns, t0, t1), px.fmt_ns(st.st_ctime_ns)
