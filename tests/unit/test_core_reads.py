"""Namespace + FileIO + TierWalk (+ Prefetcher) over a FileBackend, under trio, no mount.

The core is wired as tierfs/mount/daemon.py wires it (unitkit.core); time is a fake clock, so
"past the metadata TTL" is a clock advance, never a sleep.
"""

import os
import random

import pytest
import trio

from tierfs.errors import IsADirectory, NameTooLong, NotADirectory, NotFound, StaleObject
from tierfs.index.inodes import ROOT_INO
from tierfs.read.prefetch import ReadPattern

from unitkit import FakeClock, core, resolve, sample, write

KIB = 1 << 10
CS = 64 * KIB


def names(entries):
    return [name for name, _ in entries]


# ---- namespace --------------------------------------------------------------------


def tree(src):
    write(src, "top.txt", b"top")
    write(src, "a/one.txt", b"1")
    write(src, "a/b/two.txt", b"22")
    write(src, "a/b/c/three.txt", b"333")
    os.makedirs(os.path.join(src, "empty"))  # a "empty/" marker object


async def test_listdir_of_nested_directories(tmp_path):
    async with core(str(tmp_path)) as c:
        tree(c.src)
        root = await c.ns.listdir(ROOT_INO)
        assert names(root) == [b"a", b"empty", b"top.txt"]
        kinds = {n: node.is_dir for n, node in root}
        assert kinds == {b"a": True, b"empty": True, b"top.txt": False}
        a = dict(root)[b"a"]
        assert a.key == "a/"
        assert names(await c.ns.listdir(a.ino)) == [b"b", b"one.txt"]
        b = await c.ns.lookup(a.ino, b"b")
        assert names(await c.ns.listdir(b.ino)) == [b"c", b"two.txt"]
        assert await c.ns.listdir(dict(root)[b"empty"].ino) == []
        three = await resolve(c.ns, "a/b/c/three.txt")
        assert (three.size, three.key, three.is_dir) == (3, "a/b/c/three.txt", False)


async def test_lookup_without_a_listing_agrees_with_the_listing(tmp_path):
    async with core(str(tmp_path)) as c:
        tree(c.src)
        two = await resolve(c.ns, "a/b/two.txt")  # targeted lookups, no LIST of a dir
        assert (two.size, two.key) == (2, "a/b/two.txt")
        b = await resolve(c.ns, "a/b")
        listed = dict(await c.ns.listdir(b.ino))
        assert listed[b"two.txt"].ino == two.ino
        assert (await resolve(c.ns, "empty")).is_dir


async def test_missing_names_and_wrong_kinds(tmp_path):
    async with core(str(tmp_path)) as c:
        tree(c.src)
        for path in ["nope", "a/nope", "a/b/c/three.txt/x", "a/one.txt/x"]:
            with pytest.raises((NotFound, NotADirectory)):
                await resolve(c.ns, path)
        top = await resolve(c.ns, "top.txt")
        with pytest.raises(NotADirectory):
            await c.ns.listdir(top.ino)
        with pytest.raises(IsADirectory):
            await c.io.open((await resolve(c.ns, "a")).ino)
        for bad in [b"", b".", b"..", b"a/b", b"\xff\xfe"]:
            with pytest.raises(NotFound):
                await c.ns.lookup(ROOT_INO, bad)
        with pytest.raises(NameTooLong):  # ENAMETOOLONG, as local filesystems answer
            await c.ns.lookup(ROOT_INO, b"x" * 256)


async def test_large_directory_lists_completely_in_stable_order(tmp_path):
    rng = random.Random(5000)
    async with core(str(tmp_path)) as c:
        big = os.path.join(c.src, "big")
        os.makedirs(big)
        expected = set()
        while len(expected) < 5000:
            name = "".join(rng.choice("abcXYZ019-_.~") for _ in range(rng.randint(1, 12)))
            if name not in (".", ".."):
                expected.add(name)
        for name in expected:
            open(os.path.join(big, name), "wb").close()
        os.makedirs(os.path.join(big, "sub.d"))  # and one directory among them
        d = await resolve(c.ns, "big")
        lists_before = c.lists()
        first = await c.ns.listdir(d.ino)
        assert c.lists() - lists_before >= 5  # FileBackend pages at 1000 keys
        want = sorted(n.encode() for n in expected | {"sub.d"})
        assert names(first) == want
        assert len({node.ino for _, node in first}) == 5001
        c.clock.advance(3600)  # past the TTL: a fresh LIST walk, same answer, same inodes
        second = await c.ns.listdir(d.ino)
        assert [(n, node.ino) for n, node in second] == [(n, node.ino) for n, node in first]


async def test_listing_is_cached_for_the_ttl_then_refreshed(tmp_path):
    async with core(str(tmp_path), ttl_s=60) as c:
        write(c.src, "a", b"1")
        assert names(await c.ns.listdir(ROOT_INO)) == [b"a"]
        write(c.src, "b", b"2")
        lists = c.lists()
        c.clock.advance(59)
        assert names(await c.ns.listdir(ROOT_INO)) == [b"a"]
        with pytest.raises(NotFound):  # the complete listing answers negatively
            await c.ns.lookup(ROOT_INO, b"b")
        assert c.lists() == lists
        c.clock.advance(2)
        assert names(await c.ns.listdir(ROOT_INO)) == [b"a", b"b"]


async def test_negative_lookup_expires_with_the_ttl(tmp_path):
    async with core(str(tmp_path), ttl_s=60) as c:
        with pytest.raises(NotFound):
            await c.ns.lookup(ROOT_INO, b"late")
        write(c.src, "late", b"x")
        with pytest.raises(NotFound):
            await c.ns.lookup(ROOT_INO, b"late")
        c.clock.advance(61)
        assert (await c.ns.lookup(ROOT_INO, b"late")).size == 1


async def test_deleted_file_disappears_after_the_ttl(tmp_path):
    async with core(str(tmp_path), ttl_s=60) as c:
        write(c.src, "d/gone", b"x")
        write(c.src, "d/kept", b"y")
        d = await resolve(c.ns, "d")
        assert names(await c.ns.listdir(d.ino)) == [b"gone", b"kept"]
        os.unlink(os.path.join(c.src, "d", "gone"))
        c.clock.advance(61)
        assert names(await c.ns.listdir(d.ino)) == [b"kept"]
        with pytest.raises(NotFound):
            await c.ns.lookup(d.ino, b"gone")


# ---- reads --------------------------------------------------------------------------


async def read_all(io, fh, size, step=100 * KIB):
    out = []
    for off in range(0, size, step):
        out.append(await io.read(fh, off, step))
    return b"".join(out)


@pytest.mark.parametrize("memory_bytes", [8 << 20, 0], ids=["memory+disk", "disk-only"])
async def test_random_reads_are_byte_exact(tmp_path, memory_bytes):
    rng = random.Random(42)
    size = 7 * CS + 12345
    data = rng.randbytes(size)
    async with core(str(tmp_path), memory_bytes=memory_bytes) as c:
        write(c.src, "dir/data.bin", data)
        node = await resolve(c.ns, "dir/data.bin")
        assert node.size == size
        h, _ = await c.io.open(node.ino)
        for _ in range(3):  # cold, then warming, then warm
            for _ in range(60):
                off = rng.randrange(0, size + 10)
                n = rng.choice([1, 7, 4096, rng.randrange(1, 3 * CS)])
                assert await c.io.read(h.fh, off, n) == data[off:off + n], (off, n)
            # chunk and block boundaries, and the end
            for off, n in [(CS - 1, 2), (CS, CS), (16 * KIB - 1, 2), (size - 1, 100),
                           (size, 10), (size + 1000, 10), (0, size + 1)]:
                assert await c.io.read(h.fh, off, n) == data[off:off + n], (off, n)
        await c.io.release(h.fh)


async def test_sequential_read_of_a_whole_file(tmp_path):
    data = os.urandom(10 * CS + 1)
    async with core(str(tmp_path)) as c:
        write(c.src, "seq.bin", data)
        h, _ = await c.io.open((await resolve(c.ns, "seq.bin")).ino)
        assert await read_all(c.io, h.fh, len(data), step=128 * KIB) == data
        # read-ahead and reads together fetched each chunk once
        assert c.gets() == 11


async def test_empty_file_reads_empty(tmp_path):
    async with core(str(tmp_path)) as c:
        write(c.src, "empty.bin", b"")
        h, _ = await c.io.open((await resolve(c.ns, "empty.bin")).ino)
        assert await c.io.read(h.fh, 0, 4096) == b""
        assert c.gets() == 0


async def test_second_read_comes_from_the_cache(tmp_path):
    data = os.urandom(CS)
    async with core(str(tmp_path)) as c:
        write(c.src, "f", data)
        h, _ = await c.io.open((await resolve(c.ns, "f")).ino)
        assert await c.io.read(h.fh, 0, CS) == data
        assert await c.io.read(h.fh, 100, 1000) == data[100:1100]
        assert c.gets() == 1
        assert sample(c.metrics, "tierfs_read_bytes_total", {"source": "backend"}) == CS
        assert sample(c.metrics, "tierfs_read_bytes_total", {"source": "memory"}) == 1000


async def test_a_chunk_fetched_on_a_miss_counts_from_the_store_until_read_again(tmp_path):
    # a handle reading a cold chunk in pieces: the miss fetches the whole chunk, and the
    # pieces after the first are the same fetch's bytes (not memory hits, which would make
    # a cold file look cached); what the handle reads again counts as the memory tier's
    data = os.urandom(CS)
    q = CS // 4

    def read_bytes(source: str) -> float:
        return sample(c.metrics, "tierfs_read_bytes_total", {"source": source})
    async with core(str(tmp_path)) as c:
        write(c.src, "pieces", data)
        h, _ = await c.io.open((await resolve(c.ns, "pieces")).ino)
        for off in (0, q):
            assert await c.io.read(h.fh, off, q) == data[off:off + q]
        assert (read_bytes("backend"), read_bytes("memory")) == (2 * q, 0)
        # half of it read before, half not: split between the two
        assert await c.io.read(h.fh, q, 2 * q) == data[q:3 * q]
        assert (read_bytes("backend"), read_bytes("memory")) == (3 * q, q)
        assert await c.io.read(h.fh, 3 * q, q) == data[3 * q:]
        assert await c.io.read(h.fh, 0, CS) == data  # all of it again
        assert (read_bytes("backend"), read_bytes("memory")) == (CS, CS + q)
        assert c.core.analytics.totals.read == {"backend": CS, "memory": CS + q}
        assert c.gets() == 1
        await c.io.release(h.fh)


async def test_concurrent_reads_of_a_cold_chunk_make_one_get(tmp_path):
    data = os.urandom(CS)  # exactly one chunk: no read-ahead to muddy the count
    async with core(str(tmp_path)) as c:
        write(c.src, "one.bin", data)
        node = await resolve(c.ns, "one.bin")
        handles = [(await c.io.open(node.ino))[0] for _ in range(16)]
        results = {}

        async def reader(i, h):
            off = (i * 4099) % (CS - 1000)
            results[i] = (off, await c.io.read(h.fh, off, 1000))

        async with trio.open_nursery() as n:
            for i, h in enumerate(handles):
                n.start_soon(reader, i, h)
        assert c.gets() == 1
        for off, got in results.values():
            assert got == data[off:off + 1000]


async def test_concurrent_reads_without_a_memory_tier_make_one_get(tmp_path):
    data = os.urandom(CS)
    async with core(str(tmp_path), memory_bytes=0) as c:
        write(c.src, "one.bin", data)
        node = await resolve(c.ns, "one.bin")
        handles = [(await c.io.open(node.ino))[0] for _ in range(8)]
        async with trio.open_nursery() as n:
            for h in handles:
                n.start_soon(c.io.read, h.fh, 0, CS)
        assert c.gets() == 1


async def test_cache_survives_a_restart_with_zero_gets(tmp_path):
    data = os.urandom(3 * CS + 1)
    async with core(str(tmp_path)) as c:
        write(c.src, "f", data)
        h, _ = await c.io.open((await resolve(c.ns, "f")).ino)
        assert await read_all(c.io, h.fh, len(data)) == data
        assert c.gets() == 4
    async with core(str(tmp_path), memory_bytes=0) as c:  # same cache dir, new process state
        h, _ = await c.io.open((await resolve(c.ns, "f")).ino)
        assert await read_all(c.io, h.fh, len(data), step=5 * KIB) == data
        assert c.gets() == 0
        assert sample(c.metrics, "tierfs_read_bytes_total", {"source": "disk"}) == len(data)


async def test_a_restart_asks_the_store_again_about_what_the_index_holds(tmp_path):
    """The index outlives the daemon, but what it says is as old as the daemon that wrote
    it: the object may have changed meanwhile (its last upload may even have completed
    after a kill -9, found by tests/writes/test_crash.py). Within the TTL as the clock
    goes, a restarted core still asks once, and opens the object's current version."""
    old, new = os.urandom(3 * CS), os.urandom(2 * CS + 5)
    async with core(str(tmp_path)) as c:
        write(c.src, "f", old)
        assert (await resolve(c.ns, "f")).size == len(old)
    write(str(tmp_path / "src"), "f", new)  # while no daemon runs
    async with core(str(tmp_path), clock=FakeClock(1_700_000_001.0)) as c:  # TTL is 60 s
        node = await resolve(c.ns, "f")
        assert node.size == len(new)
        h, _ = await c.io.open(node.ino)
        assert await read_all(c.io, h.fh, len(new)) == new


# ---- changed objects --------------------------------------------------------------


async def test_rewrite_before_the_first_read_serves_the_new_version(tmp_path):
    old, new = os.urandom(3 * CS), os.urandom(3 * CS)
    async with core(str(tmp_path)) as c:
        write(c.src, "f", old)
        h, _ = await c.io.open((await resolve(c.ns, "f")).ino)
        c.backend.put("f", new)  # new ETag, same size
        assert await c.io.read(h.fh, 0, 4 * CS) == new
        assert await c.io.read(h.fh, CS, 10) == new[CS:CS + 10]


async def test_rewrite_of_another_size_before_the_first_read_is_stale(tmp_path):
    """The kernel keeps the size it was told at the open: a new version of another size
    would be cut there (found by the model test: new bytes, old size), so ESTALE."""
    old, new = os.urandom(3 * CS), os.urandom(2 * CS + 5)
    async with core(str(tmp_path)) as c:
        write(c.src, "f", old)
        h, _ = await c.io.open((await resolve(c.ns, "f")).ino)
        c.backend.put("f", new)  # new ETag, new size
        with pytest.raises(StaleObject):
            await c.io.read(h.fh, 0, 4 * CS)
        h2, _ = await c.io.open((await c.ns.refresh(await resolve(c.ns, "f"))).ino)
        assert await c.io.read(h2.fh, 0, 4 * CS) == new  # a new open reads it


async def test_rewrite_after_bytes_were_served_is_stale(tmp_path):
    old = os.urandom(8 * CS)
    async with core(str(tmp_path)) as c:
        write(c.src, "f", old)
        h, _ = await c.io.open((await resolve(c.ns, "f")).ino)
        assert await c.io.read(h.fh, 0, 100) == old[:100]
        c.backend.put("f", os.urandom(8 * CS))
        with pytest.raises(StaleObject):
            await c.io.read(h.fh, 6 * CS, 100)  # not cached, not read ahead
        # what was served stays the old version, never a mix
        assert await c.io.read(h.fh, 0, 100) == old[:100]


async def test_new_open_past_the_ttl_reads_the_new_version(tmp_path):
    old = os.urandom(4 * CS)
    new = bytes(b ^ 0x5A for b in old)  # same size: only the ETag tells them apart
    async with core(str(tmp_path), ttl_s=60) as c:
        write(c.src, "f", old)
        ino = (await resolve(c.ns, "f")).ino
        h1, _ = await c.io.open(ino)
        assert await read_all(c.io, h1.fh, len(old)) == old  # old version fully cached
        c.backend.put("f", new)
        c.clock.advance(61)
        h2, _ = await c.io.open(ino)
        # h1 still reads the old version through the kernel's pages: h2 goes around them
        assert h2.direct
        await c.io.release(h1.fh)
        h3, keep = await c.io.open(ino)
        assert keep is False and not h3.direct  # the old pages are dropped now
        assert await read_all(c.io, h3.fh, len(new), step=5 * KIB) == new
        got = await read_all(c.io, h2.fh, len(new), step=7 * KIB)
        assert got == new
        for off in range(0, len(new), 9 * KIB):
            piece = await c.io.read(h2.fh, off, 3 * KIB)
            assert piece == new[off:off + 3 * KIB]
            assert piece != old[off:off + 3 * KIB]


async def test_open_within_the_ttl_keeps_kernel_pages(tmp_path):
    async with core(str(tmp_path), ttl_s=60) as c:
        write(c.src, "f", b"x" * 10)
        ino = (await resolve(c.ns, "f")).ino
        _, keep1 = await c.io.open(ino)
        _, keep2 = await c.io.open(ino)
        assert (keep1, keep2) == (False, True)


async def test_file_deleted_after_lookup_is_not_found_on_open_past_ttl(tmp_path):
    async with core(str(tmp_path), ttl_s=60) as c:
        write(c.src, "f", b"x")
        ino = (await resolve(c.ns, "f")).ino
        os.unlink(os.path.join(c.src, "f"))
        c.clock.advance(61)
        with pytest.raises(NotFound):
            await c.io.open(ino)


async def test_back_to_back_reads_without_a_memory_tier_make_one_get(tmp_path):
    # memory-cache-size=0 is a valid setting. Between the end of a chunk's flight and the
    # end of its disk fill the chunk is in no tier and no flight, so a second reader in
    # that window fetches it again.
    data = os.urandom(CS)
    async with core(str(tmp_path), memory_bytes=0) as c:
        write(c.src, "one.bin", data)
        h, _ = await c.io.open((await resolve(c.ns, "one.bin")).ino)
        assert await c.io.read(h.fh, 0, 100) == data[:100]
        assert await c.io.read(h.fh, 100, 100) == data[100:200]
        assert c.gets() == 1


async def test_a_slow_disk_never_holds_back_fetched_bytes_and_bounds_the_backlog(tmp_path):
    # the disk tier's writes hang: each reader still gets its bytes from its GET; after
    # max_unstored chunks wait for the disk, the next GET waits for a write to end
    import threading

    data = os.urandom(8 * CS)
    release = threading.Event()
    async with core(str(tmp_path), readahead=1) as c:
        write(c.src, "f.bin", data)
        node = await resolve(c.ns, "f.bin")
        disk = c.core.disk
        real_write = disk.write
        disk.write = lambda ckey, chunk: release.wait(30) and real_write(ckey, chunk)
        limit = c.walk.max_unstored
        try:
            for i in range(limit):  # each read is its own: random offsets, no read-ahead
                h, _ = await c.io.open(node.ino)
                off = (limit - i) * CS + 7
                with trio.fail_after(10):
                    assert await c.io.read(h.fh, off, 100) == data[off:off + 100]
            assert c.gets() == limit
            h, _ = await c.io.open(node.ino)
            with trio.move_on_after(0.3):
                await c.io.read(h.fh, 7, 100)
                raise AssertionError("a GET started while the disk was max_unstored behind")
            assert c.gets() == limit
        finally:
            release.set()
        with trio.fail_after(10):
            assert await c.io.read(h.fh, 7, 100) == data[7:107]
        assert c.gets() == limit + 1


async def test_one_continuation_of_a_random_reader_reads_nothing_ahead(tmp_path):
    async with core(str(tmp_path)) as c:
        write(c.src, "f.bin", os.urandom(1 << 20))
        obj = c.io._version(await resolve(c.ns, "f.bin"))
        p, pat = c.core.prefetcher, ReadPattern()
        p.on_read(obj, pat, 300_000, 304_096)  # a random read
        p.on_read(obj, pat, 304_096, 308_192)  # continues it once: a random reader's luck
        assert pat.window == 0 and not p._active
        p.on_read(obj, pat, 308_192, 312_288)  # twice in a row: a sequential reader
        assert pat.window > 0 and p._active
        p.on_read(obj, pat, 900_000, 904_096)  # and random again
        assert pat.window == 0
