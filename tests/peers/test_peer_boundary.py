"""What a peer port answers those who hold the secret and those who do not (issue 26,
S1, S4, S5), on real daemons over the session's RGW.

  S1  a node serves only keys under the prefix it mounts; a key outside it and a key the
      store does not have get the same answer (404 "refused"), and the first costs no GET
  S4  500 idle connections without the secret (from one address and from 64) do not keep
      an honest peer out: its chunks come from the owner, none is "unavailable"
  S5  3,000 unsigned requests from 250 addresses: at most 10 WARNING lines, the rest
      counted in tierfs_peer_unauthorized_unlogged_total
"""

from __future__ import annotations

import http.client
import socket
import time

import pytest

from cluster import MiB, payload, read_sha, sha256

pytestmark = pytest.mark.mount

CHUNK_ARGS = ["--chunk-size", "1M"]


def _get(port: int, target: str, auth: str | None, source: str = "127.0.0.1"
         ) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30,
                                      source_address=(source, 0))
    try:
        conn.request("GET", target, headers={"authorization": auth} if auth else {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_a_peer_serves_only_keys_under_its_prefix_and_tells_nothing_else(fleet, s3, bucket):
    from tierfs.peers.wire import ChunkRequest, sign_request

    objects = {"team-a/x.bin": payload("in", MiB), "team-b/secret.bin": payload("out", MiB),
               "team-ab/y.bin": payload("beside", MiB)}
    etags = {k: s3.put_object(Bucket=bucket, Key=k, Body=v)["ETag"].strip('"')
             for k, v in objects.items()}
    c = fleet(1, prefix="team-a", extra_args=CHUNK_ARGS)
    node = c.nodes[0]

    def ask(key: str, etag: str, size: int = MiB) -> tuple[int, bytes]:
        target = ChunkRequest(bucket, key, etag, size, 0, MiB).target()
        return _get(node.peer_port, target,
                    sign_request(c.secret, "127.0.0.1:1", "GET", target, time.time()))

    gets = node.counter("tierfs_backend_requests_total", op="get")
    refused = (404, b"refused")
    # outside the prefix: there or not, right ETag or wrong, the same answer, no GET
    assert ask("team-b/secret.bin", etags["team-b/secret.bin"]) == refused
    assert ask("team-b/secret.bin", "0123") == refused
    assert ask("team-b/none.bin", "0123") == refused
    assert ask("team-ab/y.bin", etags["team-ab/y.bin"]) == refused  # a prefix of the name
    assert ask("team-a/../team-b/secret.bin", etags["team-b/secret.bin"]) == refused
    assert ask("team-a//x.bin", etags["team-a/x.bin"]) == refused
    assert node.counter("tierfs_backend_requests_total", op="get") == gets
    # inside it, a key the store does not have: the same answer again
    assert ask("team-a/none.bin", "0123") == refused
    # the control: a key under the prefix is served
    assert ask("team-a/x.bin", etags["team-a/x.bin"]) == (200, objects["team-a/x.bin"])
    assert node.counter("tierfs_peer_bytes_total", direction="out") == MiB
    assert node.counter("tierfs_peer_requests_total", role="server", result="refused") == 7
    assert "team-b" not in node.mount.log_text()


def _idle(port: int, n: int, sources: list[str]) -> list[socket.socket]:
    out = []
    for i in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((sources[i % len(sources)], 0))
        s.connect(("127.0.0.1", port))
        out.append(s)
    return out


def test_idle_connections_without_the_secret_do_not_keep_a_peer_out(fleet, s3, bucket):
    data = payload("s4", 32 * MiB)
    s3.put_object(Bucket=bucket, Key="ckpt/model.pt", Body=data)
    c = fleet(2, extra_args=CHUNK_ARGS)
    owner, reader = c.nodes
    # 250 from the honest peer's own address, 250 from 64 others
    idle = _idle(owner.peer_port, 250, ["127.0.0.1"])
    idle += _idle(owner.peer_port, 250, [f"127.0.2.{i}" for i in range(1, 65)])
    try:
        time.sleep(1)
        assert read_sha(reader.path / "ckpt/model.pt")[0] == sha256(data)
        results = c.peer_results("client")
        assert results.get("unavailable", 0) == 0, results
        assert results.get("ok", 0) >= 1, results  # the owner's chunks came from it
        assert reader.counter("tierfs_read_bytes_total", source="peer") > 0
        assert reader.counter("tierfs_peers_up") == 1
    finally:
        for s in idle:
            s.close()


def test_unsigned_requests_from_many_addresses_are_a_few_log_lines(fleet):
    c = fleet(1)
    node = c.nodes[0]
    start = time.monotonic()
    for i in range(3000):
        assert _get(node.peer_port, "/v1/chunk", None, f"127.0.3.{i % 250 + 1}")[0] == 401
    took = time.monotonic() - start
    lines = [ln for ln in node.mount.log_text().splitlines()
             if "peer server: refused a request from" in ln]
    assert 1 <= len(lines) <= 10, lines
    assert node.counter("tierfs_peer_requests_total", role="server",
                        result="unauthorized") == 3000
    assert node.counter("tierfs_peer_unauthorized_unlogged_total") == 3000 - len(lines)
    print(f"3000 unsigned requests in {took:.1f} s: {len(lines)} WARNING lines")
