"""The access analytics table: what tierfs.telemetry.analytics keeps across restarts.

Owns the `analytics` database: "prefix/<prefix>", "job/<id>", "series/<tier>/<step>",
"totals" -> JSON: per-prefix reads and metadata requests, the files each Slurm job read, the
downsampled totals behind `tierfs report`. Bounded by the caller, which deletes what it no
longer keeps at each put. put(puts, deletes) and records(prefix) are JsonTable's.
"""

from __future__ import annotations

from .env import ANALYTICS, IndexEnv
from .jsontable import JsonTable


class AnalyticsTable(JsonTable):
    def __init__(self, env: IndexEnv) -> None:
        super().__init__(env, ANALYTICS)
