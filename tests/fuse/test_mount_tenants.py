"""Tenant quotas on a real mount (docs/tenants.md, "Quotas"): a tenant reading far past
its soft or hard share does not push another tenant's working set out; without quotas it
does once its reads outrank the working set's. (A one-pass scan does not, quotas or not:
the admission policy keeps its chunks out once the cache is full.)"""

from __future__ import annotations

import subprocess
import sys

from helpers import payload, put_many, read_uncached
from mounting import Mount

MiB = 1 << 20
WORK = {f"work/{i}.bin": payload(f"work{i}", MiB) for i in range(4)}
SCAN = {f"scan/{i:02}.bin": payload(f"scan{i}", MiB) for i in range(40)}
ARGS = ["--cache-size", "16M", "--chunk-size", "1M", "--memory-cache-size", "0"]


def tenants(quota: str = "") -> str:
    return f'tenants={{work = {{prefixes = ["work/"]}}, scan = {{prefixes = ["scan/"]{quota}}}}}'


def gets(m: Mount) -> float:
    return m.counter("tierfs_backend_requests_total", op="get")


def work_then_scan(m: Mount, passes: int = 4) -> tuple[float, float]:
    """The working set read once, then `passes` passes over a scan of 2.5x the cache;
    returns (GETs of the working set read again, the scanner's peak cached bytes). From its
    fourth pass on, a scan chunk's remembered reads (3) are more than twice a working-set
    chunk's (1): the admission policy lets it in (tierfs/cache/admission.py)."""
    for key, data in WORK.items():  # read once, before the scan
        assert read_uncached(m.path / key) == data
    peak = 0.0
    for _ in range(passes):
        for key, data in SCAN.items():
            assert read_uncached(m.path / key) == data
            peak = max(peak, m.counter("tierfs_tenant_cache_bytes", tenant="scan",
                                       kind="cached"))
    before = gets(m)
    for key, data in WORK.items():
        assert read_uncached(m.path / key) == data
    return gets(m) - before, peak


def test_a_scan_past_its_share_leaves_the_other_tenants_working_set(rgw, bucket, mounts):
    put_many(rgw.client(), bucket, {**WORK, **SCAN})
    with mounts.start(*ARGS, "-o", tenants(', hard = "50%"')) as m:
        regets, peak = work_then_scan(m)
        assert regets == 0
        assert peak <= 8 * MiB  # 50% of the 16 MiB budget
        assert m.counter("tierfs_tenant_cache_bytes", tenant="work", kind="cached") == 4 * MiB
        # a warm the cache could hold but that would pass the scanner's hard share is
        # refused up front, in one line with the numbers
        r = subprocess.run([sys.executable, "-m", "tierfs", "warm", str(m.path / "scan/0*")],
                           capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        assert "tenant scan are 10.0 MiB (10 files)" in lines[0]
        assert "hard share is 50% = 8.0 MiB of the 16.0 MiB budget" in lines[0]
    # a soft share: the scanner goes first when the cache must evict, down to its share
    with mounts.start(*ARGS, "-o", tenants(', soft = "50%"'), mnt="mnt2", cache="cache2") as m:
        regets, peak = work_then_scan(m)
        assert regets == 0
        assert m.counter("tierfs_tenant_cache_bytes", tenant="work", kind="cached") == 4 * MiB
    # the same reads without quotas: the scan pushes the working set out
    with mounts.start(*ARGS, "-o", tenants(), mnt="mnt3", cache="cache3") as m:
        regets, peak = work_then_scan(m)
        assert regets == 4
        assert peak > 8 * MiB
    # one pass of the scan without quotas: refused past the free room, the set stays
    with mounts.start(*ARGS, "-o", tenants(), mnt="mnt4", cache="cache4") as m:
        regets, peak = work_then_scan(m, passes=1)
        assert regets == 0
        assert m.counter("tierfs_cache_refused_chunks_total") >= 40 - 12
