"""Persistence (issue 11, spec "Persistence"): types, owners, modes and times of a tree
survive an unmount + mount of the same cache dir, and show the same on a fresh cache dir
(another node) for directories made by mkdir, small files, symlinks and special files.
A fresh node also reads what other clients wrote: tierfs metadata from another node, and
s3fs's names (mode in decimal, uid, gid, mtime)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import posixkit as px
import pytest

N = px.NOBODY
G = 5678
DEV_C = os.makedev(12, 34)
DEV_B = os.makedev(8, 3)
T0 = 1_400_000_000_000_000_000  # explicit times: T0 + i s + i ns, one pair per node


def build(t: Path) -> list[Path]:
    """The tree of the test under t (made by root and, in t/sticky, by nobody); returns
    every node, deepest last."""
    os.mkdir(t, 0o751)  # nobody may pass through to t/sticky
    os.chown(t, 1234, G)
    px.creat(t / "small", 0o640, b"x" * 100)
    os.chown(t / "small", 1234, G)
    px.creat(t / "empty", 0o600)
    os.chown(t / "empty", N, N)
    px.creat(t / "suid", 0o755, b"#!/bin/sh\n")
    os.chmod(t / "suid", 0o6755)
    px.creat(t / "big", 0o604, b"b" * 8192)  # above --meta-head-max-size (4 KiB)
    os.chown(t / "big", 4321, G)
    os.mkfifo(t / "fifo", 0o620)
    os.mknod(t / "chr", stat.S_IFCHR | 0o600, DEV_C)
    os.mknod(t / "blk", stat.S_IFBLK | 0o640, DEV_B)
    px.bind_socket(t / "sock")
    os.symlink("small", t / "link")
    os.chown(t / "link", 1234, G, follow_symlinks=False)
    os.symlink("../nowhere/at/all", t / "dangling")
    os.mkdir(t / "sub")
    os.chown(t / "sub", 0, G)
    os.chmod(t / "sub", 0o2775)
    px.creat(t / "sub/inner", 0o644, b"inner")           # gid G from the sgid dir
    os.mkdir(t / "sub/deeper", 0o700)                     # gid G and S_ISGID inherited
    os.mkdir(t / "sticky")
    os.chmod(t / "sticky", 0o1777)
    r = px.as_user([["creat", t / "sticky/nf", 0o640], ["mkdir", t / "sticky/nd", 0o750],
                    ["symlink", "nf", t / "sticky/nl"], ["mkfifo", t / "sticky/np", 0o600]])
    assert r == [px.OK] * 4, r
    os.mkdir(t / "private", 0o700)  # root's: nobody may not list it, on any node
    px.creat(t / "private/x", 0o644, b"x")
    os.mkdir(t / "idx")
    nodes = sorted([p for p in t.rglob("*")] + [t], key=lambda p: -len(p.parts))
    # explicit times, deepest first, so no later change moves a directory's times ...
    for i, p in enumerate(nodes):
        os.utime(p, ns=(T0 + i * 1_000_000_001, T0 + i * 2_000_000_002), follow_symlinks=False)
    # ... but one: a create in idx moves idx's mtime/ctime, kept in this node's index only
    px.creat(t / "idx/late", 0o644, b"late")
    return nodes


def snapshot(t: Path) -> dict[str, tuple]:
    """{relative path: (type+mode, uid, gid, rdev, size, atime, mtime, ctime, link target)}
    of every node under t (t itself as "."), in the order of `ls -ld t; ls -lR t`: each
    directory is stat'ed before it is listed, each entry right after its parent's listing."""
    out = {}

    def row(p: Path) -> os.stat_result:
        st = os.lstat(p)
        target = os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
        size = st.st_size if not stat.S_ISDIR(st.st_mode) else None
        out[os.path.relpath(p, t)] = (px.fmt_mode(st.st_mode), st.st_uid, st.st_gid, st.st_rdev,
                                      size, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns,
                                      target)
        return st

    def walk(p: Path) -> None:
        subdirs = [p / n for n in sorted(os.listdir(p)) if stat.S_ISDIR(row(p / n).st_mode)]
        for sub in subdirs:
            walk(sub)

    row(t)
    walk(t)
    return out


FIELDS = ("mode", "uid", "gid", "rdev", "size", "atime", "mtime", "ctime", "target")


def diff(want: dict, got: dict, skip: dict[str, set] | None = None) -> list[str]:
    skip = skip or {}
    out = []
    for path in sorted(set(want) | set(got)):
        if path not in got or path not in want:
            out.append(f"{path}: {'missing' if path not in got else 'unexpected'}")
            continue
        for name, w, g in zip(FIELDS, want[path], got[path]):
            if name in skip.get(path, ()):
                continue
            if w != g:
                out.append(f"{path}: {name} {g!r}, expected {w!r}")
    return out


# objects other clients put in the bucket: key -> (body, metadata, expected snapshot row
# without times, expected (atime, mtime, ctime) or None where the metadata gives none)
S = 1_000_000_000
FOREIGN = {
    "ext/tierfs_fifo": (b"", {"tierfs-mode": "10640", "tierfs-uid": "1234", "tierfs-gid": "5678",
                              "tierfs-atime": "1400000000.000000001",
                              "tierfs-mtime": "1400000001.000000002",
                              "tierfs-ctime": "1400000002.000000003"},
                        (stat.S_IFIFO | 0o640, 1234, G, 0),
                        (1400000000 * S + 1, 1400000001 * S + 2, 1400000002 * S + 3)),
    "ext/tierfs_chr": (b"", {"tierfs-mode": "20600", "tierfs-uid": "0", "tierfs-gid": "0",
                             "tierfs-rdev": str(DEV_C)},
                       (stat.S_IFCHR | 0o600, 0, 0, DEV_C), None),
    "ext/s3fs_file": (b"hello", {"mode": str(stat.S_IFREG | 0o640), "uid": "1234",
                                 "gid": "5678", "mtime": "1500000000"},
                      (stat.S_IFREG | 0o640, 1234, G, 0), (None, 1500000000 * S, None)),
    "ext/s3fs_fifo": (b"", {"mode": str(stat.S_IFIFO | 0o600), "uid": "1234", "gid": "5678"},
                      (stat.S_IFIFO | 0o600, 1234, G, 0), None),
    "ext/s3fs_dir/": (b"", {"mode": str(stat.S_IFDIR | 0o750), "uid": "1234", "gid": "5678",
                            "mtime": "1500000000"},
                      (stat.S_IFDIR | 0o750, 1234, G, 0), (None, 1500000000 * S, None)),
}


def _built(ms):
    """A first mount with the tree of build() under t; returns (mount, t, snapshot)."""
    m = ms.start()
    t = m.path / "t"
    build(t)
    want = snapshot(t)
    assert want["sub/deeper"][:3] == (px.fmt_mode(stat.S_IFDIR | 0o2700), 0, G)
    assert want["sticky/nd"][:3] == (px.fmt_mode(stat.S_IFDIR | 0o750), N, N)
    return m, t, want


@pytest.mark.parametrize("mode", list(px.MODES))
def test_types_owners_modes_and_times_survive_remounts_and_show_on_another_node(ms, mode):
    """Four mounts of one bucket: the first builds the tree; the same cache dir mounted
    again, then with --metadata-ttl 0 (every lookup revalidates against the bucket), must
    show it unchanged; a fresh cache dir (another node) must show it too, at first sight
    (walked as `ls -lR`) and once every directory was listed. Every stage is checked before
    the test fails, so one run shows them all."""
    m, t, want = _built(ms)
    report: list[str] = []

    m = ms.remount(m)
    bad = diff(want, snapshot(t))
    report += ["remount of the same cache dir:", *bad] if bad else []

    m = ms.remount(m, "--metadata-ttl", "0")
    bad = diff(want, snapshot(t))
    report += ["same cache dir, --metadata-ttl 0:", *bad] if bad else []

    for key, (body, meta, _, _) in FOREIGN.items():
        ms.s3.put_object(Bucket=ms.bucket, Key=key, Body=body, Metadata=meta)
    # another node: nothing but the bucket. The size limit of the HEAD on first sight is
    # the spec's 4 KiB (given: the daemon's default may be lower)
    m = ms.remount(m, "-o", "meta_head_max_size=4K", cache="cache2", keep_args=False)
    # other clients' objects, each looked up at once (no listing of ext/ first)
    bad = []
    for key, (body, meta, (fmode, uid, gid, rdev), times) in FOREIGN.items():
        st = os.lstat(m.path / key.rstrip("/"))
        got = (px.fmt_mode(st.st_mode), st.st_uid, st.st_gid, st.st_rdev)
        if got != (px.fmt_mode(fmode), uid, gid, rdev):
            bad.append(f"{key}: {got}, expected {(px.fmt_mode(fmode), uid, gid, rdev)}")
        for name, w, g in zip(("atime", "mtime", "ctime"), times or (None,) * 3,
                              (st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns)):
            if w is not None and g != w:
                bad.append(f"{key}: {name} {px.fmt_ns(g)}, expected {px.fmt_ns(w)}")
    report += ["another node, other clients' objects:", *bad] if bad else []
    # a file above meta_head_max_size shows the LIST's size; its metadata comes later;
    # a directory's time changes caused by entries made in it stay in the first index
    skip = {"big": {"mode", "uid", "gid", "atime", "mtime", "ctime"}, "idx": {"mtime", "ctime"}}
    # the kernel checks permissions on the modes the daemon shows: once root has listed t
    # (`ls t`), nobody must still not get into root's 0700 directory t/private
    os.listdir(t)
    r = px.as_user([["listdir", t / "private"], ["stat", t / "private/x"]])
    if r != [{"err": "EACCES"}] * 2:
        report += ["another node, nobody's first access to root's 0700 t/private after "
                   f"`ls t` (EACCES expected): {r}"]
    bad = diff(want, snapshot(t), skip)     # as `ls -lR`: a directory before its listing
    report += ["another node, the tree at first sight (ls -lR):", *bad] if bad else []
    bad = diff(want, snapshot(t), skip)     # every directory listed by now
    report += ["another node, the tree once every directory was listed:", *bad] if bad else []
    assert not report, "\n  ".join(report)
