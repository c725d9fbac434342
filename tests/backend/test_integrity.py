"""tierfs/integrity.py on its own: which checks apply to which body, and that each one
catches a flipped bit. No object store needed."""

import base64
import hashlib
import os
import struct
import zlib

import pytest

from tierfs import integrity
from tierfs.errors import BackendError, IntegrityError
from tierfs.integrity import Received, chunk_crcs_metadata, crc32c, parse_chunk_crcs, verify

CS = 64 << 10


def flipped(data: bytes, at: int) -> bytearray:
    out = bytearray(data)
    out[at] ^= 0x01
    return out


def crcs_of(data: bytes, cs: int = CS) -> list[int]:
    return [crc32c(data[i:i + cs]) for i in range(0, len(data), cs)]


def test_crc32c_is_castagnoli_and_takes_writable_views():
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value
    data = os.urandom(3 * (1 << 20) + 5)  # more than one 1 MiB piece
    assert crc32c(memoryview(bytearray(data))) == crc32c(data)


def test_chunk_crcs_metadata_round_trip():
    crcs = [0, 1, 0xFFFFFFFF, 0x12345678]
    meta = chunk_crcs_metadata(8 << 20, crcs)
    assert list(meta) == [integrity.CRC_META_KEY]
    assert meta[integrity.CRC_META_KEY].startswith("8388608:")
    assert parse_chunk_crcs(meta) == (8 << 20, crcs)


def test_chunk_crcs_metadata_fits_the_budget_or_is_empty():
    # 295 CRCs fit (2.3 GiB of 8 MiB chunks, as the docstring and docs say); 296 do not
    fits = chunk_crcs_metadata(8 << 20, [7] * 295)
    assert fits and len(integrity.CRC_META_KEY) + len(fits[integrity.CRC_META_KEY]) <= 1600
    assert chunk_crcs_metadata(8 << 20, [7] * 296) == {}
    assert chunk_crcs_metadata(8 << 20, []) == {}


@pytest.mark.parametrize("raw", ["", "x", "123", "abc:AAAA", "0:AAAA", "64:!!!!", "64:AAA",
                                 "64:AAAAAAA="])
def test_malformed_crc_metadata_is_ignored(raw):
    assert parse_chunk_crcs({integrity.CRC_META_KEY: raw}) is None


def test_etag_md5_checked_only_for_a_whole_single_part_unencrypted_body():
    data = os.urandom(1000)
    md5 = hashlib.md5(data).hexdigest()
    whole = Received("k", 0, 1000, md5)
    assert verify(whole, memoryview(data)) == [integrity.CHECK_MD5]
    with pytest.raises(IntegrityError) as e:
        verify(whole, memoryview(flipped(data, 999)))
    assert isinstance(e.value, BackendError) and e.value.check == "etag_md5"
    assert "'k'" in str(e.value) and "at 0" in str(e.value)
    # not checkable: a range of the object, a multipart ETag, SSE-KMS / SSE-C, unknown size
    bad = memoryview(flipped(data, 5))
    assert verify(Received("k", 0, 2000, md5), bad) == []
    assert verify(Received("k", 0, 1000, md5[:-2] + "-2"), bad) == []
    assert verify(Received("k", 0, 1000, md5, encrypted=True), bad) == []
    assert verify(Received("k", 0, None, md5), bad) == []


@pytest.mark.parametrize("algorithm,digest", [
    ("crc32", lambda d: struct.pack(">I", zlib.crc32(d))),
    ("crc32c", lambda d: struct.pack(">I", crc32c(d))),
    ("sha1", lambda d: hashlib.sha1(d).digest()),
    ("sha256", lambda d: hashlib.sha256(d).digest()),
])
def test_s3_full_object_checksums(algorithm, digest):
    data = os.urandom(5000)
    value = base64.b64encode(digest(data)).decode()
    # a multipart ETag: only the checksum can check this one
    got = Received("k", 0, 5000, "0" * 32 + "-3", checksums={algorithm: value})
    assert verify(got, memoryview(data)) == [f"checksum_{algorithm}"]
    with pytest.raises(IntegrityError) as e:
        verify(got, memoryview(flipped(data, 1234)))
    assert e.value.check == f"checksum_{algorithm}"
    # a COMPOSITE checksum ("-N") is of the parts, not of these bytes
    composite = Received("k", 0, 5000, "0" * 32 + "-3", checksums={algorithm: value + "-3"})
    assert verify(composite, memoryview(flipped(data, 1))) == []


def test_chunk_crcs_verify_each_chunk_a_ranged_body_covers():
    data = os.urandom(3 * CS + 100)  # chunks 0-2 and a short chunk 3
    meta = chunk_crcs_metadata(CS, crcs_of(data))
    for index in range(4):
        lo, hi = index * CS, min((index + 1) * CS, len(data))
        got = Received("k", lo, len(data), "ab-2", metadata=meta)
        assert verify(got, memoryview(data[lo:hi])) == [integrity.CHECK_CHUNK_CRC]
        with pytest.raises(IntegrityError) as e:
            verify(got, memoryview(flipped(data[lo:hi], hi - lo - 1)))
        assert e.value.check == "chunk_crc32c" and e.value.offset == lo
        assert f"at {lo}" in str(e.value)
    # two chunks in one body: the bad one is named
    got = Received("k", CS, len(data), "ab-2", metadata=meta)
    with pytest.raises(IntegrityError) as e:
        verify(got, memoryview(flipped(data[CS:3 * CS], CS + 7)))
    assert e.value.offset == 2 * CS
    # a body that covers no chunk whole cannot be checked this way
    got = Received("k", 100, len(data), "ab-2", metadata=meta)
    assert verify(got, memoryview(data[100:CS + 50])) == []


def test_a_reader_with_larger_chunks_checks_each_writer_chunk():
    data = os.urandom(4 * CS)
    meta = chunk_crcs_metadata(CS, crcs_of(data))
    got = Received("k", 2 * CS, len(data), "ab-2", metadata=meta)
    assert verify(got, memoryview(data[2 * CS:])) == [integrity.CHECK_CHUNK_CRC]
    with pytest.raises(IntegrityError) as e:
        verify(got, memoryview(flipped(data[2 * CS:], CS + 1)))
    assert e.value.offset == 3 * CS


def test_a_crc_list_for_another_size_is_not_used():
    # metadata copied onto an object of another size (by some other client): the list
    # does not describe these bytes, so it must not refuse them
    data = os.urandom(2 * CS)
    meta = chunk_crcs_metadata(CS, crcs_of(data + b"more"))  # 3 CRCs for a 2-chunk object
    got = Received("k", 0, len(data), "ab-2", metadata=meta)
    assert verify(got, memoryview(flipped(data, 3))) == []


def test_a_body_is_checked_once_by_the_cheapest_check_that_covers_it():
    data = os.urandom(2 * CS)
    md5 = hashlib.md5(data).hexdigest()
    sums = {"sha256": base64.b64encode(hashlib.sha256(data).digest()).decode(),
            "crc32c": base64.b64encode(struct.pack(">I", crc32c(data))).decode()}
    meta = chunk_crcs_metadata(CS, crcs_of(data))
    # tierfs's chunk CRCs cover it whole: neither the checksums nor the MD5 run again
    got = Received("k", 0, len(data), md5, checksums=sums, metadata=meta)
    assert verify(got, memoryview(data)) == [integrity.CHECK_CHUNK_CRC]
    # no CRC list: the CRC32C checksum, not the SHA-256 nor the MD5
    got = Received("k", 0, len(data), md5, checksums=sums)
    assert verify(got, memoryview(data)) == ["checksum_crc32c"]
    # whichever check runs, a flipped bit is caught
    for meta_ in (meta, {}):
        got = Received("k", 0, len(data), md5, checksums=sums, metadata=meta_)
        with pytest.raises(IntegrityError):
            verify(got, memoryview(flipped(data, CS + 3)))
    # a CRC list that is not of this object is not a check: the MD5 runs
    meta = chunk_crcs_metadata(CS, crcs_of(data + b"more"))
    got = Received("k", 0, len(data), md5, metadata=meta)
    assert verify(got, memoryview(data)) == [integrity.CHECK_MD5]
