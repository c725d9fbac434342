"""What an open past --metadata-ttl sends to the store, as docs/semantics.md ("Freshness")
says: the kernel's lookups before it revalidate with LISTs (two one-key LISTs per path
component and a background listing of each directory) and the open then sends nothing;
only an open without a lookup before it revalidates with one HEAD. (A loader run showed
0 HEADs and 3-8 LISTs where the docs used to promise one HEAD.) An in-process core over a
FileBackend, with the core's fake clock."""

from __future__ import annotations

import os

import trio
import trio.testing

from unitkit import core, resolve, sample, write

TTL = 60.0


def _requests(c) -> dict[str, float]:
    return {op: sample(c.metrics, "tierfs_backend_requests_total", {"op": op})
            for op in ("list", "head", "get")}


async def _open_close(c, ino: int) -> None:
    h, _ = await c.io.open(ino, os.O_RDONLY, os.getpid(), os.getuid())
    await c.io.release(h.fh)


async def _settled(c, lists: float) -> dict[str, float]:
    """The counts once the background listings have sent `lists` LISTs and nothing runs."""
    with trio.fail_after(30):
        while _requests(c)["list"] < lists:
            await trio.sleep(0.01)
    await trio.testing.wait_all_tasks_blocked()
    return _requests(c)


async def test_open_past_the_ttl_revalidates_through_its_lookups_not_a_head(tmp_path):
    async with core(str(tmp_path), ttl_s=TTL) as c:
        for i in range(3):
            write(c.src, f"a/b/f{i}.bin", os.urandom(1000))
        node = await resolve(c.ns, "a/b/f0.bin")
        await _open_close(c, node.ino)
        first = await _settled(c, 9)

        c.clock.advance(TTL + 1)  # every name and listing is past its TTL
        node = await resolve(c.ns, "a/b/f1.bin")  # the kernel's lookups: a, b, f1.bin
        await _open_close(c, node.ino)
        now = await _settled(c, first["list"] + 9)
        # 3 lookups x 2 one-key LISTs + the background listings of /, a and b
        assert {op: now[op] - first[op] for op in now} == {"list": 9, "head": 0, "get": 0}

        c.clock.advance(TTL + 1)
        before = _requests(c)
        await _open_close(c, node.ino)  # no lookup: the kernel still had the entry
        after = _requests(c)
        assert {op: after[op] - before[op] for op in after} == {"list": 0, "head": 1, "get": 0}
