"""build_core: the object graph of a mount, without FUSE.

The daemon and the in-process test harness (tests/unit/unitkit.py) build the core here,
and only here, so what the tests drive is what the daemon runs: the chunk cache over its
recovered cache dir, the read walk and read-ahead, write-back with its journal recovered,
the namespace, file I/O and warm, and the background services (index flusher, uploaders,
orphaned-upload cleanup, pin expiry, the stall watch, the store's health probe, the
usage flusher) under the `Tasks` supervisor: a service that fails is logged, counted and
started again.

What stays in daemon.py is what needs a kernel or a process: mount point checks, the
cache-dir lock, the bucket check, the control socket, pyfuse3, signals and the drain at
unmount.

Lifetime (`async with build_core(...) as core`):
- one-shot background work (chunk fills, read-ahead, background listings) runs in the
  outer nursery; a clean exit waits for it, so a test that closes the core finds every
  fetched chunk stored;
- the long-running services run in an inner nursery and are cancelled at exit;
- `core.cancel()` (the daemon at unmount) cancels everything at once;
- in every case the chunk index is flushed (shielded) and the index closed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import trio

from ..backend.base import Backend
from ..backend.health import BackendHealth
from ..backend.runner import AsyncBackend
from ..cache import Admission, ChunkCache, ObjectVersion
from ..cache.disk import DiskTier
from ..cache.evictor import Evictor
from ..cache.memory import MemoryTier
from ..cache.tier import Bytes, Want
from ..cachedir import Layout
from ..config import MountConfig, read_peer_secret
from ..errors import InvalidArgument, StartupError
from ..files.exclusive import ConditionalWrites
from ..files.fileio import FileIO
from ..files.namespace import Namespace
from ..index.meta import MetaStore
from ..metrics import Metrics
from ..peers import Membership, Peer, PeerClient, PeerServer, PeerTier
from ..peers.wire import MAX_CHUNK
from ..read import neargc
from ..read.dirahead import DirReadAhead
from ..read.near import NearSource
from ..read.prefetch import Prefetcher
from ..read.promote import Copier, Promoter
from ..read.walk import TierWalk
from ..tasks import Tasks, sole_exception
from ..telemetry.analytics import Analytics
from ..telemetry.callers import Callers
from ..telemetry.capacity import CapacityHistory
from ..telemetry.stalls import StallLog
from ..telemetry.usage import Usage
from ..writeback import WriteBack
from .peerserve import PeerServe
from .warm import Warmer

log = logging.getLogger(__name__)

BLOCK_SIZE = 64 << 10  # checksum unit: a 4 KiB read verifies 64 KiB; 512 B of CRCs per 8 MiB
UPLOADERS = 4  # files uploaded in parallel by the write-back workers
PIN_EXPIRY_INTERVAL_S = 30.0


class CoreTasks(Tasks):
    """`Tasks` whose supervised services live in a nursery of their own.

    One-shot work (`spawn`) goes to the outer nursery, which a clean close waits for;
    services (`supervise`) go to the inner one, which a close cancels: they run forever,
    so waiting for them would never end."""

    def __init__(self, nursery: trio.Nursery, services: trio.Nursery, metrics: Metrics) -> None:
        super().__init__(nursery, metrics)
        self.services = services

    def supervise(self, name: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        self.services.start_soon(self._forever, name, fn, args, name=name)


@dataclass
class Core:
    cfg: MountConfig
    metrics: Metrics
    backend: AsyncBackend
    meta: MetaStore
    disk: DiskTier
    evictor: Evictor
    memory: MemoryTier
    cache: ChunkCache
    tasks: CoreTasks
    walk: TierWalk
    prefetcher: Prefetcher
    writeback: WriteBack
    namespace: Namespace
    fileio: FileIO
    warmer: Warmer
    peers: PeerTier | None  # --peers: other nodes' caches before the store
    chunks_kept: int  # by the cache recovery at start
    chunks_dropped: int
    files_recovered: int  # journaled files with unsaved writes, queued for upload
    capacity: CapacityHistory | None = None  # the sampled history for `usage --forecast`
    usage: Usage | None = None  # bytes read and stalls per tenant and reader
    stalls: StallLog | None = None  # reads that waited on a fetch past stall_threshold
    analytics: Analytics | None = None  # reads and LIST/HEAD per prefix, files per job
    near: NearSource | None = None  # --tier: the near store before the source
    promoter: Promoter | None = None  # copies what the source answered to the near store

    def near_status(self) -> dict | None:
        """The near store for `tierfs status` (None without --tier)."""
        near = self.near
        if near is None:
            return None
        health = near.backend.health
        promoter = self.promoter
        return {"store": str(self.cfg.tier), "up": health is None or health.up,
                "chunks": {"hits": near.hits, "misses": near.misses, "failures": near.failures},
                "promotions": None if promoter is None else {
                    "pending": promoter.pending(), "copied": promoter.copied,
                    "copied_bytes": promoter.copied_bytes}}

    async def near_gc(self, budget: int | None, dry_run: bool) -> dict:
        """`tierfs gc --tier near`: tierfs/read/neargc.py, with the mount's near_size."""
        if self.near is None or self.cfg.tier is None:
            raise InvalidArgument("this mount has no near store (--tier)")
        return await neargc.collect(
            self.near.backend, self.cfg.tier.prefix, self.backend, self.cfg.source.prefix,
            budget=self.cfg.near_size if budget is None else budget, dry_run=dry_run)

    def cancel(self) -> None:
        """Stop every background task now (the daemon at unmount, after its drain)."""
        self.tasks.nursery.cancel_scope.cancel()


def async_backend(cfg: MountConfig, backend: Backend | AsyncBackend,
                  metrics: Metrics, tier: str = "") -> AsyncBackend:
    """The backend behind the limiters and metrics the core expects (as the daemon sizes them),
    with a BackendHealth (degraded mode) unless it has one: probing with the backend's own
    bucket check (the daemon gives it a quicker one). `tier`: "" for the source, "near"
    for the near store (docs/tiers.md)."""
    if not isinstance(backend, AsyncBackend):
        backend = AsyncBackend(backend, metrics, concurrency=cfg.backend_concurrency,
                               background=cfg.readahead_chunks, warm=cfg.warm_concurrency,
                               stall_warn=cfg.stall_warn, tier=tier)
    if backend.health is None:
        backend.health = BackendHealth(backend.metrics, backend.sync.check, tier=tier)
    return backend


@contextlib.asynccontextmanager
async def build_core(cfg: MountConfig, backend: Backend | AsyncBackend, *,
                     metrics: Metrics | None = None,
                     clock: Callable[[], float] = time.time,
                     statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
                     block_size: int = BLOCK_SIZE,
                     index_map_size: int | None = None,
                     near: Backend | AsyncBackend | None = None) -> AsyncIterator[Core]:
    """Build the core of a mount of `cfg` over `backend` (and `near`, the near store of
    --tier), run its background services, and take it down at exit (see the module
    docstring). `clock`, `statvfs`, `block_size` and `index_map_size` are seams for
    tests; the daemon leaves them alone."""
    metrics = metrics if metrics is not None else (
        backend.metrics if isinstance(backend, AsyncBackend) else Metrics())
    abackend = async_backend(cfg, backend, metrics)
    anear = None if near is None else async_backend(cfg, near, metrics, "near")
    cache_dir = cfg.effective_cache_dir
    meta_kw = {} if index_map_size is None else {"map_size": index_map_size}
    meta = MetaStore(Layout(cache_dir).index, str(cfg.source), **meta_kw)
    try:
        disk = DiskTier(cache_dir, block_size)
        evictor = Evictor(cache_dir, cache_size=cfg.cache_size, min_free_ratio=cfg.min_free_ratio,
                          high=cfg.evict_high, low=cfg.evict_low, half_life=cfg.heat_half_life,
                          statvfs=statvfs)
        memory = MemoryTier(cfg.memory_cache_size)
        admission = Admission(cfg.heat_half_life, cfg.cache_size // cfg.chunk_size,
                              int(cfg.evict_high * cfg.cache_size))
        cache = ChunkCache(meta, disk, memory, evictor, metrics, admission=admission, clock=clock,
                           tenants=cfg.tenants)
        kept, dropped = await trio.to_thread.run_sync(cache.recover)
        log.info("cache dir %s: %d chunks (%d bytes) kept, %d dropped", cache_dir, kept,
                 cache.used_bytes, dropped)
        core: Core | None = None
        try:
            async with trio.open_nursery() as work:
                async with trio.open_nursery() as services:
                    tasks = CoreTasks(work, services, metrics)
                    core = _wire(cfg, metrics, abackend, meta, disk, evictor, memory, cache,
                                 tasks, clock, kept, dropped)
                    if anear is not None:
                        _add_near(core, cfg, anear)
                    core.capacity = CapacityHistory(meta, cache, metrics, clock=clock,
                                                    tenant_of=_tenant_of(cfg))
                    _start_services(core)
                    if core.peers is not None:
                        await _start_peer_server(core, services, block_size)
                    yield core
                    services.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # the nurseries wrap what the caller's body raised; give it back as it was
            # raised (a StartupError stays catchable as one). Tasks never raise here.
            exc = sole_exception(group)
            if exc is group:
                raise
            raise exc from exc.__cause__  # keeps its own cause, drops the group as context
        finally:
            with trio.CancelScope(shield=True):
                await cache.flush_index()
                if core is not None and core.usage is not None:
                    await _flush_usage(core.usage)
                if core is not None and core.analytics is not None:
                    await _flush_usage(core.analytics)
                if core is not None and core.peers is not None:
                    await core.peers.client.aclose()  # the idle keep-alive connections
            cache.close()  # the chunk files the disk tier keeps open
    finally:
        meta.close()


def _wire(cfg: MountConfig, metrics: Metrics, backend: AsyncBackend, meta: MetaStore,
          disk: DiskTier, evictor: Evictor, memory: MemoryTier, cache: ChunkCache,
          tasks: CoreTasks, clock: Callable[[], float], kept: int, dropped: int) -> Core:
    walk = TierWalk(backend, cache, cfg.chunk_size, tasks)
    prefetcher = Prefetcher(walk, cache, metrics, tasks, max_window=cfg.readahead_chunks,
                            max_queued=2 * cfg.readahead_chunks)
    wb = WriteBack(meta, cache, backend, metrics, bucket=cfg.source.bucket,
                   cache_dir=cfg.effective_cache_dir, chunk_size=cfg.chunk_size,
                   writeback=cfg.writeback, dirty_wait_s=cfg.dirty_wait,
                   read_base=_base_reader(walk), clock=clock)
    recovered = wb.recover()
    if recovered:
        log.info("%d files with unsaved writes recovered from the journal", recovered)
    # reads and metadata requests per prefix, files per job (`tierfs report`)
    analytics = Analytics(meta, root_prefix=cfg.source.prefix, half_life_s=cfg.heat_half_life,
                          clock=clock)
    ns = Namespace(meta, backend, metrics, root_prefix=cfg.source.prefix, analytics=analytics,
                   ttl_s=cfg.metadata_ttl, clock=clock, has_local_writes=wb.is_dirty,
                   tasks=tasks, head_max_size=cfg.head_max_size,
                   revalidate_timeout_s=cfg.revalidate_timeout,
                   # a shared mount's directories show their real modes from the start
                   head_dirs=cfg.allow_other and cfg.head_max_size >= 0)
    if not cfg.read_only:  # O_CREAT|O_EXCL claims its key in the store (tierfs/files/exclusive.py)
        ns.exclusive = ConditionalWrites(backend, cfg.source.prefix)
    # who reads what (docs/tenants.md, "Readers"), and the reads that stalled
    usage = Usage(meta, metrics, clock=clock)
    stalls = StallLog(metrics, threshold_s=cfg.stall_threshold, tenants=cfg.tenants.names(),
                      clock=clock)
    fileio = FileIO(ns, cache, walk, prefetcher, metrics, bucket=cfg.source.bucket,
                    writeback=wb, rename_max_objects=cfg.rename_max_objects, usage=usage,
                    callers=Callers(), tenant_of=cfg.tenants.of, stalls=stalls,
                    dirahead=DirReadAhead(meta.inodes, cache, walk, tasks, metrics,
                                          max_bytes=cfg.readahead_chunks * cfg.chunk_size))
    warmer = Warmer(ns, cache, walk, metrics, bucket=cfg.source.bucket,
                    has_local_writes=wb.is_dirty)
    peers = _peer_tier(cfg, metrics) if cfg.peers is not None else None
    if peers is not None:
        walk.add_peers(peers)
    return Core(cfg, metrics, backend, meta, disk, evictor, memory, cache, tasks, walk,
                prefetcher, wb, ns, fileio, warmer, peers, kept, dropped, recovered,
                usage=usage, stalls=stalls, analytics=analytics)


def _add_near(core: Core, cfg: MountConfig, near: AsyncBackend) -> None:
    """--tier: the near store, asked after the peers and before the source; what the
    source answers is copied to it unless promote = none (docs/tiers.md)."""
    assert cfg.tier is not None
    walk = core.walk
    if cfg.promote == "all":
        core.promoter = Promoter(Copier(near, cfg.tier.prefix,
                                        _base_reader(walk, background=True), cfg.chunk_size),
                                 core.metrics)
    offer = core.promoter.offer if core.promoter is not None else None
    core.near = NearSource(near, cfg.tier.prefix, core.cache, cfg.chunk_size, offer=offer)
    walk.sources.insert(walk.sources.index(walk.store), core.near)
    walk.warm_sources.append(core.near)
    # `tierfs warm --tier near`: straight from the source, this node's tiers left alone
    store = walk.store

    async def from_store(obj: ObjectVersion, index: int) -> Bytes:
        return await store.fetch(Want(obj, index, background=True), obj.key, obj.etag)

    core.warmer.near = Copier(near, cfg.tier.prefix, from_store, cfg.chunk_size)


def _base_reader(walk: TierWalk, background: bool = False,
                 ) -> Callable[[ObjectVersion, int], Awaitable[Bytes]]:
    """How the write-back reads a chunk of a partial write's base, and the promoter a chunk
    it copies: the read walk, no heat (`background`: at read-ahead priority)."""
    async def read_base(obj: ObjectVersion, index: int) -> Bytes:
        return (await walk.read(Want(obj, index, background=background))).data
    return read_base


def _peer_tier(cfg: MountConfig, metrics: Metrics) -> PeerTier:
    """The asking side of the peer tier (docs/peers.md): membership, client, fallback."""
    if cfg.chunk_size > MAX_CHUNK:
        raise StartupError(f"--peers needs a chunk size of at most {MAX_CHUNK >> 20} MiB "
                           f"(this mount's is {cfg.chunk_size >> 20} MiB)")
    assert cfg.peers is not None and cfg.peer_advertise is not None  # checked by the config
    me = Peer(*cfg.peer_advertise)
    members = Membership(cfg.peers, me)
    members.load()
    client = PeerClient(read_peer_secret(cfg), me.name, metrics,
                        ssl_context=_peer_tls(cfg, ssl.Purpose.SERVER_AUTH))
    metrics.peers_up.set(len(members.live()))
    return PeerTier(members, client, metrics, timeout_s=cfg.peer_timeout)


def _peer_tls(cfg: MountConfig, purpose: ssl.Purpose) -> ssl.SSLContext | None:
    """Mutual TLS on the peer port when --peer-tls-* are given: every node shows its
    certificate (naming its advertised host) and checks the other's against the CA."""
    if cfg.peer_tls_cert is None:
        return None
    try:
        ctx = ssl.create_default_context(purpose, cafile=cfg.peer_tls_ca)
        ctx.load_cert_chain(cfg.peer_tls_cert, cfg.peer_tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"peer TLS: {exc}") from None
    ctx.verify_mode = ssl.CERT_REQUIRED  # a server context asks for the client's too
    return ctx


async def _start_peer_server(core: Core, services: trio.Nursery, block_size: int) -> None:
    """Serve this node's chunks to its peers, and keep the membership current. The server
    is bound before the mount is ready (a port in use is a start-up error, one line)."""
    cfg, peers = core.cfg, core.peers
    assert peers is not None and cfg.peer_listen is not None
    serve = PeerServe(core.namespace, core.walk, bucket=cfg.source.bucket,
                      block_size=block_size)
    server = PeerServer(cfg.peer_listen, read_peer_secret(cfg), serve, core.metrics,
                        ssl_context=_peer_tls(cfg, ssl.Purpose.CLIENT_AUTH),
                        max_concurrent=cfg.peer_max_concurrent, bandwidth=cfg.peer_bandwidth)
    bound = await services.start(server.run)
    log.info("serving chunks to peers on %s:%d (%s)", *bound, cfg.peers)
    core.tasks.supervise("peer-members", peers.members.run)


def _start_services(core: Core) -> None:
    """The long-running tasks beside the FUSE loop; a failure restarts them (Tasks)."""
    tasks = core.tasks
    tasks.supervise("flusher", core.cache.run_flusher)
    for _ in range(UPLOADERS):
        tasks.supervise("uploader", core.writeback.run_uploader)
    tasks.supervise("orphan-cleanup", core.writeback.run_orphan_cleanup)
    tasks.supervise("pin-expiry", _expire_pins, core.cache)
    if core.cache.idle_sweep_interval() is not None:  # a tenant has a max_idle
        tasks.supervise("idle-sweep", core.cache.run_idle_sweeper)
    tasks.supervise("stall-watch", core.backend.watch_stalls)
    if core.namespace.exclusive is not None:  # in the background: the mount does not wait
        tasks.supervise("conditional-probe", core.namespace.exclusive.run)
    if core.backend.health is not None:
        tasks.supervise("health-probe", core.backend.health.run)
    if core.near is not None and core.near.backend.health is not None:
        tasks.supervise("near-health-probe", core.near.backend.health.run)
        tasks.supervise("near-stall-watch", core.near.backend.watch_stalls)
    if core.promoter is not None:
        tasks.supervise("promoter", core.promoter.run)
    if core.capacity is not None:
        tasks.supervise("capacity-sampler", core.capacity.run)
    if core.usage is not None:
        tasks.supervise("usage-flusher", core.usage.run_flusher)
    if core.analytics is not None:
        tasks.supervise("analytics-flusher", core.analytics.run_flusher)


def _tenant_of(cfg: MountConfig) -> Callable[[str], str] | None:
    tenants = getattr(cfg, "tenants", None)  # MountConfig.tenants (a TenantMap) once it lands
    return None if tenants is None else tenants.of


async def _flush_usage(usage: Usage | Analytics) -> None:
    """The last usage (or analytics) counts into the index at close; a failure costs the
    report only (at most the last flush interval), never the close."""
    try:
        await usage.flush()
    except Exception as exc:  # noqa: BLE001 - usage is a report
        log.warning("%s counts since the last flush not kept: %s", type(usage).__name__.lower(),
                    exc)


async def _expire_pins(cache: ChunkCache, interval_s: float = PIN_EXPIRY_INTERVAL_S) -> None:
    while True:
        for owner in cache.pins.expire():
            log.info("pin of %s expired", owner)
        await trio.sleep(interval_s)
