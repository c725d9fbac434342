"""The backend contract: one set of tests, run against every backend.

What the core relies on: ranged GETs (a range past the end gives the tail), If-Match on the
ETag (a stale one is PreconditionFailed), NotFound / NoSuchBucket, ListObjectsV2 listing
semantics (byte order, delimiter, common prefixes, complete paging, "dir/" markers).
"""

import os

import pytest

from tierfs.errors import NoSuchBucket, NotFound, PreconditionFailed

from backends import make_store


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path, monkeypatch):
    return make_store(request.param, request, tmp_path, monkeypatch)


def put_all(backend, keys, data=b"x"):
    for k in keys:
        backend.put(k, b"" if k.endswith("/") else data)


def list_all(backend, prefix, delimiter, max_keys):
    """Every page until the end: ([object keys], [prefixes], [entries per page])."""
    objects, prefixes, pages = [], [], []
    token = None
    while True:
        page = backend.list(prefix, delimiter, token, max_keys)
        assert len(page.objects) + len(page.prefixes) <= max_keys
        objects += [o.key for o in page.objects]
        prefixes += page.prefixes
        pages.append(sorted([o.key for o in page.objects] + page.prefixes))
        token = page.next_token
        if token is None:
            return objects, prefixes, pages
        assert len(pages) < 1000, "paging never ends"


def test_put_head_round_trip(store):
    data = os.urandom(1000)
    put = store.backend.put("dir/obj.bin", data)
    head = store.backend.head("dir/obj.bin")
    assert (head.key, head.size) == ("dir/obj.bin", 1000)
    assert head.etag == put.etag and head.etag and '"' not in head.etag
    assert head.mtime > 0


def test_ranged_gets(store):
    data = os.urandom(1000)
    store.backend.put("obj", data)
    assert store.backend.get("obj", 0, 10, None) == data[:10]
    assert store.backend.get("obj", 500, 500, None) == data[500:]
    assert store.backend.get("obj", 123, 1, None) == data[123:124]
    assert store.backend.get("obj", 0, 1000, None) == data


def test_range_past_the_end_returns_the_tail(store):
    data = os.urandom(1000)
    store.backend.put("obj", data)
    assert store.backend.get("obj", 990, 100, None) == data[990:]
    assert store.backend.get("obj", 0, 1 << 20, None) == data


def test_get_with_the_current_etag(store):
    data = os.urandom(5000)
    store.backend.put("obj", data)
    etag = store.backend.head("obj").etag
    assert store.backend.get("obj", 4000, 2000, etag) == data[4000:]


def test_get_with_a_stale_etag_is_precondition_failed(store):
    old = store.backend.put("obj", b"version one").etag
    new = store.backend.put("obj", b"version two").etag
    assert old != new
    with pytest.raises(PreconditionFailed):
        store.backend.get("obj", 0, 7, old)
    assert store.backend.get("obj", 0, 7, new) == b"version"


def test_get_into_a_buffer(store):
    data = os.urandom(5000)
    etag = store.backend.put("obj", data).etag
    buf = bytearray(b"\xff" * 3000)
    assert store.backend.get_into("obj", 1000, memoryview(buf)[:2000], etag) == 2000
    assert buf[:2000] == data[1000:3000] and buf[2000:] == b"\xff" * 1000
    assert store.backend.get_into("obj", 4500, memoryview(buf), None) == 500  # the tail
    assert buf[:500] == data[4500:]
    with pytest.raises(PreconditionFailed):
        store.backend.get_into("obj", 0, memoryview(buf), store.backend.put("obj", b"x").etag + "0")


def test_same_bytes_rewritten_still_reads_under_its_etag(store):
    store.backend.put("obj", b"same")
    etag = store.backend.put("obj", b"same").etag
    assert store.backend.get("obj", 0, 4, etag) == b"same"


def test_missing_key(store):
    with pytest.raises(NotFound):
        store.backend.head("no/such/key")
    with pytest.raises(NotFound):
        store.backend.get("no/such/key", 0, 10, None)
    with pytest.raises(NotFound):
        store.backend.head("nokey")


def test_delete(store):
    store.backend.put("gone", b"x")
    store.backend.delete("gone")
    with pytest.raises(NotFound):
        store.backend.head("gone")
    store.backend.delete("gone")  # deleting a missing key is not an error


def test_odd_key_names_round_trip(store):
    keys = ["with space.txt", "plus+sign", "percent%20.txt", "\u00e9t\u00e9/\u65e5\u672c.bin",
            "quote'and\"double", "semi;colon&amp=eq", "tilde~", "UPPER/lower"]
    for i, k in enumerate(keys):
        store.backend.put(k, f"value {i}".encode())
    for i, k in enumerate(keys):
        assert store.backend.get(k, 0, 100, store.backend.head(k).etag) == f"value {i}".encode()
    objects, _, _ = list_all(store.backend, "", None, 1000)
    assert objects == sorted(keys, key=lambda k: k.encode())


TREE = ["Zeta", "a b", "a-b", "a.b", "a/x", "a/y/z", "a0", "b/", "c", "\u00e9", "\u65e5\u672c/x"]


def test_list_with_delimiter_gives_objects_and_prefixes_in_byte_order(store):
    put_all(store.backend, TREE)
    page = store.backend.list("", "/")
    assert [o.key for o in page.objects] == ["Zeta", "a b", "a-b", "a.b", "a0", "c", "\u00e9"]
    assert page.prefixes == ["a/", "b/", "\u65e5\u672c/"]
    assert page.next_token is None
    assert all(o.size == 1 and o.etag for o in page.objects)


def test_list_inside_a_prefix(store):
    put_all(store.backend, TREE)
    page = store.backend.list("a/", "/")
    assert ([o.key for o in page.objects], page.prefixes) == (["a/x"], ["a/y/"])
    page = store.backend.list("a/y/", "/")
    assert ([o.key for o in page.objects], page.prefixes) == (["a/y/z"], [])


def test_list_with_a_partial_name_prefix(store):
    put_all(store.backend, TREE)
    page = store.backend.list("a", "/")
    assert [o.key for o in page.objects] == ["a b", "a-b", "a.b", "a0"]
    assert page.prefixes == ["a/"]


def test_list_without_delimiter_gives_every_key(store):
    put_all(store.backend, TREE)
    page = store.backend.list("", None)
    assert [o.key for o in page.objects] == sorted(TREE, key=lambda k: k.encode())
    assert page.prefixes == []


def test_list_of_an_empty_prefix(store):
    put_all(store.backend, TREE)
    page = store.backend.list("nothing/", "/")
    assert (page.objects, page.prefixes, page.next_token) == ([], [], None)


def test_dir_marker_is_listed(store):
    store.backend.put("empty/", b"")
    root = store.backend.list("", "/")
    assert root.prefixes == ["empty/"] and root.objects == []
    inside = store.backend.list("empty/", "/")
    assert [o.key for o in inside.objects] == ["empty/"] and inside.prefixes == []
    assert store.backend.head("empty/").key == "empty/"


def test_dir_marker_is_an_empty_object(store):
    store.backend.put("empty/", b"")
    assert store.backend.head("empty/").size == 0
    assert [o.size for o in store.backend.list("empty/", "/").objects] == [0]


def test_implicit_directory_is_not_an_object(store):
    # "d/" exists only as the prefix of "d/f": HEAD d/ must not find an object
    store.backend.put("d/f", b"x")
    with pytest.raises(NotFound):
        store.backend.head("d/")
    assert [o.key for o in store.backend.list("d/", "/").objects] == ["d/f"]


def test_paging_returns_every_key_once_in_order(store):
    keys = [f"k{i:02d}" for i in range(25)]
    put_all(store.backend, reversed(keys))
    objects, prefixes, pages = list_all(store.backend, "", None, 4)
    assert objects == keys
    assert prefixes == []
    assert len(pages) >= 7


def test_paging_with_delimiter_counts_prefixes_once(store):
    keys = []
    for i in range(25):
        if i % 3 == 0:
            keys += [f"e{i:02d}/a", f"e{i:02d}/b", f"e{i:02d}/sub/c"]  # one prefix, 3 keys
        else:
            keys.append(f"e{i:02d}")
    put_all(store.backend, keys)
    for max_keys in (1, 3, 7):
        objects, prefixes, pages = list_all(store.backend, "", "/", max_keys)
        assert prefixes == [f"e{i:02d}/" for i in range(25) if i % 3 == 0]
        assert objects == [f"e{i:02d}" for i in range(25) if i % 3]
        entries = [e for page in pages for e in page]
        assert entries == sorted(entries) and len(entries) == 25
        assert len(pages) >= 25 // max_keys


def test_paging_inside_a_prefix(store):
    keys = [f"p/{i:02d}" for i in range(25)] + ["p0", "o"]
    put_all(store.backend, keys)
    objects, _, _ = list_all(store.backend, "p/", "/", 6)
    assert objects == [f"p/{i:02d}" for i in range(25)]


def test_check_accepts_an_existing_bucket(store):
    store.backend.check()


def test_check_of_a_missing_bucket_is_no_such_bucket(store):
    missing = store.missing()
    with pytest.raises(NoSuchBucket):
        missing.check()
    with pytest.raises(NoSuchBucket):
        missing.list("", "/")
