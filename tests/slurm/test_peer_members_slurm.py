"""`--peers slurm` against the real single-node cluster: outside a job the peers are the
cluster's responding nodes (`sinfo -h -N -r -o %N`), inside one the job's nodes
(`scontrol show hostnames $SLURM_JOB_NODELIST`), each at this node's peer port; this
node is recognised by its hostname and left out."""

from __future__ import annotations

from tierfs.peers.members import Membership, Peer

PORT = 7480


def _env(slurm, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in slurm.env.items() if not k.startswith("SLURM_JOB")}
    return {**env, **extra}


async def test_outside_a_job_the_peers_are_the_clusters_nodes(slurm):
    m = Membership("slurm", Peer("10.9.9.9", PORT), env=_env(slurm), local_names={"elsewhere"})
    m.load()
    assert m.all() == [Peer(slurm.host, PORT)]
    assert await m.reload() is False  # asked again (trio.run_process): the same node
    assert m.all() == [Peer(slurm.host, PORT)]
    # on the node itself, its own name is this node, not a peer
    me = Membership("slurm", Peer("10.9.9.9", PORT), env=_env(slurm),
                    local_names={slurm.host})
    me.load()
    assert me.all() == [] and me.owner(b"any chunk") is None


async def test_inside_a_job_the_peers_are_the_jobs_nodes(slurm):
    env = _env(slurm, SLURM_JOB_NODELIST=f"{slurm.host},gpu[01-02]")
    m = Membership("slurm", Peer("10.9.9.9", PORT), env=env, local_names={slurm.host})
    m.load()
    assert m.all() == [Peer("gpu01", PORT), Peer("gpu02", PORT)]
    assert await m.reload() is False
