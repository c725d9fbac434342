"""The usage table: what tierfs.telemetry.usage keeps across restarts.

Owns the `usage` database: "tenant/<name>" or "reader/<job:N|pod:UID|uid:N>" -> JSON Tally
(bytes read by source, stall seconds). put(puts, deletes) and records() are JsonTable's.
"""

from __future__ import annotations

from .env import USAGE, IndexEnv
from .jsontable import JsonTable


class UsageTable(JsonTable):
    def __init__(self, env: IndexEnv) -> None:
        super().__init__(env, USAGE)
