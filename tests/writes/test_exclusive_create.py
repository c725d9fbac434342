"""O_CREAT|O_EXCL across nodes (issue 31 row H3): two mounts of one bucket, separate cache
dirs, race an exclusive create of the same new name. Exactly one may win; the other gets
EEXIST from open(), and the bucket holds what the winner wrote and had acknowledged.
docs/semantics.md, "Exclusive create (O_EXCL) across nodes".
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import wkit

ROUNDS = 50
EXCL = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def _race(paths: list, barrier: threading.Barrier, payloads: list[bytes]) -> list:
    """Each node's outcome of one exclusive create (and, if it won, write + close): "won",
    or the errno it got."""
    out: list = [None] * len(paths)

    def node(i: int) -> None:
        barrier.wait()
        try:
            fd = os.open(paths[i], EXCL, 0o644)
        except OSError as e:
            out[i] = e.errno
            return
        try:
            os.write(fd, payloads[i])
        finally:
            os.close(fd)
        out[i] = "won"

    threads = [threading.Thread(target=node, args=(i,)) for i in range(len(paths))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("mode", list(wkit.MODES))
def test_exclusive_create_race_has_one_winner(mounts, s3, bucket, mode):
    a = mounts.start(*wkit.MODES[mode], "--metadata-ttl", "5s", cache="ca", mnt="ma")
    b = mounts.start(*wkit.MODES[mode], "--metadata-ttl", "5s", cache="cb", mnt="mb")
    barrier = threading.Barrier(2)
    both, none, winners = [], [], {}
    for r in range(ROUNDS):
        name = f"lock{r:03}"
        payloads = [f"node a round {r}\n".encode(), f"node b round {r}\n".encode()]
        got = _race([a.path / name, b.path / name], barrier, payloads)
        won = [i for i, g in enumerate(got) if g == "won"]
        lost = [g for g in got if g != "won"]
        if len(won) == 2:
            both.append(r)
        elif not won:
            none.append((r, got))
        else:
            assert lost == [errno.EEXIST], f"round {r}: the loser got {got}"
            winners[name] = payloads[won[0]]
    print(f"{mode}: {ROUNDS} races, both won {len(both)}, none won {len(none)}")
    assert not both, f"both nodes won the exclusive create in rounds {both}"
    assert not none, f"no node won in {none}"
    # most losers' EEXIST came from the daemon's create (both lookups had said "missing",
    # the kernel passed O_EXCL on); a loser whose lookup came after the winner's claim got
    # it from the kernel's lookup
    eexist = sum(m.counter("tierfs_fuse_errors_total", op="create", errno="EEXIST")
                 for m in (a, b))
    print(f"{mode}: {eexist:.0f} of the {ROUNDS} EEXISTs from the daemon's create")
    assert eexist >= 1
    assert "honours conditional writes" in a.log_text()
    wkit.assert_bucket_has(s3, bucket, winners, timeout=wkit.BUCKET_LAG)
    # each node sees the winner's bytes once its entry is past the TTL
    time.sleep(5.5)
    for name, data in list(winners.items())[:5]:
        assert (a.path / name).read_bytes() == data
        assert (b.path / name).read_bytes() == data


def test_a_name_seen_missing_is_not_creatable_once_the_other_node_made_it(mounts, s3, bucket):
    """The negative cache: node B saw the name missing (and keeps that for the TTL); node A
    creates it; B's exclusive create within the TTL must still fail, and B then sees it."""
    a = mounts.start("--metadata-ttl", "60s", cache="ca", mnt="ma")
    b = mounts.start("--metadata-ttl", "60s", cache="cb", mnt="mb")
    for r in range(5):
        name = f"seen{r}"
        assert not (b.path / name).exists()  # B's negative entry, kept 60 s
        wkit.write_file(a.path / name, b"A's\n", flags=EXCL)
        with pytest.raises(FileExistsError):
            os.open(b.path / name, EXCL, 0o644)
        assert wkit.s3_get(s3, bucket, name) == b"A's\n"
        # the loser learnt the name exists: stat shows it at once, not after the TTL
        assert (b.path / name).stat().st_size == 4
    # B's lookups were answered "missing" from its negative cache, so each EEXIST came from
    # its create: the kernel passes O_EXCL in create()'s flags
    assert b.counter("tierfs_fuse_errors_total", op="create", errno="EEXIST") == 5


def test_exclusive_create_then_close_leaves_one_empty_object(mounts, s3, bucket):
    """The lock-file pattern: create exclusively, close; the object is there and empty
    with the file's mode; a second exclusive create on this same node fails at once."""
    m = mounts.start()
    fd = os.open(m.path / "job.lock", EXCL, 0o640)
    # the name is taken in the bucket already at open
    head = s3.head_object(Bucket=bucket, Key="job.lock")
    assert head["ContentLength"] == 0
    assert head["Metadata"].get("tierfs-mode", "").endswith("640")
    os.close(fd)
    with pytest.raises(FileExistsError):
        os.open(m.path / "job.lock", EXCL, 0o640)
    assert wkit.s3_get(s3, bucket, "job.lock") == b""
