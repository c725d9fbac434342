"""Every Prometheus metric of tierfs, as a named attribute of one Metrics object.

Metric names are API (documented in docs/metrics.md): change them only with the docs.
The registry is injected so tests and several mounts in one process never collide.
Label values are fixed vocabularies (tier, op, source): never keys, paths or secrets.
"""

from __future__ import annotations

import gzip

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import choose_encoder

# *_created samples double the scrape size and no dashboard of ours uses them
disable_created_metrics()

# FUSE answers in microseconds when cached, backend calls in tens of milliseconds.
_LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                    0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# a read from the memory tier takes tens of microseconds
_READ_BUCKETS = (0.00001, 0.000025, 0.00005) + _LATENCY_BUCKETS
# a stall is past the threshold (50 ms by default) and at most the GET budget (~212 s)
_STALL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                  300.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.cache_hits = Counter("tierfs_cache_hits", "Chunk lookups answered by a cache tier",
                                  ["tier"], registry=r)
        self.cache_misses = Counter("tierfs_cache_misses",
                                    "Chunk lookups that no cache tier could answer", registry=r)
        self.cache_bytes = Gauge("tierfs_cache_bytes", "Bytes held by each cache tier", ["tier"],
                                 registry=r)
        self.cache_budget_bytes = Gauge(
            "tierfs_cache_budget_bytes",
            "Effective disk-tier budget (cache-size or free-space guard)", registry=r)
        self.cache_evictions = Counter("tierfs_cache_evictions",
                                       "Chunks evicted from the disk tier", registry=r)
        self.cache_refused = Counter("tierfs_cache_refused_chunks",
                                     "Fetched chunks not stored: the full disk tier holds hotter "
                                     "ones (served from memory)", registry=r)
        self.cache_yielded = Counter("tierfs_cache_yielded_chunks",
                                     "Cached chunks whose room a chunk the heat comparison "
                                     "refused took, by why", ["reason"], registry=r)
        self.heat_half_life = Gauge("tierfs_cache_heat_half_life_seconds",
                                    "Half-life heat decays with now: heat_half_life, or longer "
                                    "on a node slow to read its cache's worth", registry=r)
        self.cache_corrupt = Counter("tierfs_cache_corrupt_chunks",
                                     "Disk chunks dropped for a bad checksum or a missing file",
                                     registry=r)
        self.read_bytes = Counter("tierfs_read_bytes", "Bytes returned to readers by source",
                                  ["source"], registry=r)
        # one observation per FUSE read, under the furthest source it touched (a read of
        # memory and backend chunks is a backend read): p50/p99 per tier
        self.read_seconds = Histogram("tierfs_read_seconds",
                                      "Time to serve a read, by the furthest source it used",
                                      ["source"], buckets=_READ_BUCKETS, registry=r)
        # reads that waited on the store, a peer or the fetch queue past --stall-threshold;
        # tenant names come from the mount's config (bounded)
        self.read_stall_seconds = Histogram("tierfs_read_stall_seconds",
                                            "Reads that waited on a fetch past the stall "
                                            "threshold: the wait", ["tenant"],
                                            buckets=_STALL_BUCKETS, registry=r)
        self.backend_requests = Counter("tierfs_backend_requests",
                                        "Requests sent to the object store", ["op"], registry=r)
        self.backend_seconds = Histogram("tierfs_backend_request_seconds",
                                         "Object store request latency", ["op"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.backend_errors = Counter("tierfs_backend_errors",
                                      "Object store requests that failed after retries", ["op"],
                                      registry=r)
        self.backend_bytes = Counter("tierfs_backend_bytes",
                                     "Bytes downloaded from the object store", registry=r)
        self.fuse_requests = Counter("tierfs_fuse_requests", "FUSE requests answered", ["op"],
                                     registry=r)
        self.fuse_seconds = Histogram("tierfs_fuse_request_seconds", "FUSE request latency", ["op"],
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.fuse_errors = Counter("tierfs_fuse_errors", "FUSE requests answered with an error",
                                   ["op", "errno"], registry=r)
        self.invalid_keys = Counter("tierfs_invalid_keys",
                                    "Object keys hidden because they cannot be paths", registry=r)
        self.dirty_bytes = Gauge("tierfs_writeback_dirty_bytes",
                                 "Bytes written through the mount and not yet uploaded", registry=r)
        self.uploads = Counter("tierfs_writeback_uploads", "File uploads by outcome", ["outcome"],
                               registry=r)
        self.upload_seconds = Histogram("tierfs_writeback_upload_seconds",
                                        "Time to upload one file (all its parts)",
                                        buckets=_LATENCY_BUCKETS + (60.0, 300.0), registry=r)
        self.prefetch_dropped = Counter("tierfs_prefetch_dropped",
                                        "Read-ahead requests dropped because the queue was full",
                                        registry=r)
        self.dir_readahead_files = Counter(
            "tierfs_dir_readahead_files",
            "Small files fetched before their open: their directory was read in order",
            registry=r)
        self.warm_bytes = Counter("tierfs_warm_bytes",
                                  "Bytes downloaded by `tierfs warm` (also in backend_bytes)",
                                  registry=r)

        # fault handling (docs/semantics.md "When the object store fails")
        self.internal_errors = Counter("tierfs_internal_errors",
                                       "Unexpected exceptions in a task, logged with a traceback",
                                       ["task"], registry=r)
        self.backend_stalls = Counter("tierfs_backend_stalls",
                                      "Backend requests that ran longer than --stall-warn",
                                      ["op"], registry=r)
        self.backend_up = Gauge("tierfs_backend_up",
                                "1 while the object store answers, 0 while the mount is degraded",
                                registry=r)
        # object-store tiers other than the source (docs/tiers.md): the near store
        self.tier_requests = Counter("tierfs_tier_requests", "Requests sent to an object-store "
                                     "tier other than the source", ["tier", "op"], registry=r)
        self.tier_errors = Counter("tierfs_tier_errors", "Requests to an object-store tier "
                                   "that failed after retries", ["tier", "op"], registry=r)
        self.tier_bytes = Counter("tierfs_tier_bytes", "Bytes read from and written to an "
                                  "object-store tier other than the source",
                                  ["tier", "direction"], registry=r)
        self.tier_up = Gauge("tierfs_tier_up", "1 while an object-store tier answers, 0 while "
                             "reads skip it", ["tier"], registry=r)
        self.tier_promotions = Counter("tierfs_tier_promotions", "Objects copied to a near "
                                       "store after a read fetched them from the source, by "
                                       "outcome", ["tier", "outcome"], registry=r)
        self.backend_resumed = Counter("tierfs_backend_resumed_bodies",
                                       "GET bodies cut short and continued from the bytes received",
                                       registry=r)
        self.integrity_failures = Counter("tierfs_integrity_failures",
                                          "Fetched bodies whose checksum did not match (refetched)",
                                          ["check"], registry=r)

        # the peer tier (docs/peers.md): role is "client" (this node asked) or "server"
        # (this node answered); result is a fixed vocabulary (ok, refused, unavailable,
        # corrupt, stale, overloaded, unauthorized, timeout, bad_request)
        self.peer_requests = Counter("tierfs_peer_requests", "Chunk requests between peers",
                                     ["role", "result"], registry=r)
        self.peer_bytes = Counter("tierfs_peer_bytes",
                                  "Chunk bytes between peers (direction: in, out)",
                                  ["direction"], registry=r)
        # the 401 WARNING is rate-limited (tierfs/peers/server.py): what it left out
        self.peer_unauthorized_unlogged = Counter(
            "tierfs_peer_unauthorized_unlogged",
            "Unauthorized peer requests (401) the rate-limited WARNING did not log",
            registry=r)
        self.peers_up = Gauge("tierfs_peers_up", "Peers this node currently asks for chunks",
                              registry=r)

        # usage per tenant (docs/tenants.md): tenant names come from the mount's config, so
        # the series are few; readers (jobs, pods, uids) are never label values
        self.tenant_read_bytes = Counter("tierfs_tenant_read_bytes",
                                         "Bytes returned to readers per tenant and source",
                                         ["tenant", "source"], registry=r)
        self.tenant_stall_seconds = Counter("tierfs_tenant_stall_seconds",
                                            "Seconds reads waited on the object store or a peer",
                                            ["tenant"], registry=r)
        # Kubernetes pods' reads by namespace (tierfs-csi names the pods; usage.py bounds
        # the namespaces: they are label values, pods never are)
        self.namespace_read_bytes = Counter("tierfs_namespace_read_bytes",
                                            "Bytes returned to Kubernetes pods per namespace "
                                            "and source", ["namespace", "source"], registry=r)
        self.namespace_stall_seconds = Counter("tierfs_namespace_stall_seconds",
                                               "Seconds Kubernetes pods' reads waited on the "
                                               "object store or a peer, per namespace",
                                               ["namespace"], registry=r)
        # kind: cached (chunks on disk), pinned (of those), dirty (unsaved writes)
        self.tenant_cache_bytes = Gauge("tierfs_tenant_cache_bytes",
                                        "Bytes of the cache per tenant and kind",
                                        ["tenant", "kind"], registry=r)

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (0 if it was never set), e.g. for status."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def exposition(self, accept: str = "", accept_encoding: str = ""
                   ) -> tuple[bytes, list[tuple[str, str]]]:
        """One scrape: the body and its headers, in the format the client's Accept asks
        for (Prometheus text, or OpenMetrics), gzip'ed if it takes that, as
        prometheus_client's own server answers. Safe in a worker thread. The HTTP side is
        tierfs/mount/metricsserve.py."""
        encoder, content_type = choose_encoder(accept)
        body = encoder(self.registry)
        headers = [("content-type", content_type)]
        if "gzip" in accept_encoding.lower():
            body = gzip.compress(body, compresslevel=1)
            headers.append(("content-encoding", "gzip"))
        return body, headers
