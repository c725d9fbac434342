"""PageCache (tierfs/files/pagecache.py): the rules that keep two versions' bytes apart in the
kernel's page cache of one inode. The real-mount cases are in
tests/faults/test_lost_checkpoints.py (H1, H2, V1); here each rule alone."""

from tierfs.files.pagecache import UNSAVED, PageCache

INO = 7


def test_first_open_empties_the_pages_and_a_reopen_of_the_same_version_keeps_them():
    pc = PageCache()
    assert pc.open(INO, 1, "v0") == (False, False)  # unknown pages: dropped
    assert not pc.holds(INO, "v0")
    pc.served(INO, 1, "v0")
    assert pc.holds(INO, "v0")
    pc.close(INO, 1)
    assert pc.open(INO, 2, "v0") == (True, False)  # the pages hold v0: kept


def test_a_new_version_while_an_old_handle_reads_through_the_pages_is_direct():
    pc = PageCache()
    pc.open(INO, 1, "v0")
    pc.served(INO, 1, "v0")
    keep, direct = pc.open(INO, 2, "v1")
    assert direct and keep  # the old handle's pages are left alone
    pc.served(INO, 2, "v1")  # a direct read fills nothing
    assert pc.open(INO, 3, "v0") == (True, False)  # pages still hold only v0


def test_once_the_old_handles_close_the_next_open_drops_the_old_pages():
    pc = PageCache()
    pc.open(INO, 1, "v0")
    pc.served(INO, 1, "v0")
    pc.open(INO, 2, "v1")  # direct
    pc.close(INO, 1)
    assert pc.open(INO, 3, "v1") == (False, False)
    assert pc.open(INO, 4, "v1") == (True, False)  # emptied at 3's open: nothing to drop


def test_a_handle_moves_only_where_its_reads_cannot_meet_another_version():
    pc = PageCache()
    pc.open(INO, 1, "v0")
    assert pc.may_move(INO, 1, "v1")  # pages empty, no one else: fine
    pc.served(INO, 1, "v1")
    pc.open(INO, 2, "v1")
    assert not pc.may_move(INO, 2, "v2")  # pages hold v1, handle 1 reads v1
    pc.open(INO, 3, "v2")  # direct (handles of v1 read through the pages)
    assert pc.may_move(INO, 3, "v3")  # a direct handle meets no pages


def test_unsaved_data_is_shared_by_every_local_handle_and_relabelled_when_uploaded():
    pc = PageCache()
    pc.open(INO, 1, "v0")
    pc.served(INO, 1, "v0")
    assert pc.open(INO, 2, UNSAVED) == (False, False)  # a writer: never direct
    pc.served(INO, 2, UNSAVED)
    assert pc.newest(INO) == UNSAVED
    pc.relabel(INO, "v1")  # uploaded: every handle and the pages now read v1
    assert pc.newest(INO) == "v1"
    pc.close(INO, 1)
    pc.close(INO, 2)
    assert pc.open(INO, 3, "v1") == (True, False)


def test_a_rename_relabels_only_the_version_it_copied():
    pc = PageCache()
    pc.open(INO, 1, "v0")
    pc.served(INO, 1, "v0")
    pc.relabel(INO, "v0-copy", old="v0")
    assert pc.open(INO, 2, "v0-copy") == (True, False)
    pc.forget(INO)  # e.g. a short read at an old EOF: the next open drops the pages
    pc.close(INO, 1)
    pc.close(INO, 2)
    assert pc.open(INO, 3, "v0-copy") == (False, False)


def test_the_paged_version_is_the_one_the_cached_handles_read():
    pc = PageCache()
    assert pc.paged_version(INO) is None
    pc.open(INO, 1, "v0")
    pc.open(INO, 2, "v1")  # direct: it does not read through the pages
    assert pc.paged_version(INO) == "v0"  # the kernel's size must stay v0's (FileIO.size_of)
    pc.close(INO, 1)
    assert pc.paged_version(INO) is None
