"""peers/members.py: the peer list from a file, DNS or Slurm; rendezvous owners; down marks.

Real files, the real resolver (`localhost`) and, for Slurm, a real `scontrol` run; trio's
autojump clock drives the reload loop.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections import Counter

import pytest
import trio

from tierfs.errors import UsageError
from tierfs.peers.members import Membership, Peer, SourceError, parse_hostnames, parse_spec

ME = Peer("10.0.0.1", 7480)
NOT_ME = {"nowhere-host"}  # this machine's names, as Membership sees them in these tests
KEYS = [f"bucket/key/etag-{i}.{i % 7}".encode() for i in range(10_000)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def members(tmp_path, lines: list[str], **kw) -> Membership:
    path = tmp_path / "peers"
    path.write_text("\n".join(lines) + "\n")
    m = Membership(f"file:{path}", kw.pop("me", ME), local_names=NOT_ME, **kw)
    m.load()
    return m


def eight(n: int = 8) -> list[str]:
    return [f"10.0.1.{i}:7480" for i in range(1, n + 1)]


# ---- the peers file ------------------------------------------------------------------------


def test_file_with_comments_blank_lines_and_ipv6(tmp_path):
    m = members(tmp_path, ["# the training nodes", "", "  node-a:7480  ", "node-b:7481 # spare",
                           "[::1]:7480", "node-a:7480", "\t"])
    assert m.all() == sorted([Peer("node-a", 7480), Peer("node-b", 7481), Peer("::1", 7480)])
    assert Peer("::1", 7480).name == "[::1]:7480"


@pytest.mark.parametrize("line", ["node-a", "node-a:", "node-a:0", "node-a:65536", "node a:80",
                                  ":80", "[not-v6]:80", "a..b:80", "node-a:80:90x", "héllo:80"])
def test_a_bad_line_is_one_line_error_naming_the_line(tmp_path, line):
    path = tmp_path / "peers"
    path.write_text(f"# ok\nnode-a:7480\n{line}\n")
    with pytest.raises(UsageError) as err:
        Membership(f"file:{path}", ME, local_names=NOT_ME).load()
    msg = str(err.value)
    assert "\n" not in msg and f"peers file {path} line 3" in msg


@pytest.mark.parametrize("setup, why", [
    (lambda p: None, "No such file"),
    (lambda p: p.mkdir(), "not a regular file"),
    (lambda p: p.write_bytes(b"\xff\xfe:80\n"), "not UTF-8"),
])
def test_an_unreadable_file_at_start_is_one_line_error(tmp_path, setup, why):
    path = tmp_path / "peers"
    setup(path)
    with pytest.raises(UsageError, match=why) as err:
        Membership(f"file:{path}", ME, local_names=NOT_ME).load()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("spec, why", [
    ("file:relative/peers", "ABSOLUTE"), ("dns:name", "dns:NAME:PORT"),
    ("dns:name:99999", "dns:NAME:PORT"), ("dns::80", "dns:NAME:PORT"),
    ("consul:x", "file:PATH, dns:NAME:PORT or slurm"), ("", "expected"),
])
def test_a_bad_spec_is_one_line_error(spec, why):
    with pytest.raises(UsageError, match=why):
        Membership(spec, ME)


def test_me_is_excluded_by_address_or_by_hostname(tmp_path):
    m = members(tmp_path, ["10.0.0.1:7480", "10.0.0.2:7480", "10.0.0.1:7481"])
    assert m.all() == [Peer("10.0.0.1", 7481), Peer("10.0.0.2", 7480)]
    # a shared list names nodes by hostname; this node advertises an IP
    m = Membership(f"file:{tmp_path / 'peers'}", ME, local_names={"node-1"})
    (tmp_path / "peers").write_text("node-1:7480\nnode-2:7480\nnode-1:9999\n")
    m.load()
    assert m.all() == [Peer("node-1", 9999), Peer("node-2", 7480)]
    # ... and is hashed under that listed name, as the other nodes hash it
    other = Membership(f"file:{tmp_path / 'peers'}", Peer("node-2", 7480),
                       local_names={"node-2"})
    other.load()
    for key in KEYS[:500]:  # None is "me": node-1 for m, node-2 for other
        assert (m.owner(key) or Peer("node-1", 7480)) == (other.owner(key) or Peer("node-2", 7480))


async def test_reload_on_change_keeps_last_good_list_and_warns_once(tmp_path, caplog):
    m = members(tmp_path, eight(3))
    path = tmp_path / "peers"
    assert await m.reload() is False  # unchanged: not even read
    path.write_text("\n".join(eight(4)) + "\n")
    assert await m.reload() is True
    assert len(m.all()) == 4
    caplog.set_level(logging.WARNING, logger="tierfs.peers.members")
    path.unlink()
    for _ in range(3):
        assert await m.reload() is False
    path.write_text("10.0.1.1:7480\nbad line\n")
    assert await m.reload() is False
    assert len(m.all()) == 4  # the last good list
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No such file" in warnings[0].getMessage()
    path.write_text("10.0.1.9:7480\n")
    assert await m.reload() is True
    assert m.all() == [Peer("10.0.1.9", 7480)]
    path.write_text("oops\n")
    assert await m.reload() is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "line 1" in warnings[1].getMessage()


async def test_the_run_loop_polls_the_file(tmp_path, mock_clock):
    # the clock jumps only after 50 ms of real idleness, so the read's worker thread is
    # done before virtual time runs on
    mock_clock.autojump_threshold = 0.05
    m = members(tmp_path, eight(2))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(m.run)
        (tmp_path / "peers").write_text("10.0.1.5:7480\n")
        with trio.fail_after(600):
            while m.all() != [Peer("10.0.1.5", 7480)]:
                await trio.sleep(1)
        assert trio.current_time() < 10  # a poll or two, not the 600 s bound
        nursery.cancel_scope.cancel()


# ---- rendezvous ----------------------------------------------------------------------------


def test_owners_are_balanced_and_stable(tmp_path):
    m = members(tmp_path, eight(7))  # 7 peers + me = 8 candidates
    owners = Counter(m.owner(k) for k in KEYS)
    assert set(owners) == {None, *m.all()}
    for who, n in owners.items():
        assert 0.08 <= n / len(KEYS) <= 0.17, (who, n)
    again = members(tmp_path, list(reversed(eight(7))))  # the same set in another order
    assert all(m.owner(k) == again.owner(k) for k in KEYS)


def test_removing_a_peer_moves_only_its_chunks(tmp_path):
    m = members(tmp_path, eight(8))
    before = {k: m.owner(k) for k in KEYS}
    gone = Peer("10.0.1.3", 7480)
    fewer = members(tmp_path, [p for p in eight(8) if p != gone.name])
    moved = [k for k in KEYS if fewer.owner(k) != before[k]]
    assert moved and all(before[k] == gone for k in moved)
    assert len(moved) == sum(1 for k in KEYS if before[k] == gone)


def test_mark_down_and_recovery(tmp_path):
    clock = Clock()
    m = members(tmp_path, eight(8), clock=clock, down_s=30.0)
    before = {k: m.owner(k) for k in KEYS}
    bad = Peer("10.0.1.4", 7480)
    m.mark_down(bad)
    assert bad not in m.live() and bad in m.all() and len(m.live()) == 7
    now = {k: m.owner(k) for k in KEYS}
    assert all(now[k] != bad for k in KEYS)
    assert all(now[k] == before[k] for k in KEYS if before[k] != bad)
    m.mark_down(Peer("10.9.9.9", 1))  # not a peer: nothing to mark
    assert len(m.live()) == 7
    clock.now += 29.9
    assert bad not in m.live()
    clock.now += 0.2
    assert bad in m.live()
    assert all(m.owner(k) == before[k] for k in KEYS)


def test_all_peers_down_means_me(tmp_path):
    m = members(tmp_path, eight(2), clock=Clock())
    for p in m.all():
        m.mark_down(p)
    assert m.live() == [] and all(m.owner(k) is None for k in KEYS[:100])


# ---- DNS -----------------------------------------------------------------------------------


async def test_dns_localhost_resolves_to_loopback():
    m = Membership("dns:localhost:7480", ME, local_names=NOT_ME)
    m.load()
    assert Peer("127.0.0.1", 7480) in m.all()
    assert {p.port for p in m.all()} == {7480}
    assert await m.reload() is False  # the same answer again
    assert Peer("127.0.0.1", 7480) in m.all()


async def test_dns_that_does_not_resolve_keeps_the_list_and_warns(caplog):
    caplog.set_level(logging.WARNING, logger="tierfs.peers.members")
    m = Membership("dns:no-such-host.invalid:7480", ME, local_names=NOT_ME)
    m.load()  # not a refused mount: a headless Service has no address before its pods run
    assert m.all() == []
    assert await m.reload() is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no-such-host.invalid does not resolve" in warnings[0].getMessage()


# ---- Slurm ---------------------------------------------------------------------------------


def test_slurm_uses_the_job_nodes_inside_a_job_and_the_cluster_outside():
    inside = parse_spec("slurm", 7480, env={"SLURM_JOB_NODELIST": "gpu[01-03]"})
    assert inside.argv == ["scontrol", "show", "hostnames", "gpu[01-03]"]
    outside = parse_spec("slurm", 7480, env={})
    assert outside.argv == ["sinfo", "-h", "-N", "-r", "-o", "%N"]


@pytest.fixture
def slurm_env(tmp_path):
    """What a job's environment has: a Slurm configuration (expanding a host list is local
    to scontrol, no controller is asked) and the job's node list."""
    assert shutil.which("scontrol"), "scontrol is installed by scripts/install.sh"
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=gpu01 CPUs=1\n"
                    "PartitionName=p Nodes=ALL\n")
    return {**os.environ, "SLURM_CONF": str(conf), "SLURM_JOB_NODELIST": "gpu[01-04]"}


def test_parse_hostnames_of_a_real_scontrol_run(slurm_env):
    out = subprocess.run(["scontrol", "show", "hostnames", "gpu[01-03],cpu7"], env=slurm_env,
                         capture_output=True, timeout=30, check=True).stdout.decode()
    assert parse_hostnames(out) == ["gpu01", "gpu02", "gpu03", "cpu7"]
    assert parse_hostnames("a\nb\na\n\n") == ["a", "b"]  # sinfo -N: once per partition
    with pytest.raises(SourceError, match="node name"):
        parse_hostnames("a\nb c\n")


async def test_slurm_job_nodes_from_a_real_scontrol(slurm_env):
    m = Membership("slurm", Peer("gpu02", 7480), env=slurm_env, local_names=NOT_ME)
    m.load()
    assert m.all() == [Peer("gpu01", 7480), Peer("gpu03", 7480), Peer("gpu04", 7480)]
    assert await m.reload() is False


async def test_slurm_command_that_fails_keeps_the_list_with_one_warning(slurm_env, caplog):
    caplog.set_level(logging.WARNING, logger="tierfs.peers.members")
    m = Membership("slurm", ME, env=slurm_env, local_names=NOT_ME)
    m.load()
    assert len(m.all()) == 4
    m._source.argv[-1] = "gpu[05-01]"  # scontrol cannot expand it (and exits 0)
    assert await m.reload() is False
    assert await m.reload() is False
    assert len(m.all()) == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "listed no nodes: Invalid hostlist" in warnings[0].getMessage()


def test_slurm_without_its_command_is_one_line_error():
    env = {"PATH": "/nonexistent", "SLURM_JOB_NODELIST": "gpu01"}
    with pytest.raises(UsageError, match="scontrol is not installed"):
        Membership("slurm", ME, env=env).load()
