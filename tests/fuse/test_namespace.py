"""Directory semantics on a real mount: listing, markers, conflicts, invalid keys."""

from __future__ import annotations

import os
import time

from helpers import put_many


def test_directory_of_5000_entries_lists_completely_in_stable_order(rgw, bucket, mounts):
    names = [f"img-{i:05d}.jpg" for i in range(5000)]
    put_many(rgw.client(), bucket, {f"big/{n}": n.encode() for n in names}, threads=32)
    with mounts.start() as m:
        first = os.listdir(m.path / "big")
        assert sorted(first) == names and len(first) == 5000
        assert os.listdir(m.path / "big") == first  # stable order
        lists = m.counter("tierfs_backend_requests_total", op="list")
        # find + stat of the listed tree: every answer from the index, no request at all
        reqs = m.counter("tierfs_backend_requests_total")
        for n in names[::7]:
            st = os.stat(m.path / "big" / n)
            assert st.st_size == len(n)
        assert m.counter("tierfs_backend_requests_total") == reqs
        assert lists >= 5  # 5,000 keys take five LIST pages of 1,000
        assert (m.path / "big" / names[4321]).read_bytes() == names[4321].encode()


def test_prefixes_markers_and_name_conflicts(rgw, bucket, mounts):
    put_many(rgw.client(), bucket, {
        "a/b/c.txt": b"c",
        "empty/": b"",  # a directory marker object: an empty directory
        "marked/": b"",
        "marked/x": b"x",
        "both": b"i am a file",  # and also a prefix: the directory wins
        "both/inner.txt": b"inner",
    })
    with mounts.start() as m:
        assert sorted(os.listdir(m.path)) == ["a", "both", "empty", "marked"]
        assert os.path.isdir(m.path / "empty") and os.listdir(m.path / "empty") == []
        assert os.listdir(m.path / "marked") == ["x"]
        assert os.path.isdir(m.path / "both")
        assert (m.path / "both/inner.txt").read_bytes() == b"inner"
        assert (m.path / "a/b/c.txt").read_bytes() == b"c"
        assert not os.path.exists(m.path / "nope")
        assert not os.path.exists(m.path / "a/nope")


def test_lookup_in_unlisted_directory_is_targeted_then_listed_once(rgw, bucket, mounts):
    put_many(rgw.client(), bucket, {"deep/er/still/file.bin": b"z" * 100,
                                    **{f"deep/noise{i}": b"n" for i in range(30)}})
    with mounts.start() as m:
        assert (m.path / "deep/er/still/file.bin").read_bytes() == b"z" * 100
        # each path component: two one-key LISTs answer the lookup, and one listing of
        # the directory runs in the background (4 directories on the path)
        deadline = time.monotonic() + 10
        while m.counter("tierfs_backend_requests_total", op="list") < 12:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        assert m.counter("tierfs_backend_requests_total", op="list") == 12
        reqs = m.counter("tierfs_backend_requests_total")
        # now every lookup in those directories is local, found or not
        assert (m.path / "deep/noise7").read_bytes() == b"n"
        assert not os.path.exists(m.path / "deep/missing")
        assert not os.path.exists(m.path / "deep/er/missing")
        assert m.counter("tierfs_backend_requests_total") == reqs + 1  # the GET of noise7


def test_keys_that_cannot_be_paths_are_hidden_counted_and_logged_once(rgw, bucket, mounts):
    bad = ["dir//double", "dir/./dot", "dir/../up", "dir/" + "x" * 300]
    put_many(rgw.client(), bucket, {**{k: b"bad" for k in bad}, "dir/ok.txt": b"ok"})
    listed = [o["Key"] for o in rgw.client().list_objects_v2(Bucket=bucket)["Contents"]]
    stored_bad = [k for k in bad if k in listed]  # RGW may normalise some on upload
    with mounts.start() as m:
        assert os.listdir(m.path / "dir") == ["ok.txt"]
        os.listdir(m.path / "dir")
        hidden = m.counter("tierfs_invalid_keys_total")
        assert hidden == len(stored_bad) >= 3
        assert m.log_text().count("cannot be a path") == len(stored_bad)
