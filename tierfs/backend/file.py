"""A local directory served as an object store, for unit tests and demos.

Keys map to paths under the root; an empty directory stands for a "dir/" marker object.
ETags derive from (mtime_ns, size, inode), so a rewritten file gets a new ETag as an S3
overwrite would. Listing semantics (ordering, delimiter, paging) follow ListObjectsV2.
An OSError of the directory (permissions, a full disk) is a BackendError, as the backend
boundary promises.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from ..errors import BackendError, Exists, NoSuchBucket, NotFound, PreconditionFailed, TierfsError
from .base import BackendEvents, ListPage, MultipartUpload, ObjectMeta

_PRIVATE = ".tierfs-"  # names the backend keeps for itself; never listed
_META_XATTR = "user.tierfs.metadata"


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _mapped(fn: Callable[Concatenate[FileBackend, _P], _R]
            ) -> Callable[Concatenate[FileBackend, _P], _R]:
    """An OSError the method did not map itself becomes BackendError naming the call."""
    @functools.wraps(fn)
    def call(self: FileBackend, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(self, *args, **kwargs)
        except TierfsError:
            raise
        except OSError as exc:
            what = f"{fn.__name__} {args[0]!r}" if args else fn.__name__
            raise BackendError(f"{what}: {exc.strerror or exc}") from None

    return call


class FileBackend:
    name = "file"
    exclusive_by_design = True  # put_new is link(2): tierfs/files/exclusive.py need not probe it

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.events = BackendEvents()  # nothing to resume or verify in a local directory

    def _path(self, key: str) -> str:
        parts = key.split("/")
        if any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in (".", ".."):
            raise NotFound(f"{key!r}: not representable in a directory backend")
        return os.path.join(self.root, *parts)

    def _meta(self, key: str, st: os.stat_result) -> ObjectMeta:
        size = 0 if key.endswith("/") else st.st_size  # a marker is a zero-byte object
        etag = f"{st.st_mtime_ns:x}-{size:x}-{st.st_ino:x}"
        return ObjectMeta(key, size, etag, st.st_mtime)

    @_mapped
    def check(self) -> None:
        if not os.path.isdir(self.root):
            raise NoSuchBucket(f"directory {self.root!r} does not exist")

    def _all_keys(self, prefix: str) -> list[tuple[str, os.stat_result]]:
        # walk only the deepest directory the prefix names
        base = prefix.rpartition("/")[0]
        top = os.path.join(self.root, base) if base else self.root
        out = []
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if not d.startswith(_PRIVATE)]
            filenames = [n for n in filenames if not n.startswith(_PRIVATE)]
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

    @_mapped
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

    @_mapped
    def head(self, key: str) -> ObjectMeta:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"head {key!r}: not found") from None
        path = self._path(key)
        if key.endswith("/") != os.path.isdir(path) or (key.endswith("/") and os.listdir(path)):
            raise NotFound(f"head {key!r}: not found")  # only an empty dir stands for a marker
        meta = self._meta(key, st)
        return ObjectMeta(meta.key, meta.size, meta.etag, meta.mtime, self._metadata(path))

    @_mapped
    def get(self, key: str, start: int, length: int, etag: str | None, *,
            size: int | None = None) -> bytes:
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

    @_mapped
    def get_into(self, key: str, start: int, buf: memoryview, etag: str | None, *,
                 size: int | None = None, metadata: dict[str, str] | None = None) -> int:
        data = self.get(key, start, len(buf), etag)  # a local file: one copy is nothing
        if metadata:
            have = self._metadata(self._path(key))
            if any(have.get(k) != v for k, v in metadata.items()):
                raise PreconditionFailed(f"get {key!r}: not the wanted copy (metadata differs)")
        buf[:len(data)] = data
        return len(data)

    @_mapped
    def put(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> ObjectMeta:
        path = self._path(key)
        if key.endswith("/"):  # a marker: the directory, its metadata in an xattr
            os.makedirs(path, exist_ok=True)
            os.setxattr(path, _META_XATTR, json.dumps(metadata or {}).encode())
            now = time.time_ns()
            os.utime(path, ns=(now, now))  # a new ETag, as a PUT over a marker gives
            return self._meta(key, os.stat(path))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self._staging(), prefix="put-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return self._publish(tmp, path, key, metadata)

    @_mapped
    def put_new(self, key: str, data: bytes,
                metadata: dict[str, str] | None = None) -> ObjectMeta:
        if key.endswith("/"):  # tierfs creates files exclusively, never markers
            raise BackendError(f"create {key!r}: no exclusive create of a directory marker")
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self._staging(), prefix="put-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.setxattr(tmp, _META_XATTR, json.dumps(metadata or {}).encode())
            # link(2), unlike rename, fails when the name exists: the exclusive create,
            # and the complete file appears at once, as put's rename makes it
            os.link(tmp, path)
        except FileExistsError:
            raise Exists(f"create {key!r}: an object has that key already") from None
        finally:
            os.unlink(tmp)
        now = time.time_ns()
        os.utime(path, ns=(now, now))
        meta = self._meta(key, os.stat(path))
        return ObjectMeta(meta.key, meta.size, meta.etag, meta.mtime, metadata or {})

    def _staging(self) -> str:
        d = os.path.join(self.root, _PRIVATE + "staging")
        os.makedirs(d, exist_ok=True)
        return d

    def _publish(self, tmp: str, path: str, key: str,
                 metadata: dict[str, str] | None) -> ObjectMeta:
        os.setxattr(tmp, _META_XATTR, json.dumps(metadata or {}).encode())
        os.replace(tmp, path)
        # distinct mtimes give distinct ETags even for two writes in one clock tick
        now = time.time_ns()
        os.utime(path, ns=(now, now))
        meta = self._meta(key, os.stat(path))
        return ObjectMeta(meta.key, meta.size, meta.etag, meta.mtime, metadata or {})

    @_mapped
    def copy(self, src: str, dst: str, src_etag: str | None,
             metadata: dict[str, str] | None = None) -> str:
        spath = self._path(src)
        if src.endswith("/"):  # a directory marker
            self.head(src)
            keep = self._metadata(spath) if metadata is None else metadata
            return self.put(dst, b"", keep).etag
        try:
            with open(spath, "rb") as f:
                if src_etag and self._meta(src, os.fstat(f.fileno())).etag != src_etag:
                    raise PreconditionFailed(f"copy {src!r}: object changed (ETag mismatch)")
                data = f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(f"copy {src!r}: not found") from None
        keep = self._metadata(spath) if metadata is None else metadata
        return self.put(dst, data, keep).etag

    def _metadata(self, path: str) -> dict[str, str]:
        try:
            return json.loads(os.getxattr(path, _META_XATTR))
        except OSError:
            return {}

    # multipart: parts are files in a private staging folder, joined on completion
    @_mapped
    def mpu_create(self, key: str, metadata: dict[str, str] | None = None) -> str:
        upload_id = uuid.uuid4().hex
        d = os.path.join(self._staging(), "mpu-" + upload_id)
        os.makedirs(d)
        with open(os.path.join(d, "meta"), "w") as f:
            json.dump({"key": key, "metadata": metadata or {}}, f)
        return upload_id

    def _part_path(self, upload_id: str, part: int) -> str:
        d = os.path.join(self._staging(), "mpu-" + upload_id)
        if not os.path.isdir(d):
            raise NotFound(f"upload {upload_id} does not exist")
        return os.path.join(d, f"part-{part:05d}")

    @_mapped
    def upload_part(self, key: str, upload_id: str, part: int, data: bytes) -> str:
        with open(self._part_path(upload_id, part), "wb") as f:
            f.write(data)
        return hashlib.md5(data).hexdigest()

    @_mapped
    def upload_part_copy(self, key: str, upload_id: str, part: int, src: str, src_etag: str,
                         start: int, length: int) -> str:
        return self.upload_part(key, upload_id, part, self.get(src, start, length, src_etag))

    @_mapped
    def mpu_complete(self, key: str, upload_id: str,
                     parts: builtins.list[tuple[int, str]]) -> str:
        d = os.path.join(self._staging(), "mpu-" + upload_id)
        try:
            with open(os.path.join(d, "meta")) as f:
                metadata = json.load(f)["metadata"]
        except FileNotFoundError:
            raise NotFound(f"upload {upload_id} does not exist") from None
        fd, tmp = tempfile.mkstemp(dir=self._staging(), prefix="put-")
        with os.fdopen(fd, "wb") as out:
            for n, _ in parts:
                with open(self._part_path(upload_id, n), "rb") as part:
                    shutil.copyfileobj(part, out)
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        etag = self._publish(tmp, path, key, metadata).etag
        shutil.rmtree(d, ignore_errors=True)
        return etag

    @_mapped
    def mpu_list(self, key: str) -> builtins.list[MultipartUpload]:
        out = []
        for name in os.listdir(self._staging()):
            if name.startswith("mpu-"):
                try:
                    meta = os.path.join(self._staging(), name, "meta")
                    with open(meta) as f:
                        if json.load(f)["key"] == key:
                            out.append(MultipartUpload(name[len("mpu-"):],
                                                       os.stat(meta).st_mtime))
                except (OSError, ValueError):
                    continue
        return out

    @_mapped
    def mpu_abort(self, key: str, upload_id: str) -> None:
        shutil.rmtree(os.path.join(self._staging(), "mpu-" + upload_id), ignore_errors=True)

    @_mapped
    def delete(self, key: str) -> None:
        try:
            path = self._path(key)
            os.rmdir(path) if key.endswith("/") else os.unlink(path)
        except (FileNotFoundError, NotFound):
            return
        # an emptied directory would read as a "dir/" marker: S3 has no such leftover
        parent = os.path.dirname(path.rstrip("/"))
        while parent != self.root and parent.startswith(self.root):
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)
