"""Admission: whether a full disk tier takes in a chunk fetched for a reader.

A reader's chunk that would push a cached chunk out gets in only if it has clearly more
reads than the chunk it would push out (TinyLFU's idea): its heat, remembered from its
reads while it was out of the cache (`History`), must be above MARGIN times the victim's,
both weighed by what a miss costs per byte (heat.value) and compared as of their own last
reads. Otherwise it is served from memory only and its read remembered. So a loop over more
data than the cache keeps what it cached, and a one-shot scan does not push out data read
again. Free room is never refused, nor explicit fills (`tierfs warm`, written data).

So that the cache still follows a workload that moves on, a refused chunk may take the
room of one chunk (`replaceable`) that gives way:
- a chunk not read for ABANDONED times the longest gap between its reads (counted in chunk
  accesses, not seconds: an idle night changes nothing) has stopped being read;
- while plain LRU would lately have hit clearly more than the cache (`LruShadow`, a shadow
  LRU of keys, and `trail`, its lead: "behind LRU"), a chunk LRU let go gives way to one
  LRU would hit or to new data;
- for a cache-full of accesses after a new Slurm job or pod opens its first file
  (`job_opened`), a chunk LRU let go and nobody read since gives way to new data.
A victim whose heat decayed below STALE gives way to anything, and a restored checkpoint's
room is kept from readers for a cache-full of accesses (the job's next save takes it).

A chunk's heat when stored (`entry_heat`): a reader's chunk its remembered heat plus this
read, a warmed one 1, a written one 0 (heat counts reads; heat.py ranks it). Everything
here is bounded and in memory: after a restart every chunk is new again. Why each rule,
with figures: docs/architecture.md decision 3a and bench/README.md "Eviction quality".
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Callable

from ..index.chunks import ChunkRecord
from .heat import RESTORED, decayed, ranked, value

# Each constant: what it trades (figures for other values: bench/README.md "Eviction quality")
STALE = 1 / 1024  # decayed heat at which a victim gives way to anything: old data vs slow loops
MARGIN = 2.0  # reads a newcomer needs over its victim, as a factor: churn vs slow take-over
LAG_IGNORED = 2.0  # half-lives between two last reads not counted: loop churn vs new data
HISTORY_FACTOR = 4  # cache-fulls of keys remembered while out: rarer re-reads seen vs memory
HISTORY_MAX = 1 << 20  # remembered keys at most (~100 MB of dict): memory vs history
ABANDONED = 3.0  # x its longest read gap unread, a chunk stopped being read: move on vs loops
MIN_GAP = 1.5  # cache-fulls of accesses a read gap counts at least: restores vs finished jobs
TRAILING = 0.02  # LRU's lead, share of the chunks, before its order is followed: noise vs jobs
TRAILING_MIN = 16.0  # and in hits at least: small caches following LRU on single misses
JOBS_KEPT = 1024  # jobs remembered as seen: memory vs an old job taken for a new one
SKIPPED_MAX = 64  # chunks a refused read passes over for room: CPU per refusal vs room found


class Fill(enum.Enum):
    """Why a chunk is stored: what admission and its starting heat depend on."""

    READ = "read"  # fetched for a reader (or read ahead for one, or for a peer)
    WARM = "warm"  # `tierfs warm`: asked for explicitly, always admitted
    WRITTEN = "written"  # written through the mount: stored anyway, heat 0 until read


class History:
    """Decayed heat of chunks read while not in the cache, bounded, oldest forgotten."""

    def __init__(self, half_life: float, size: int) -> None:
        self.half_life = half_life
        self.size = max(1, min(size, HISTORY_MAX))
        self._seen: OrderedDict[bytes, tuple[float, float]] = OrderedDict()

    def heat(self, ckey: bytes, now: float) -> float:
        past = self._seen.get(ckey)
        return 0.0 if past is None else decayed(past[0], past[1], now, self.half_life)

    def last(self, ckey: bytes) -> tuple[float, float] | None:
        """(heat as of its last read, the time of that read), if remembered."""
        return self._seen.get(ckey)

    def remember(self, ckey: bytes, heat: float, at: float) -> None:
        self._seen[ckey] = (heat, at)
        self._seen.move_to_end(ckey)
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)

    def forget(self, ckey: bytes) -> tuple[float, float] | None:
        return self._seen.pop(ckey, None)


class LruShadow:
    """The chunk keys plain LRU of `size` bytes would hold (and their lengths, no data):
    which reads it would hit. In bytes, not keys: a 4 KiB label file takes 1/2000 of the
    room of an 8 MiB chunk (bench/report_run.py: a shadow of 15 keys for a 128 MiB cache of
    8 MiB chunks let every label file go, and they churned)."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._keys: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0

    def __contains__(self, ckey: bytes) -> bool:
        return ckey in self._keys

    def access(self, ckey: bytes, length: int) -> bool:
        """LRU reads or stores `ckey` (`length` bytes): whether it held it (a hit)."""
        held = self._keys.pop(ckey, None)
        self._bytes += length - (held or 0)
        self._keys[ckey] = length
        while self._bytes > self.size and len(self._keys) > 1 or len(self._keys) > HISTORY_MAX:
            self._bytes -= self._keys.popitem(last=False)[1]
        return held is not None


class Admission:
    """The policy (module doc). `chunks`: the cache's size in chunks (sizes the history);
    `lru_bytes`: the most the cache holds (its budget's high watermark share: plain LRU's
    shadow holds as much)."""

    def __init__(self, half_life: float, chunks: int, lru_bytes: int) -> None:
        self.half_life = half_life
        self.chunks = max(1, chunks)
        self.history = History(half_life, HISTORY_FACTOR * self.chunks)
        self.lru = LruShadow(lru_bytes)
        # LRU's hits beyond the cache's (module doc), fading by 1/chunks per access
        self.trail = 0.0
        self._fade = 1.0 - 1.0 / self.chunks
        self._jobs: OrderedDict[str, None] = OrderedDict()  # seen, least recently first
        self.new_job_at = -1  # accesses when a new job last opened its first file
        self.accesses = 0  # chunk accesses counted (`accessed`): the clock of read gaps
        # cached chunks not read twice since stored: accesses at the store or the one read
        self._once: dict[bytes, int] = {}
        # the others: (longest gap between two reads, accesses at the last), least recently
        # read first
        self._gaps: OrderedDict[bytes, tuple[int, int]] = OrderedDict()

    def set_half_life(self, half_life: float) -> None:
        """The heat half-life in use changed (heat.HalfLife)."""
        self.half_life = self.history.half_life = half_life

    def admits(self, ckey: bytes, length: int, vkey: bytes, victim: ChunkRecord,
               now: float) -> bool:
        """Whether a chunk of `length` bytes fetched for a reader may push out `victim` (the
        coldest chunk the evictor would drop for it, key `vkey`). Heats are weighed by what a
        miss costs per byte (heat.value): the same for chunks of one size. An unread written
        chunk (heat 0) goes stale as one read at its write would, and ranks as
        UNREAD_WRITTEN reads before that (heat.ranked)."""
        if decayed(max(victim.heat, 1.0), victim.last_access, now, self.half_life) < STALE:
            return True
        if victim.heat == RESTORED and vkey in self._once and \
                self.accesses - self._once[vkey] < self.chunks:
            return False  # the next save's room, for a cache-full of accesses (module doc)
        past = self.history.last(ckey)
        if past is None:
            return False
        if vkey in self._gaps and self._stopped(*self._gaps[vkey]):
            return True  # abandoned (module doc)
        heat, at = past
        lag = (at - victim.last_access) / self.half_life
        counted = max(0.0, abs(lag) - LAG_IGNORED)
        return value(heat, length) * 2.0 ** (counted if lag > 0 else -counted) > \
            MARGIN * value(ranked(victim.heat), victim.length)

    def refused(self, ckey: bytes, now: float) -> None:
        """A chunk served from memory only: its read is history."""
        self.history.remember(ckey, self.history.heat(ckey, now) + 1.0, now)

    def accessed(self) -> None:
        """One chunk access (a reader's touch or a fill), as heat.HalfLife counts them."""
        self.accesses += 1
        self.trail *= self._fade

    def missed(self, ckey: bytes, length: int) -> bool:
        """A reader's chunk of `length` bytes not in the cache is fetched (before
        `accessed`): whether plain LRU would have hit it (`replaceable` takes that)."""
        hit = self.lru.access(ckey, length)
        self.trail += hit
        return hit

    @property
    def behind_lru(self) -> bool:
        """Whether plain LRU has lately hit clearly more than the cache (module doc)."""
        return self.trail > max(TRAILING * self.chunks, TRAILING_MIN)

    def job_opened(self, reader: str) -> None:
        """`reader` (tierfs/telemetry/callers.py) opened a file: a Slurm job or pod not seen before
        opens a cache-full of accesses in which new data takes the room of data not read
        since (module doc, `replaceable`). Users (uid:N) do not: what they read by hand is more
        often a pass than a working set."""
        if not reader.startswith(("job:", "pod:")):
            return
        if reader in self._jobs:
            self._jobs.move_to_end(reader)
            return
        self._jobs[reader] = None
        if len(self._jobs) > JOBS_KEPT:
            self._jobs.popitem(last=False)
        self.new_job_at = self.accesses

    def read(self, ckey: bytes, rec: ChunkRecord) -> None:
        """A reader's access to cached chunk `rec`, before its heat changes and before the
        access is counted (`accessed`, next): the gap since its last read (not since a
        written chunk's store, nor since a restart); and LRU's view of it."""
        if not self.lru.access(ckey, rec.length):
            self.trail -= 1.0
        this = self.accesses + 1
        if ckey in self._gaps:
            gap, last = self._gaps.pop(ckey)
            self._gaps[ckey] = (max(gap, this - last), this)
            return
        once = self._once.pop(ckey, None)
        if once is not None and rec.heat > 0.0:
            self._gaps[ckey] = (this - once, this)
        else:
            self._once[ckey] = this

    def _stopped(self, gap: int, last: int) -> bool:
        return self.accesses - last > ABANDONED * max(gap, MIN_GAP * self.chunks)

    def replaceable(self, ckey: bytes, evictable: Callable[[bytes], bool],
                 lru_hit: bool) -> tuple[bytes, str] | None:
        """(the cached chunk whose room `ckey` takes, why: "abandoned", "lru" or "new_job"),
        `ckey` a reader's chunk the comparison refused (module doc; `lru_hit`: `missed` said
        plain LRU would hit it), if any: the least
        recently read abandoned chunk, if `ckey` was read before; else the least recently
        read chunk, if LRU no longer holds it, while the cache trails LRU and LRU would hit
        `ckey` or it is new data (never read), or for a cache-full of accesses after a new
        job opened its first file if `ckey` is new data and that chunk was not read since.
        One that `evictable` turns down (pinned, being written, smaller than `ckey`) goes to
        the back of the order, at most SKIPPED_MAX of them a call."""
        known = self.history.last(ckey) is not None
        if known:
            victim = self._stopped_being_read(evictable)
            if victim is not None:
                return victim, "abandoned"
        if self.behind_lru and (lru_hit or not known):
            before, why = float("inf"), "lru"  # any chunk LRU let go
        elif not known and self.accesses - self.new_job_at < self.chunks:
            before, why = self.new_job_at, "new_job"  # those not read since it started
        else:
            return None
        last, victim = self._least_recently_read(evictable)
        return (victim, why) if victim is not None and victim not in self.lru \
            and last < before else None

    def _stopped_being_read(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        for _ in range(min(len(self._gaps), SKIPPED_MAX + 1)):
            vkey, (gap, last) = next(iter(self._gaps.items()))
            if not self._stopped(gap, last):
                return None
            if evictable(vkey):
                return vkey
            self._gaps.move_to_end(vkey)
        return None

    def _least_recently_read(self, evictable: Callable[[bytes], bool]
                             ) -> tuple[int, bytes | None]:
        """(accesses at its last read, key) of the cached chunks (`_once` and `_gaps`, each
        in read order), or (0, None)."""
        fronts = []
        once = self._evictable_front(self._once, evictable)
        if once is not None:
            fronts.append((self._once[once], once))
        gaps = self._evictable_front(self._gaps, evictable)
        if gaps is not None:
            fronts.append((self._gaps[gaps][1], gaps))
        return min(fronts) if fronts else (0, None)

    @staticmethod
    def _evictable_front(order: dict, evictable: Callable[[bytes], bool]) -> bytes | None:
        """The first key of `order` that `evictable` takes among its first SKIPPED_MAX + 1;
        those before it go to the back."""
        for _ in range(min(len(order), SKIPPED_MAX + 1)):
            vkey = next(iter(order))
            if evictable(vkey):
                return vkey
            order[vkey] = order.pop(vkey)
        return None

    def dropped(self, ckey: bytes) -> None:
        """A chunk left the cache (evicted or not): its gaps go."""
        self._once.pop(ckey, None)
        self._gaps.pop(ckey, None)

    def evicted(self, ckey: bytes, rec: ChunkRecord) -> None:
        self.history.remember(ckey, rec.heat, rec.last_access)

    def entry_heat(self, ckey: bytes, kind: Fill, now: float, length: int) -> float:
        """The heat a chunk of `length` bytes is indexed with (module doc); its history is
        over."""
        past = self.history.forget(ckey)
        if kind is not Fill.READ:  # LRU stores what is written or warmed too (`missed`: read)
            self.lru.access(ckey, length)
        self._gaps.pop(ckey, None)
        self._once[ckey] = self.accesses
        if kind is Fill.WRITTEN:
            return 0.0
        if kind is Fill.WARM or past is None:
            return 1.0
        return 1.0 + decayed(past[0], past[1], now, self.half_life)
