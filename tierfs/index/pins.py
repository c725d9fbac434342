"""The pins table: what `tierfs warm --pin` keeps from eviction, across restarts.

Owns the `pins` database: owner ("job:42", "manual") -> JSON {expires, objects: {oid hex:
size}, until} (tierfs.cache.pins keeps them in memory and writes each change here).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from .env import PINS, IndexEnv
from .jsontable import JsonTable


class PinTable(JsonTable):
    def __init__(self, env: IndexEnv) -> None:
        super().__init__(env, PINS)

    def set(self, owner: str, record: dict | None) -> None:
        """Store (or with None delete) one owner's pins."""
        self.put({owner: record} if record is not None else {},
                 [owner] if record is None else [])

    def all(self) -> list[tuple[str, dict]]:
        with self.env.begin(db=self._db) as txn:
            return [(bytes(k).decode(), json.loads(v)) for k, v in txn.cursor()]

    def restore(self, records: Iterable[tuple[bytes, bytes]]) -> None:
        """The pins a damaged index still yields (tierfs.index.probe): those that are a
        JSON object."""
        with self.env.begin(write=True, db=self._db) as txn:
            for k, v in records:
                try:
                    if isinstance(json.loads(v), dict):
                        txn.put(k, v)
                except ValueError:
                    continue
