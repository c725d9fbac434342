"""When a listing sends HEADs for the metadata a LIST does not carry (--meta-head-max-size),
on the in-process core over a FileBackend whose objects carry tierfs metadata."""

from __future__ import annotations

import os
import stat

import pytest
from faultkit import FaultBackend, unavailable

from tierfs.index.attrs import DIR, FIFO, FILE, Attrs
from tierfs.backend.file import FileBackend
from tierfs.index.inodes import ROOT_INO
from unitkit import core, sample

OTHER_NODE = Attrs(mode=0o600, uid=1234, gid=5678, mtime_ns=1_500_000_000_000_000_001)


def heads(c) -> float:
    return sample(c.metrics, "tierfs_backend_requests_total", {"op": "head"})


def tree(backend) -> None:
    """What another node made: a big private file, a fifo, an empty 0700 directory (the
    FileBackend keeps a marker only for an empty directory)."""
    backend.put("big.bin", b"x" * 10_000, OTHER_NODE.to_metadata(FILE))
    backend.put("pipe", b"", OTHER_NODE.to_metadata(FIFO))
    backend.put("private/", b"", OTHER_NODE.changed(mode=0o700).to_metadata(DIR))
    backend.put("plain/g", b"z", {})  # a prefix only, no marker


def shown(c) -> dict[bytes, tuple[int, int | None, int | None]]:
    return {name: (node.kind, node.attrs.mode, node.attrs.uid)
            for name, node in c.ns.meta.inodes.children(ROOT_INO)}


@pytest.mark.parametrize("option,big,private", [
    (0, (FILE, None, None), (DIR, None, None)),  # single user: the empty objects only
    (-1, (FILE, None, None), (DIR, None, None)),  # off
    (5 << 40, (FILE, 0o600, 1234), (DIR, 0o700, 1234)),  # all
])
async def test_a_listing_heads_what_the_option_says_once(tmp_path, option, big, private):
    async with core(str(tmp_path), meta_head_max_size=option,
                    allow_other=option == 5 << 40) as c:
        tree(c.backend)
        await c.ns.listdir(ROOT_INO)
        got = shown(c)
        assert got[b"big.bin"] == big
        assert got[b"private"] == private
        assert got[b"plain"][0] == DIR
        # the fifo is an empty object: its type is read unless heads are off
        assert got[b"pipe"] == ((FILE, None, None) if option < 0 else (FIFO, 0o600, 1234))
        sent = heads(c)
        expected = {0: 1, -1: 0, 5 << 40: 4}[option]  # all: big, pipe, private/, plain/
        assert sent == expected
        c.clock.advance(3600)  # a relisting asks nothing it already knows
        await c.ns.listdir(ROOT_INO)
        assert heads(c) == sent


async def test_a_directorys_own_listing_reads_its_marker(tmp_path):
    async with core(str(tmp_path)) as c:  # single user, default 0
        tree(c.backend)
        await c.ns.listdir(ROOT_INO)
        private = c.ns.meta.inodes.child(ROOT_INO, b"private")
        assert private.attrs.mode is None  # not shown yet: only listed as a prefix
        await c.ns.listdir(private.ino)
        private = c.ns.inode(private.ino)
        assert (private.attrs.mode, private.attrs.uid, private.attrs.mtime_ns) == (
            0o700, 1234, OTHER_NODE.mtime_ns)
        assert stat.S_IMODE(private.attrs.mode) == 0o700


async def test_a_failed_metadata_head_leaves_the_entry_plain_and_is_asked_again(tmp_path):
    src = os.path.join(str(tmp_path), "src")
    os.makedirs(src)
    fb = FaultBackend(FileBackend(src), seed=3)
    tree(fb.inner)
    async with core(str(tmp_path), backend=fb, bucket=src) as c:  # single user: HEAD empties
        fb.inject("head", unavailable(), count=1)
        await c.ns.listdir(ROOT_INO)  # the listing does not fail for want of metadata
        assert shown(c)[b"pipe"] == (FILE, None, None)
        c.clock.advance(3600)
        await c.ns.listdir(ROOT_INO)  # not remembered as read: the next listing asks again
        assert shown(c)[b"pipe"][0] == FIFO
