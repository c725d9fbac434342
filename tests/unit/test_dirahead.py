"""Directory read-ahead (tierfs/read/dirahead.py): the policy alone, then the core over a
FileBackend: files opened in listing order get the next small files fetched before their
open, bounded in files and bytes, never for big files, and stopped when the order breaks."""

import os
import random

import trio
import trio.testing

from tierfs.backend.file import FileBackend
from tierfs.read.dirahead import MAX_FILES, START, DirPattern

from faultkit import READS, FaultBackend, error
from unitkit import core, resolve, sample, write

KIB = 1 << 10
CS = 64 * KIB


# ---- the policy -------------------------------------------------------------------


def test_two_opens_in_order_start_it_and_each_next_one_doubles_the_window():
    p = DirPattern()
    assert p.opened(b"a", False) == 0  # the first open: nothing to follow yet
    assert p.opened(b"b", True) == 0  # once in order: a random reader's luck
    assert p.opened(b"c", True) == START  # twice in a row: a reader in order
    assert p.opened(b"d", True) == 2 * START
    for name in (b"e", b"f", b"g", b"h"):
        window = p.opened(name, True)
    assert window == MAX_FILES  # bounded


def test_an_open_out_of_order_stops_it_and_the_same_file_again_changes_nothing():
    p = DirPattern()
    for name, follows in ((b"a", False), (b"b", True), (b"c", True)):
        p.opened(name, follows)
    assert p.opened(b"c", False) == START  # c again (another handle): no news
    assert p.opened(b"q", False) == 0
    assert p.opened(b"r", True) == 0  # it starts over: two in a row again
    assert p.opened(b"s", True) == START


# ---- in the core ------------------------------------------------------------------


def folder(src, n: int, size=lambda i: 3000 + i) -> dict[str, bytes]:
    files = {f"img/{i:04}.jpg": os.urandom(size(i)) for i in range(n)}
    for key, data in files.items():
        write(src, key, data)
    return files


async def cat(c, key: str) -> bytes:
    node = await resolve(c.ns, key)
    h, _ = await c.io.open(node.ino)
    try:
        return bytes(await c.io.read(h.fh, 0, node.size + 1))
    finally:
        await c.io.release(h.fh)


async def settled(c) -> None:
    """Until no fetch is under way (they run in worker threads) and no task can run."""
    with trio.fail_after(10):
        await trio.testing.wait_all_tasks_blocked()
        while len(c.walk.flights):
            await trio.sleep(0.01)
        await trio.testing.wait_all_tasks_blocked()


def fetched_ahead(c) -> float:
    return sample(c.metrics, "tierfs_dir_readahead_files_total")


async def test_files_opened_in_listing_order_are_fetched_before_their_open(tmp_path):
    async with core(str(tmp_path)) as c:
        files = folder(c.src, 40)
        await c.ns.listdir((await resolve(c.ns, "img")).ino)  # the directory is listed
        keys = sorted(files)
        for key in keys:
            assert await cat(c, key) == files[key]
            await settled(c)
        # the first three opens wait for their own GET; after them, every file was in the
        # cache when it was opened: each object fetched once
        assert c.gets() == len(keys)
        assert fetched_ahead(c) == len(keys) - 3
        # and their first reads count as the store's bytes (not cache hits)
        store = sample(c.metrics, "tierfs_read_bytes_total", {"source": "backend"})
        assert store == sum(len(v) for v in files.values())


async def test_a_reader_in_random_order_gets_nothing_fetched_ahead(tmp_path):
    async with core(str(tmp_path)) as c:
        files = folder(c.src, 200)
        await c.ns.listdir((await resolve(c.ns, "img")).ino)
        keys = sorted(files)
        random.Random(7).shuffle(keys)
        for key in keys:
            assert await cat(c, key) == files[key]
        await settled(c)
        assert c.gets() == len(keys)  # no GET for a file nobody opened, none twice
        assert fetched_ahead(c) <= 8  # a lucky pair of neighbours may start one window


async def test_big_files_and_subdirectories_are_skipped_and_bytes_are_bounded(tmp_path):
    # chunk 64 KiB, read-ahead budget 2 chunks = 128 KiB: files of 40 KiB, every 5th one
    # bigger than a chunk, and a subdirectory in the listing
    async with core(str(tmp_path), readahead=2) as c:
        files = folder(c.src, 30, size=lambda i: CS + 1 if i % 5 == 4 else 40 * KIB)
        write(c.src, "img/0010.jpg.d/inner", b"x")
        d = await resolve(c.ns, "img")
        await c.ns.listdir(d.ino)
        ahead = c.core.fileio.dirahead
        keys = sorted(files)
        most = 0
        for key in keys[:12]:
            assert await cat(c, key) == files[key]
            most = max(most, ahead._bytes)
            assert ahead._bytes <= 2 * CS
        await settled(c)
        assert most > 0
        # what came next was fetched ahead, except the big files: those read-ahead left
        # alone (each gets the sequential read-ahead of its own reader)
        cached = {k: c.cache_rig.cache.has(c.io._version(await resolve(c.ns, k)).chunk_key(0))
                  for k in keys[12:]}
        assert any(cached[k] for k in keys[12:16])
        assert not any(cached[k] for k in keys[12:] if len(files[k]) > CS)


async def test_an_open_out_of_order_stops_what_was_not_started(tmp_path):
    async with core(str(tmp_path)) as c:
        files = folder(c.src, 80)
        await c.ns.listdir((await resolve(c.ns, "img")).ino)
        keys = sorted(files)
        for key in keys[:6]:  # the window grows to 32 files, 8 fetched at once
            await cat(c, key)
        ahead = c.core.fileio.dirahead
        assert ahead._bytes > 0
        node = await resolve(c.ns, keys[70])
        gets, under_way = c.gets(), ahead._fetches.borrowed_tokens
        h, _ = await c.io.open(node.ino)  # the reader jumps: nothing is kept ahead
        assert ahead._bytes == 0
        assert await c.io.read(h.fh, 0, node.size) == files[keys[70]]
        await c.io.release(h.fh)
        await settled(c)
        # the fetches under way at the jump finished, the jump's open made its own GET,
        # and none of the waiting ones started
        assert c.gets() <= gets + under_way + 1
        assert c.gets() < 6 + 32


async def test_read_ahead_that_fails_leaves_each_open_to_fetch_its_own(tmp_path):
    # the store refuses while read-ahead runs: nothing is reported as a bug, nothing
    # stays held or counted ahead, and every file is read whole once the store answers
    src = os.path.join(str(tmp_path), "src")
    os.makedirs(src)
    fb = FaultBackend(FileBackend(src), seed=3)
    async with core(str(tmp_path), backend=fb, bucket=src) as c:
        files = folder(src, 30)
        await c.ns.listdir((await resolve(c.ns, "img")).ino)
        keys = sorted(files)
        for key in keys[:3]:
            assert await cat(c, key) == files[key]
        refused = fb.inject(READS, error("injected: read-ahead refused"))
        ahead = c.core.fileio.dirahead
        node = await resolve(c.ns, keys[3])
        h, _ = await c.io.open(node.ino)  # starts fetches of the next files, all refused
        await settled(c)
        fb.remove(refused)
        assert refused.fired > 0  # read-ahead was refused
        assert await c.io.read(h.fh, 0, node.size) == files[keys[3]]
        await c.io.release(h.fh)
        for key in keys[4:]:
            assert await cat(c, key) == files[key]
        await settled(c)
        assert c.internal_errors("read-ahead") == 0
        assert ahead._bytes == 0 and c.cache_rig.memory.held_bytes == 0


async def test_nothing_stays_held_once_the_folder_is_read(tmp_path):
    async with core(str(tmp_path)) as c:
        files = folder(c.src, 50)
        await c.ns.listdir((await resolve(c.ns, "img")).ino)
        for i, key in enumerate(sorted(files)):
            assert await cat(c, key) == files[key]
            if i % 7 == 0:
                await settled(c)  # some fetches land before their open, some after
        await settled(c)
        ahead = c.core.fileio.dirahead
        assert ahead._bytes == 0 and not ahead._held
        assert c.cache_rig.memory.held_bytes == 0
