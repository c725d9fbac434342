"""PageCache: which object version the kernel's page cache of each file holds.

The kernel keeps one page cache per inode, shared by every handle open on it. tierfs
binds each handle to one object version (fileio.py), so two handles of one file may read
two versions: an old handle opened before another client replaced the object, and a new
one opened after the metadata TTL. Their pages must never meet, or one read() returns
bytes of both versions (issue 31, H1 and H2). The rules this module keeps:

- An open with keep_cache=False empties the inode's pages (the kernel does that at open);
  a read served to a handle that goes through the page cache fills them with its version,
  and a write or truncate through the kernel fills them with unsaved data.
- A handle of another version than the pages' while a handle of the pages' version is
  open goes around the page cache (direct_io): neither version's pages reach the other.
  The older handles keep theirs; once they are closed, the next open empties the pages.
- A handle may move to another version (its version vanished before it served a byte)
  only if its reads cannot meet pages of the old version: it is direct, or the pages
  hold nothing of another version and no other handle through the page cache reads one.

Pure bookkeeping (no I/O, no kernel calls): FileIO asks it at open, read and close and
answers the kernel with what it decides. Versions are ETags; UNSAVED stands for the
unsaved data of a file written on this node, which every local handle reads (as POSIX
wants on one node).
"""

from __future__ import annotations

UNSAVED = "<unsaved>"
_UNKNOWN = "<unknown>"  # pages may hold anything (never opened here, or a short read)


class PageCache:
    def __init__(self) -> None:
        self._pages: dict[int, str | None] = {}  # ino -> version held (None: empty)
        self._cached: dict[int, dict[int, str]] = {}  # ino -> fh -> version, cached handles
        self._direct: dict[int, int] = {}  # fh -> ino of handles that go around the cache
        self._newest: dict[int, str] = {}  # ino -> version of the newest open

    def open(self, ino: int, fh: int, version: str) -> tuple[bool, bool]:
        """A handle of `version` opens: (keep_cache, direct_io) to answer the kernel."""
        self._newest[ino] = version
        cached = self._cached.setdefault(ino, {})
        if version != UNSAVED and any(v not in (version, UNSAVED) for v in cached.values()):
            # a handle of another version reads through the pages: stay out of them
            self._direct[fh] = ino
            return True, True
        keep = self._pages.get(ino, _UNKNOWN) in (None, version) and version != UNSAVED
        if not keep:
            self._pages[ino] = None  # the kernel drops the pages at this open
        cached[fh] = version
        return keep, False

    def paged_version(self, ino: int) -> str | None:
        """The version the handles reading through the pages read, if any is open (they
        all read one: a handle of another opens direct)."""
        cached = self._cached.get(ino)
        if not cached:
            return None
        return next((v for v in cached.values() if v != UNSAVED), None)

    def holds(self, ino: int, version: str) -> bool:
        """Whether the pages hold bytes of `version`: the kernel may answer a handle of it
        from them without asking us."""
        return self._pages.get(ino) == version

    def newest(self, ino: int) -> str | None:
        return self._newest.get(ino)

    def is_direct(self, fh: int) -> bool:
        return fh in self._direct

    def served(self, ino: int, fh: int, version: str) -> None:
        """A read of `version` was answered to handle fh: through the page cache unless the
        handle is direct, so the pages now hold that version."""
        if fh in self._cached.get(ino, {}):
            self._pages[ino] = version

    def written(self, ino: int) -> None:
        """A write or truncate went through the kernel, which keeps the written pages: they
        hold unsaved data now. A handle opened on them later without asking us for a byte
        has read them, so it must count as served (the model test found one moved to a
        newer version under pages it had been served from)."""
        self._pages[ino] = UNSAVED

    def may_move(self, ino: int, fh: int, version: str) -> bool:
        """Whether handle fh may switch to `version` without its reads meeting pages of
        another one; if so it is recorded as reading `version` from now on."""
        if fh in self._direct:
            return True
        cached = self._cached.get(ino, {})
        others = [v for f, v in cached.items() if f != fh]
        if self._pages.get(ino, _UNKNOWN) not in (None, version) or any(
                v != version for v in others):
            return False
        cached[fh] = version
        return True

    def relabel(self, ino: int, new: str, old: str | None = None) -> None:
        """The handles of the inode reading `old` (None: all of them) and pages holding it
        now read `new`, the same bytes: the unsaved data every local handle read was
        uploaded as `new`, or a rename copied `old` to `new`."""
        cached = self._cached.get(ino, {})
        for fh, version in cached.items():
            if old is None or version == old:
                cached[fh] = new
        if self._pages.get(ino) not in (None, _UNKNOWN) and (
                old is None or self._pages.get(ino) == old):
            self._pages[ino] = new
        if old is None or self._newest.get(ino) == old:
            self._newest[ino] = new

    def forget(self, ino: int) -> None:
        """The kernel's pages or size of the inode may be wrong (a short read at an old
        EOF, dropped writes): the next open empties them."""
        self._pages[ino] = _UNKNOWN

    def close(self, ino: int, fh: int) -> None:
        self._direct.pop(fh, None)
        cached = self._cached.get(ino)
        if cached is not None:
            cached.pop(fh, None)
            if not cached:
                del self._cached[ino]
                if ino not in self._direct.values():
                    self._newest.pop(ino, None)
