"""Named regression tests of issue 25 (lost checkpoints: rows W1-W4, V1, V2) and issue 31
(open handles across a new version: rows H1, H2), against the suite's Ceph RGW through the
fault proxy (tests/faults/proxy.py).

Every row checks bytes exactly (sha256): in the bucket (boto3 straight to the RGW), through
the mount (its page cache dropped: fkit.read) and through a fresh mount on a new cache dir,
once the daemon has settled (`settle`: no upload pending, no multipart upload open, the
proxy quiet for a while, so an upload still running cannot land after the check).

The store is held where a row needs an upload pending: a `delay` of the key's upload
requests (forwarded late but within the daemon's timeout: the upload is in flight) or a
`503` (the upload fails and waits out its backoff); W1 also lets one race (nothing held).
None lets a request land after the daemon gave it up, so whatever the bucket holds at the
end is what tierfs sent last.

Versions (V1, H1, H2) are files of 4 KiB blocks each stamped with its version and index
(`stamped`), so a read that mixes versions, or returns another version's bytes, shows
which block came from where.

What semantics.md promises and each row holds it to:
  W1  rename(X, N) over an N whose upload is pending: the bucket's N is X's bytes, once, X is
      gone; the mount and a fresh mount agree.
  W2  the same, then a partial write into N: N is X with the write applied; no upload stuck
      on a server-side copy of a range the base does not have ("InvalidRange").
  W3  unlink of a file whose new version is pending while the store refuses: EIO (the
      store is down: docs, "When the object store is down"), and then the new version is
      not lost; or success, and then the name is gone for good.
  W4  in W1-W3, V2 and the soak (test_faults_wb_soak.py): tierfs never aborts an upload
      it is still running ("aborted an unfinished upload ... (id U)" and U used again, or
      "vanished": nobody else aborts uploads here).
  V1  one read() of a file whose version changed while its pages were partly in the page
      cache: one version's bytes, or old bytes and then ESTALE; never a mix.
  V2  a partial write right after rename(r, n): fails before success is returned, or
      reaches the bucket.
  H1  (two mounts) a handle opened after the TTL reads the new version whole, while an
      older handle of the old version is open and reads part or all of it (before the new
      open, or between the new open and its read).
  H2  an old handle never returns bytes of a version opened after it: old bytes or ESTALE.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import re
import subprocess
import sys
import time

import fkit
import pytest
from fkit import KiB, MiB

UPLOAD_OPS = {"PUT", "CreateMultipart", "UploadPart", "Complete"}
QUIET_S = 2.0  # no request through the proxy for this long: nothing in flight
SETTLE_S = 60.0  # longest wait for the daemon to finish its uploads
BLOCK = 4 * KiB


# ------------------------------------------------------------------ helpers
def status(m) -> dict:
    """`tierfs status MOUNT --json` (the daemon's control socket)."""
    r = subprocess.run([sys.executable, "-m", "tierfs", "status", m.mountpoint, "--json"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"tierfs status failed: {r.stderr}"
    return json.loads(r.stdout)


def evict(path) -> None:
    """`tierfs evict PATH`: the file's chunks leave both tiers of tierfs's cache."""
    r = subprocess.run([sys.executable, "-m", "tierfs", "evict", str(path)],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"tierfs evict failed: {r.stdout}{r.stderr}"


def settle(m, s3, bucket: str, proxy, timeout: float = SETTLE_S) -> None:
    """Wait until `m` has no upload pending, the bucket no open multipart upload, and the
    proxy has seen no request for QUIET_S (an upload task that outlived its file would
    still be sending). Fails with what is left after `timeout`."""
    deadline = time.monotonic() + timeout
    seen, since = proxy.requests(), time.monotonic()
    while True:
        fkit.assert_alive(m, "while settling")
        st = status(m)
        uploads = fkit.open_uploads(s3, bucket)
        n, now = proxy.requests(), time.monotonic()
        if n != seen:
            seen, since = n, now
        if st["uploads_pending"] == 0 and not uploads and now - since >= QUIET_S:
            return
        stuck = len(stuck_lines(m)) >= 3  # it will not get anywhere: no use waiting
        if now > deadline or stuck:
            raise AssertionError(
                f"the daemon did not settle {'(stuck)' if stuck else f'within {timeout:.0f}s'}"
                f": {st['uploads_pending']} "
                f"uploads pending, {st['dirty_bytes']} unsaved bytes, open multipart uploads "
                f"{uploads}, last request {now - since:.1f}s ago; log tail:\n"
                f"{fkit.tail(m.log_text(), 30)}")
        time.sleep(0.25)


def bucket_objects(s3, bucket: str) -> dict[str, bytes]:
    """Every object of the bucket (directory markers left out)."""
    return {k: fkit.s3_get(s3, bucket, k) for k in fkit.s3_sizes(s3, bucket)
            if not k.endswith("/")}


def label(data: bytes | None, known: dict[str, bytes]) -> str:
    """`data` described, and named when it is one of the `known` contents (or else, MiB by
    MiB, where its pieces come from)."""
    names = [name for name, v in known.items() if v == data]
    if names or data is None or not known:
        return fkit.short(data) + (f" (= {' = '.join(names)})" if names else "")
    runs: list[list] = []
    for off in range(0, len(data), MiB):
        piece = data[off:off + MiB]
        src = next((n for n, v in known.items() if v[off:off + MiB] == piece), "?")
        if runs and runs[-1][0] == src:
            runs[-1][2] = off + len(piece)
        else:
            runs.append([src, off, off + len(piece)])
    return fkit.short(data) + " = " + " + ".join(
        f"{src} [{_size(a)}, {_size(b)})" for src, a, b in runs)


def assert_bucket(s3, bucket: str, want: dict[str, bytes], what: str,
                  known: dict[str, bytes] | None = None) -> None:
    """The bucket holds exactly `want` (each key once, nothing else), byte for byte;
    `known` names contents for the message (e.g. {"old N": ...})."""
    have = bucket_objects(s3, bucket)
    known = known or {}
    diff = [f"{k}: bucket has {label(have.get(k), known)}, expected "
            f"{label(want.get(k), known)}"
            for k in sorted(have.keys() | want.keys()) if have.get(k) != want.get(k)]
    assert not diff, f"{what}: the bucket differs:\n" + "\n".join(diff)


def assert_view(root, want: dict[str, bytes], what: str,
                known: dict[str, bytes] | None = None) -> None:
    """The mount at `root` shows exactly `want`: its names and (page cache dropped) bytes."""
    names = sorted(os.listdir(root))
    assert names == sorted(want), f"{what}: the mount lists {names}, expected {sorted(want)}"
    for name, data in want.items():
        got, err = fkit.read_errno(root / name)
        assert got == data, (f"{what}: {name} reads {label(got, known or {})} (errno {err}), "
                             f"expected {label(data, known or {})}")


def assert_fresh_view(mounts, want: dict[str, bytes], what: str,
                      known: dict[str, bytes] | None = None) -> None:
    """A new mount on a new cache dir shows exactly `want`."""
    n = len(mounts.all)
    f = mounts.start(cache=f"cache-fresh{n}", mnt=f"mnt-fresh{n}")
    try:
        assert_view(f.path, want, f"{what} (a fresh mount on a new cache dir)", known)
    finally:
        f.stop()


_ABORTED = re.compile(r"aborted an unfinished upload of '(?P<key>[^']*)' \(id (?P<id>[^)]+)\)")


def self_aborts(log: str) -> list[str]:
    """W4: lines that show tierfs aborting an upload it still runs. Nobody else aborts
    uploads in these tests, so a "vanished" upload was aborted by tierfs itself; and an
    upload id that shows up again after tierfs aborted it was still in use."""
    bad = [ln for ln in log.splitlines() if "vanished" in ln]
    for m in _ABORTED.finditer(log):
        if m.group("id") in log[m.end():]:
            line = log[log.rfind("\n", 0, m.start()) + 1:log.find("\n", m.end())]
            bad.append(f"{line}   <- and id {m.group('id')} was used afterwards")
    return bad


def assert_no_self_aborts(m, what: str) -> None:
    bad = self_aborts(m.log_text())
    assert not bad, (f"W4 ({what}): tierfs aborted uploads it was still running "
                     f"({len(bad)} lines):\n" + "\n".join(bad[:20]))


def check_all(*checks) -> None:
    """Run every check; fail with all their failures (a row can fail in several ways)."""
    failed = []
    for check in checks:
        try:
            check()
        except AssertionError as e:
            failed.append(str(e))
    assert not failed, "\n".join(failed)


def stuck_lines(m) -> list[str]:
    """Retries of an upload that copies a range its base does not have (W2): they fail the
    same way for ever."""
    return [ln for ln in m.log_text().splitlines()
            if "InvalidRange" in ln and "trying again" in ln]


def assert_not_stuck(m, what: str) -> None:
    stuck = stuck_lines(m)
    assert not stuck, (f"{what}: an upload is stuck copying a range its base does not have "
                       f"({len(stuck)} lines):\n" + "\n".join(stuck[:10]))


def key_is(name: str):
    return lambda k: k == name


def hold_uploads(proxy, key: str, how: str):
    """Keep `key`'s upload pending: "inflight" delays each of its upload requests by 1.5 s
    (within the daemon's 2 s timeout: they go through, slowly); "retrying" answers them 503
    (the upload fails and waits out its backoff); "racing" holds nothing (the upload runs
    at the store's pace, racing the test). Remove the rule to let it finish."""
    if how == "racing":
        return proxy.inject("delay", UPLOAD_OPS, key=key_is(key), seconds=0.0, count=0)
    if how == "inflight":
        return proxy.inject("delay", UPLOAD_OPS, key=key_is(key), seconds=1.5)
    return proxy.inject("503", UPLOAD_OPS, key=key_is(key), retry_after=1)


def wait_held(proxy, key: str, m) -> None:
    """Until an upload request of `key` has reached the proxy (and is being held)."""
    fkit.eventually(lambda: any(e.key == key for e in proxy.events()), 30, interval=0.02,
                    alive_of=m)


# ------------------------------------------------------------------ stamped versions
def stamped(version: int, size: int) -> bytes:
    """`size` bytes of 4 KiB blocks, block i = 16-byte stamp "vVVV:bIIIIIIIIII" x 256."""
    assert size % BLOCK == 0
    return b"".join((b"v%03d:b%010d" % (version, i)) * (BLOCK // 16)
                    for i in range(size // BLOCK))


def versions_of(data: bytes, start: int = 0) -> list[int]:
    """The version of each 4 KiB block of `data`, read from offset `start` (a multiple of
    4 KiB): -1 for a block that is no version's block at its place (torn, shifted)."""
    out = []
    for i in range(0, len(data), BLOCK):
        blk = data[i:i + BLOCK]
        m = re.fullmatch(rb"v(\d{3}):b(\d{10})", blk[:16]) if len(blk) >= 16 else None
        if m is None or int(m.group(2)) != (start + i) // BLOCK or \
                blk != (blk[:16] * (BLOCK // 16))[:len(blk)]:
            out.append(-1)
        else:
            out.append(int(m.group(1)))
    return out


def describe(vs: list[int], offset: int = 0) -> str:
    """Runs of versions, e.g. "v0 [0 MiB, 2 MiB) + v1 [2 MiB, 64 MiB)"."""
    runs, start = [], 0
    for i in range(1, len(vs) + 1):
        if i == len(vs) or vs[i] != vs[start]:
            v = f"v{vs[start]}" if vs[start] >= 0 else "garbage"
            runs.append(f"{v} [{_size(offset + start * BLOCK)}, {_size(offset + i * BLOCK)})")
            start = i
    return " + ".join(runs[:12]) + (f" + ... ({len(runs)} runs)" if len(runs) > 12 else "")


def _size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n % MiB == 0 else f"{n / KiB:g} KiB"


def read_whole(fd: int, size: int) -> tuple[bytes, int | None]:
    """One read() of `size` bytes (more calls only if it returns short): (bytes, errno)."""
    out = bytearray()
    while len(out) < size:
        try:
            piece = os.read(fd, size - len(out))
        except OSError as e:
            return bytes(out), e.errno
        if not piece:
            break
        out += piece
    return bytes(out), None


# ------------------------------------------------------------------ W1, W4
@pytest.mark.parametrize("sizes,pending", [
    pytest.param((1 * MiB, 2 * MiB), "inflight", id="1M-over-2M-inflight"),
    pytest.param((20 * MiB, 24 * MiB), "inflight", id="20M-over-24M-inflight"),
    pytest.param((1 * MiB, 2 * MiB), "retrying", id="1M-over-2M-retrying"),
    pytest.param((20 * MiB, 24 * MiB), "racing", id="20M-over-24M-racing"),
])
def test_w1_rename_over_a_pending_upload(mounts, s3, bucket, proxy, sizes, pending):
    """W1 (+W4): --writeback, write+close X, write+close N, rename(X, N) while N's upload is
    pending (the checkpoint pattern: save to tmp, rename over the last one). Afterwards
    the bucket's N is X's bytes, exactly once, X is gone; the mount and a fresh mount show
    the same; tierfs aborted none of its own uploads. N's upload is in flight (its requests
    slowed), waiting out its backoff (503s), or racing the rename (nothing held: at
    5781247 this lost X one time in a few, with tierfs aborting its own upload: W4)."""
    m = mounts.start("--writeback")
    x, n_old = fkit.payload("w1.x", sizes[0]), fkit.payload("w1.n", sizes[1])
    fkit.write_file(m.path / "X", x)
    rule = hold_uploads(proxy, "N", pending)
    fkit.write_file(m.path / "N", n_old)
    if pending != "racing":
        wait_held(proxy, "N", m)  # N's upload has reached the store
    os.rename(m.path / "X", m.path / "N")
    proxy.remove(rule)
    settle(m, s3, bucket, proxy)
    want, known = {"N": x}, {"X": x, "the old N": n_old}
    check_all(lambda: assert_bucket(s3, bucket, want, "W1", known),
              lambda: assert_no_self_aborts(m, "W1"),
              lambda: assert_view(m.path, want, "W1", known))
    assert_fresh_view(mounts, want, "W1", known)


# ------------------------------------------------------------------ W2
@pytest.mark.parametrize("sizes", [(20 * MiB, 24 * MiB), (24 * MiB, 20 * MiB)],
                         ids=["N-bigger-than-X", "N-smaller-than-X"])
def test_w2_partial_write_after_rename_over_a_pending_upload(mounts, s3, bucket, proxy,
                                                             sizes):
    """W2: W1, then a partial write into N (the rest of N copied server-side from the
    renamed object): N is X with the write applied, in the bucket, the mount and a fresh
    mount; no upload stuck on a copy of a range the base does not have."""
    m = mounts.start("--writeback")
    x, n_old = fkit.payload("w2.x", sizes[0]), fkit.payload("w2.n", sizes[1])
    fkit.write_file(m.path / "X", x)
    rule = hold_uploads(proxy, "N", "inflight")
    fkit.write_file(m.path / "N", n_old)
    wait_held(proxy, "N", m)
    os.rename(m.path / "X", m.path / "N")
    patch, off = fkit.payload("w2.patch", 256 * KiB), 3 * MiB + 5
    fd = os.open(m.path / "N", os.O_WRONLY)
    try:
        assert os.pwrite(fd, patch, off) == len(patch)
    finally:
        os.close(fd)
    proxy.remove(rule)
    settle(m, s3, bucket, proxy)
    want = {"N": x[:off] + patch + x[off + len(patch):]}
    known = {"X": x, "the old N": n_old, "X patched": want["N"],
             "the old N patched": n_old[:off] + patch + n_old[off + len(patch):]}
    check_all(lambda: assert_bucket(s3, bucket, want, "W2", known),
              lambda: assert_not_stuck(m, "W2"),
              lambda: assert_no_self_aborts(m, "W2"),
              lambda: assert_view(m.path, want, "W2", known))
    assert_fresh_view(mounts, want, "W2", known)


# ------------------------------------------------------------------ W3
@pytest.mark.parametrize("store", ["down", "503"])
def test_w3_unlink_while_the_store_refuses_keeps_the_pending_version(mounts, s3, bucket,
                                                                    proxy, store):
    """W3: --writeback, v1 uploaded; the store refuses (connections refused, or 503 to
    everything); write+close v2 (acknowledged: journaled); unlink. semantics.md: with the
    store down a change fails with EIO: then v2 must survive it and reach the bucket once
    the store answers, and the mount, a remount and a fresh mount show v2. If the unlink
    succeeds instead, the name is gone everywhere for good."""
    m = mounts.start("--writeback")
    v1, v2 = fkit.payload("w3.v1", 3 * MiB), fkit.payload("w3.v2", 3 * MiB + 4 * KiB)
    fkit.write_file(m.path / "f", v1)
    settle(m, s3, bucket, proxy)
    assert_bucket(s3, bucket, {"f": v1}, "W3, v1 uploaded")
    if store == "down":
        proxy.down()
    else:
        proxy.inject("503", None, retry_after=1)
    fkit.write_file(m.path / "f", v2)  # write-back: close() returns once journaled
    try:
        os.unlink(m.path / "f")
        unlink_err = None
    except OSError as e:
        unlink_err = e.errno
    assert unlink_err in (None, errno.EIO), f"unlink failed with {errno.errorcode[unlink_err]}"
    if unlink_err is not None:
        assert os.path.exists(m.path / "f"), "the unlink failed, yet f is gone"
    proxy.heal()
    settle(m, s3, bucket, proxy)
    want = {} if unlink_err is None else {"f": v2}
    what = f"W3 (unlink {'succeeded' if unlink_err is None else 'failed with EIO'})"
    known = {"v1": v1, "v2": v2}
    check_all(lambda: assert_bucket(s3, bucket, want, what, known),
              lambda: assert_no_self_aborts(m, "W3"),
              lambda: assert_view(m.path, want, what, known))
    m.stop()
    m = mounts.again(m)
    settle(m, s3, bucket, proxy)
    assert_view(m.path, want, what + " after a remount", known)
    assert_bucket(s3, bucket, want, what + " after a remount", known)
    assert_fresh_view(mounts, want, what, known)


# ------------------------------------------------------------------ V1
def test_v1_one_read_never_mixes_versions_after_evict(mounts, s3, bucket, proxy):
    """V1: a 64 MiB object read once (page cache warm; then part of it leaves the page
    cache, as memory pressure does), evicted from tierfs's cache (`tierfs evict`),
    overwritten by another client; within the TTL, open + one read() of the whole file:
    all old bytes, all new bytes, or old bytes and then ESTALE. Never a mix."""
    size = 64 * MiB
    old, new = stamped(0, size), stamped(1, size)
    s3.put_object(Bucket=bucket, Key="mix", Body=old)
    m = mounts.start("--metadata-ttl", "60s")
    path = m.path / "mix"
    fd = os.open(path, os.O_RDONLY)
    try:
        got, err = read_whole(fd, size)
        assert err is None and got == old, f"the first read: {describe(versions_of(got))}"
        # the kernel drops what it likes of a file's pages; here all but the first 8 MiB
        os.posix_fadvise(fd, 8 * MiB, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    evict(path)
    s3.put_object(Bucket=bucket, Key="mix", Body=new)
    fd = os.open(path, os.O_RDONLY)
    try:
        got, err = read_whole(fd, size)
    finally:
        os.close(fd)
    vs = versions_of(got)
    seen = describe(vs)
    if err is not None:
        assert err == errno.ESTALE, f"V1: the read failed with {errno.errorcode[err]}: {seen}"
        assert set(vs) <= {0}, f"V1: bytes of another version before ESTALE: {seen}"
    else:
        assert len(got) == size, f"V1: the read returned {len(got)} bytes of {size}: {seen}"
        assert set(vs) in ({0}, {1}), f"V1: one read() mixed versions: {seen}"


# ------------------------------------------------------------------ V2
def test_v2_partial_write_right_after_rename_is_never_dropped(mounts, s3, bucket, proxy):
    """V2: --writeback, write+close r, rename(r, n) (n absent, or n's own upload in
    flight), then at once a partial write into n. Either the write (or its close) fails,
    and the bucket's n is r's bytes, or it succeeds and n is r with the write applied:
    never "success, then dropped"."""
    m = mounts.start("--writeback")
    want: dict[str, bytes] = {}
    acked: dict[str, bool] = {}
    known: dict[str, bytes] = {}
    for i, (size, over) in enumerate([(2 * MiB, False), (2 * MiB, True), (12 * MiB, False),
                                      (12 * MiB, True), (1 * MiB, True)]):
        r, n = f"r{i}", f"n{i}"
        data = fkit.payload(f"v2.r{i}", size)
        patch, off = fkit.payload(f"v2.p{i}", 100 * KiB), size // 3
        patched = data[:off] + patch + data[off + len(patch):]
        known |= {r: data, f"{r} patched": patched}
        if over:  # n exists, its upload in flight
            n_old = fkit.payload(f"v2.n{i}", size + 5 * KiB)
            known |= {f"the old {n}": n_old,
                      f"the old {n} patched": n_old[:off] + patch + n_old[off + len(patch):]}
            rule = hold_uploads(proxy, n, "inflight")
            fkit.write_file(m.path / n, n_old)
            wait_held(proxy, n, m)
        fkit.write_file(m.path / r, data)
        os.rename(m.path / r, m.path / n)
        try:
            fd = os.open(m.path / n, os.O_WRONLY)
            try:
                os.pwrite(fd, patch, off)
            finally:
                os.close(fd)
            acked[n], want[n] = True, patched
        except OSError as e:
            print(f"V2: the partial write into {n} failed: {e}")
            acked[n], want[n] = False, data
        if over:
            proxy.remove(rule)
    settle(m, s3, bucket, proxy)
    have = bucket_objects(s3, bucket)
    dropped = [n for n, ok in acked.items() if ok and have.get(n) != want[n]]
    assert not dropped, ("V2: partial writes returned success and are not in the bucket: "
                         + ", ".join(f"{n} is {label(have.get(n), known)}" for n in dropped))
    assert_bucket(s3, bucket, want, "V2", known)
    assert_view(m.path, want, "V2", known)
    assert_no_self_aborts(m, "V2")


# ------------------------------------------------------------------ H1, H2
TTL = ["--metadata-ttl", "2s"]
TTL_WAIT = 3.0  # past the TTL of both the index and the kernel's entries


def overwrite(how: str, s3, bucket: str, b, key: str, data: bytes) -> None:
    """A new version of `key` from another client: boto3, or the second mount `b`."""
    if how == "boto3":
        s3.put_object(Bucket=bucket, Key=key, Body=data)
    else:
        fkit.write_file(b.path / key, data)  # default mode: close() returns once uploaded


@pytest.mark.parametrize("old_read,when,writer", [
    ("part", "after-new-open", "mount"),
    ("whole", "after-new-open", "boto3"),
    ("whole", "before-new-open", "mount"),
])
def test_h1_new_handle_after_the_ttl_reads_the_new_version_whole(mounts, s3, bucket, proxy,
                                                                 old_read, when, writer):
    """H1: two mounts of the bucket (separate cache dirs, --metadata-ttl 2s). On A a handle
    opened before the overwrite reads 8 MiB (or the whole file) of v0; the file is
    overwritten (boto3, or through B); after the TTL a new handle opens on A; the old
    handle reads the same range again (before the new open, or after it: its cached v0
    bytes); then the new handle reads the whole file in one read(): every byte of v1."""
    size = 24 * MiB
    v0, v1 = stamped(0, size), stamped(1, size)
    s3.put_object(Bucket=bucket, Key="f", Body=v0)
    a = mounts.start(*TTL, cache="cache-a", mnt="mnt-a")
    b = mounts.start(*TTL, cache="cache-b", mnt="mnt-b") if writer == "mount" else None
    span = 8 * MiB if old_read == "part" else size
    old = os.open(a.path / "f", os.O_RDONLY)
    try:
        first = os.pread(old, span, 0)
        assert first == v0[:span], describe(versions_of(first))
        overwrite(writer, s3, bucket, b, "f", v1)
        time.sleep(TTL_WAIT)
        if when == "before-new-open":
            again, err = pread_errno(old, span, 0)
        new = os.open(a.path / "f", os.O_RDONLY)
        try:
            if when == "after-new-open":
                again, err = pread_errno(old, span, 0)
            got, err_new = read_whole(new, size)
        finally:
            os.close(new)
    finally:
        os.close(old)
    assert err in (None, errno.ESTALE), f"the old handle's read failed: {errno.errorcode[err]}"
    assert set(versions_of(again)) <= {0}, \
        f"H2: the old handle's read returned {describe(versions_of(again))}"
    seen = describe(versions_of(got))
    assert err_new is None, \
        f"H1: the new handle's read failed ({errno.errorcode[err_new]}): {seen}"
    assert got == v1, f"H1: a handle opened after the TTL read {seen}; expected v1 whole"


def pread_errno(fd: int, size: int, offset: int) -> tuple[bytes, int | None]:
    try:
        return os.pread(fd, size, offset), None
    except OSError as e:
        return b"", e.errno


@pytest.mark.parametrize("new_size", [24 * MiB, 32 * MiB, 8 * MiB],
                         ids=["same-size", "bigger", "smaller"])
def test_h2_old_handle_never_returns_the_new_version(mounts, s3, bucket, proxy, new_size):
    """H2: a handle reads part of v0; the file is overwritten (boto3); after the TTL a new
    handle opens and reads v1 whole; then the old handle reads on (and again from the
    start): only v0 bytes, or ESTALE, never bytes of v1, and never cut short at v1's size
    (the kernel keeps one size per inode: the model test found the old handle reading 0
    bytes after an overwrite with an empty file)."""
    size = 24 * MiB
    v0, v1 = stamped(0, size), stamped(1, new_size)
    s3.put_object(Bucket=bucket, Key="f", Body=v0)
    a = mounts.start(*TTL, cache="cache-a", mnt="mnt-a")
    old = os.open(a.path / "f", os.O_RDONLY)
    served: collections.Counter[str] = collections.Counter()
    wrong: list[str] = []
    try:
        first = os.pread(old, 4 * MiB, 0)
        assert first == v0[:4 * MiB], describe(versions_of(first))
        s3.put_object(Bucket=bucket, Key="f", Body=v1)
        time.sleep(TTL_WAIT)
        new = os.open(a.path / "f", os.O_RDONLY)
        try:
            read_whole(new, new_size)  # what it gets is H1's business
            for off in [*range(4 * MiB, size, MiB), *range(0, 4 * MiB, MiB)]:
                try:
                    got = os.pread(old, MiB, off)
                except OSError as e:
                    served[errno.errorcode[e.errno]] += 1
                    continue
                if len(got) != MiB:
                    wrong.append(f"a read of 1 MiB at {off} of the old handle gave "
                                 f"{len(got)} bytes")
                vs = versions_of(got, off)
                for v in vs:
                    served[f"v{v}" if v >= 0 else "garbage"] += 1
                if set(vs) - {0}:
                    wrong.append(describe(vs, off))
        finally:
            os.close(new)
    finally:
        os.close(old)
    errs = {k for k in served if not k.startswith("v") and k != "garbage"} - {"ESTALE"}
    assert not errs, f"H2: the old handle's reads failed with {errs}: {dict(served)}"
    assert not wrong, (f"H2: the old handle returned bytes other than v0 (blocks: "
                       f"{dict(served)}):\n" + "\n".join(wrong[:10]))


@pytest.mark.parametrize("v0_via", ["boto3", "mount"])
@pytest.mark.parametrize("new_size", [0, 24], ids=["empty", "24B"])
def test_h3_old_handle_reads_on_after_a_new_handle_came_and_went(mounts, s3, bucket, proxy,
                                                                 new_size, v0_via):
    """H3 (found by the model test): v0 is written (boto3, or through the mount: its pages
    stay in the kernel); a handle reads v0 whole; v0 is overwritten with a
    much smaller v1 (boto3); after the TTL the file is opened, read and closed again
    (`cat`); then the old handle reads v0 again: v0 whole or ESTALE, never cut short at
    v1's size or v1's bytes."""
    size = 8 * MiB + 12 * KiB
    v0 = stamped(0, size)
    v1 = b"v1" * (new_size // 2)
    a = mounts.start(*TTL, cache="cache-a", mnt="mnt-a")
    if v0_via == "boto3":
        s3.put_object(Bucket=bucket, Key="f", Body=v0)
    else:
        fkit.write_file(a.path / "f", v0)  # default mode: close() returns once uploaded
    old = os.open(a.path / "f", os.O_RDONLY)
    try:
        assert os.pread(old, size + 4096, 0) == v0
        s3.put_object(Bucket=bucket, Key="f", Body=v1)
        time.sleep(TTL_WAIT)
        assert (a.path / "f").read_bytes() == v1, "a new open after the TTL reads v1"
        again, err = pread_errno(old, size + 4096, 0)
    finally:
        os.close(old)
    assert err in (None, errno.ESTALE), f"the old handle's read failed: {errno.errorcode[err]}"
    assert err is not None or again == v0, \
        f"the old handle read {len(again)} bytes: {describe(versions_of(again))}; want v0"
