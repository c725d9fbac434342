"""A database of JSON records under string keys, the shape of several tables of the index.

Owns nothing itself: usage.py, analytics.py and pins.py each give it their database.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from .env import IndexEnv


class JsonTable:
    def __init__(self, env: IndexEnv, name: bytes) -> None:
        self.env = env
        self._db = env.db(name)

    def put(self, puts: Mapping[str, object], deletes: Iterable[str] = ()) -> None:
        """Store records and delete others, in one transaction."""
        with self.env.begin(write=True, db=self._db) as txn:
            for key in deletes:
                txn.delete(key.encode())
            for key, record in puts.items():
                txn.put(key.encode(), json.dumps(record).encode())

    def records(self, prefix: str = "") -> list[tuple[str, object]]:
        """The records whose keys start with `prefix`, in key order; a record that is not
        JSON comes back as None."""
        out: list[tuple[str, object]] = []
        start = prefix.encode()
        with self.env.begin(db=self._db) as txn:
            cur = txn.cursor()
            if not cur.set_range(start):
                return out
            for k, v in cur:
                if not bytes(k).startswith(start):
                    break
                try:
                    out.append((bytes(k).decode(), json.loads(v)))
                except ValueError:
                    out.append((bytes(k).decode(errors="replace"), None))
        return out
