"""A Kubernetes namespace as a tenant (docs/tenants.md, "Readers"; issue 30): with the volume
attribute tenant_from: namespace, tierfs-csi names each pod's tenant at publish; when the
mount declares a tenant of that name (no prefixes needed), what the pod's reads bring into
the cache counts for it - its shares and quotas apply - and stays its after a restart."""

from __future__ import annotations

import os

import trio

from tierfs.config import parse_tenants

from unitkit import core, resolve, write

CS = 64 << 10  # unitkit's chunk size
POD = "7d1c0ab2-0000-4000-8000-000000000001"


async def _read_as_pod(c, key: str, data: bytes) -> None:
    async def as_pod(pid: int, uid: int) -> str:  # what callers.py reads from kubepods cgroups
        return f"pod:{POD}"

    c.io._reader = as_pod
    node = await resolve(c.ns, key)
    h, _ = await c.io.open(node.ino, os.O_RDONLY, 1234, 1000)
    assert bytes(await c.io.read(h.fh, 0, len(data))) == data
    await c.io.release(h.fh)
    with trio.fail_after(30):  # the disk tier writes fetched chunks in the background
        while len(c.walk.flights):
            await trio.sleep(0.01)


async def test_a_pods_reads_fill_the_cache_for_its_namespace_tenant(tmp_path):
    tenants = parse_tenants({"team-a": {"hard": "256K"}, "vision": {"prefixes": ["v/"]}})
    async with core(str(tmp_path), memory_bytes=0, tenants=tenants) as c:
        data = write(c.src, "v/shard0", os.urandom(8 * CS))
        c.core.usage.label_pod(POD, "team-a", name="train-0", tenant="team-a")
        await _read_as_pod(c, "v/shard0", data)
        shares = c.core.cache.tenant_bytes()
        # the key is vision's, but the pod's namespace brought it in: team-a's, within
        # its hard share (256 KiB = 4 chunks of 8: it evicted its own to take more)
        assert shares["team-a"].cached == 4 * CS
        assert shares["vision"].cached == 0
        await c.core.cache.flush_index()
    async with core(str(tmp_path), memory_bytes=0, tenants=tenants) as c:
        assert c.core.cache.tenant_bytes()["team-a"].cached == 4 * CS  # after a restart


async def test_a_tenant_the_mount_does_not_declare_leaves_the_keys_tenant(tmp_path):
    tenants = parse_tenants({"vision": {"prefixes": ["v/"]}})
    async with core(str(tmp_path), memory_bytes=0, tenants=tenants) as c:
        data = write(c.src, "v/shard0", os.urandom(2 * CS))
        c.core.usage.label_pod(POD, "team-b", tenant="team-b")
        await _read_as_pod(c, "v/shard0", data)
        shares = c.core.cache.tenant_bytes()
        assert "team-b" not in shares  # no label value nobody declared
        assert shares["vision"].cached == 2 * CS
