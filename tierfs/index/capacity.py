"""The capacity history table: samples of the cache behind `tierfs usage --forecast`.

Owns the `capacity` database: tier name ("5m", "1h") + "/" + step (u64) -> JSON sample
(tierfs.telemetry.capacity). Bounded by the caller, which drops a tier's steps older than
it keeps at each put.
"""

from __future__ import annotations

import json

from .env import CAPACITY, U64, IndexEnv, u64


class CapacityTable:
    def __init__(self, env: IndexEnv) -> None:
        self.env = env
        self._db = env.db(CAPACITY)

    def put(self, tier: str, step: int, record: dict, *, drop_before: int) -> None:
        """Store one sample at its step of a tier (replacing the step's earlier one) and drop
        the tier's steps before `drop_before`, in one transaction."""
        prefix = tier.encode() + b"/"
        with self.env.begin(write=True, db=self._db) as txn:
            txn.put(prefix + u64(step), json.dumps(record).encode())
            cur = txn.cursor()
            if cur.set_range(prefix):
                while cur.key()[:len(prefix)] == prefix and \
                        U64.unpack(cur.key()[len(prefix):])[0] < drop_before:
                    if not cur.delete():
                        break

    def samples(self, tier: str) -> list[tuple[int, dict]]:
        """A tier's samples, oldest first."""
        prefix = tier.encode() + b"/"
        out = []
        with self.env.begin(db=self._db) as txn:
            cur = txn.cursor()
            if cur.set_range(prefix):
                for k, v in cur:
                    if bytes(k[:len(prefix)]) != prefix:
                        break
                    out.append((U64.unpack(k[len(prefix):])[0], json.loads(v)))
        return out
