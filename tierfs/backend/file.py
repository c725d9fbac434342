"""A local directory served as an object store, for unit tests and demos.

Keys map to paths under the root; an empty directory stands for a "dir/" marker object.
ETags derive from (mtime_ns, size, inode), so a rewritten file gets a new ETag as an S3
overwrite would. Listing semantics (ordering, delimiter, paging) follow ListObjectsV2.
"""

from __future__ import annotations

import os
import tempfile
import time

from ..errors import BackendError, NoSuchBucket, NotFound, PreconditionFailed
from .base import ListPage, ObjectMeta


class FileBackend:
    name = "file"

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def _path(self, key: str) -> str:
        parts = key.split("/")
        if any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in (".", ".."):
            raise NotFound(f"{key!r}: not representable in a directory backend")
        return os.path.join(self.root, *parts)

    def _meta(self, key: str, st: os.stat_result) -> ObjectMeta:
        size = 0 if key.endswith("/") else st.st_size  # a marker is a zero-byte object
        etag = f"{st.st_mtime_ns:x}-{size:x}-{st.st_ino:x}"
        return ObjectMeta(key, size, etag, st.st_mtime)

    def check(self) -> None:
        if not os.path.isdir(self.root):
            raise NoSuchBucket(f"directory {self.root!r} does not exist")

    def _all_keys(self, prefix: str) -> list[tuple[str, os.stat_result]]:
        # walk only the deepest directory the prefix names
        base = prefix.rpartition("/")[0]
        top = os.path.join(self.root, base) if base else self.root
        out = []
        for dirpath, dirnames, filenames in os.walk(top):
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            if rel and not dirnames and not filenames:
                out.append((rel, os.stat(dirpath)))  # empty dir == marker object
            for name in filenames:
                try:
                    out.append((rel + name, os.stat(os.path.join(dirpath, name))))
                except FileNotFoundError:
                    continue
        return sorted((kv for kv in out if kv[0].startswith(prefix)), key=lambda kv: kv[0])

    def list(self, prefix: str, delimiter: str | None = "/", token: str | None = None,
             max_keys: int = 1000) -> ListPage:
        self.check()
        objects: list[ObjectMeta] = []
        prefixes: list[str] = []
        last = ""
        for key, st in self._all_keys(prefix):
            if token is not None and key <= token:
                continue
            if delimiter:
                cut = key.find(delimiter, len(prefix))
                if cut >= 0:
                    common = key[: cut + len(delimiter)]
                    if prefixes and prefixes[-1] == common:
                        continue
                    if token is not None and common <= token:
                        continue
                    if len(objects) + len(prefixes) == max_keys:
                        return ListPage(objects, prefixes, last)
                    prefixes.append(common)
                    # S3 resumes after the whole common prefix
                    last = common + "\U0010ffff"
                    continue
            if len(objects) + len(prefixes) == max_keys:
                return ListPage(objects, prefixes, last)
            objects.append(self._meta(key, st))
            last = key
        return ListPage(objects, prefixes, None)

    def head(self, key: str) -> ObjectMeta:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"head {key!r}: not found") from None
        path = self._path(key)
        if key.endswith("/") != os.path.isdir(path) or (key.endswith("/") and os.listdir(path)):
            raise NotFound(f"head {key!r}: not found")  # only an empty dir stands for a marker
        return self._meta(key, st)

    def get(self, key: str, start: int, length: int, etag: str | None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                meta = self._meta(key, os.fstat(f.fileno()))
                if etag and meta.etag != etag:
                    raise PreconditionFailed(f"get {key!r}: object changed (ETag mismatch)")
                return os.pread(f.fileno(), length, start)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(f"get {key!r}: not found") from None
        except OSError as exc:
            raise BackendError(f"get {key!r} at {start}: {exc}") from None

    def put(self, key: str, data: bytes) -> ObjectMeta:
        path = self._path(key)
        if key.endswith("/"):
            os.makedirs(path, exist_ok=True)
            return self._meta(key, os.stat(path))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tierfs-put-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        # distinct mtimes give distinct ETags even for two writes in one clock tick
        now = time.time_ns()
        os.utime(path, ns=(now, now))
        return self._meta(key, os.stat(path))

    def delete(self, key: str) -> None:
        try:
            path = self._path(key)
            os.rmdir(path) if key.endswith("/") else os.unlink(path)
        except (FileNotFoundError, NotFound):
            pass
