"""Who reads (tierfs/telemetry/callers.py): /proc/PID/cgroup texts of Slurm and Kubernetes, both
cgroup layouts, as the kernel writes them; the slurmstepd ancestor of a Slurm without
cgroup plugins; the per-pid cache. The process trees are real directories laid out as
/proc is (the `proc` seam), or this machine's own /proc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tierfs.telemetry.callers import Callers, reader_of, stepd_job

from unitkit import FakeClock

POD = "0b6b9c3e-5c1a-4f0e-9d2b-1a2b3c4d5e6f"
POD_ = POD.replace("-", "_")
CTR = "4f1c0a2b" * 8

V1_HEADER = ("12:hugetlb:/\n11:rdma:/\n10:net_cls,net_prio:/\n9:perf_event:/\n")

CASES = [
    # Slurm, cgroup v2 (cgroup/v2 plugin, slurmd under systemd)
    ("0::/system.slice/slurmstepd.scope/job_1234/step_0/user/task_0\n", "job:1234"),
    ("0::/system.slice/slurmstepd.scope/job_77/step_batch/user/task_0\n", "job:77"),
    ("0::/system.slice/slurmstepd.scope/job_77/step_extern/slurm_processes\n", "job:77"),
    # several slurmd on one host: the scope carries the node name
    ("0::/system.slice/slurmstepd_node-a01.scope/job_5/step_0/user/task_1\n", "job:5"),
    ("0::/system.slice/slurm_node7.scope/job_6/step_0/user/task_0\n", "job:6"),
    # Slurm, cgroup v1 (cgroup/v1 plugin): every controller names the job
    (V1_HEADER + "8:freezer:/slurm/uid_1000/job_1234/step_0\n"
     "4:memory:/slurm/uid_1000/job_1234/step_0/task_0\n"
     "1:name=systemd:/system.slice/slurmd.service\n0::/system.slice/slurmd.service\n",
     "job:1234"),
    ("4:memory:/slurm_node7/uid_1000/job_99/step_batch/task_0\n", "job:99"),
    # Kubernetes, cgroup v1, cgroupfs driver: burstable, besteffort, guaranteed
    (V1_HEADER + f"4:memory:/kubepods/burstable/pod{POD}/{CTR}\n"
     f"1:name=systemd:/kubepods/burstable/pod{POD}/{CTR}\n", f"pod:{POD}"),
    (f"4:memory:/kubepods/besteffort/pod{POD}/{CTR}\n", f"pod:{POD}"),
    (f"4:memory:/kubepods/pod{POD}/{CTR}\n", f"pod:{POD}"),
    # Kubernetes, cgroup v1, systemd driver (docker)
    (f"4:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice/"
     f"docker-{CTR}.scope\n", f"pod:{POD}"),
    # Kubernetes, cgroup v2, systemd driver: the UID's dashes are underscores
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice/"
     f"cri-containerd-{CTR}.scope\n", f"pod:{POD}"),
    (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/"
     f"cri-containerd-{CTR}.scope\n", f"pod:{POD}"),
    (f"0::/kubepods.slice/kubepods-pod{POD_}.slice/cri-containerd-{CTR}.scope\n", f"pod:{POD}"),
    # Kubernetes, cgroup v2, cgroupfs driver; and a kind node (kubelet in a container)
    (f"0::/kubepods/burstable/pod{POD}/{CTR}\n", f"pod:{POD}"),
    (f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/"
     f"kubelet-kubepods-burstable-pod{POD_}.slice/cri-containerd-{CTR}.scope\n", f"pod:{POD}"),
    # neither: the uid
    ("0::/user.slice/user-1000.slice/session-3.scope\n", "uid:1000"),
    (V1_HEADER + "4:memory:/process_api/0163a32f\n0::/\n", "uid:1000"),
    ("0::/system.slice/slurmd.service\n", "uid:1000"),  # slurmd itself is no job
    ("0::/system.slice/cron.service/job_12\n", "uid:1000"),  # job_N outside Slurm's tree
    ("", "uid:1000"),
    ("garbage\n\x00\x01:::\n", "uid:1000"),
    # a user's delegated subtree can be named anything by its owner: not trusted
    ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/slurmstepd.scope/job_1/"
     "step_0\n", "uid:1000"),
    (f"0::/user.slice/user-1000.slice/user@1000.service/kubepods/burstable/pod{POD}/x\n",
     "uid:1000"),
]


@pytest.mark.parametrize("text, want", CASES)
def test_reader_of_cgroup_texts(text, want):
    assert reader_of(text, 1000) == want


def test_stepd_command_lines():
    assert stepd_job(b"slurmstepd: [1234.0]\x00") == "job:1234"
    assert stepd_job(b"slurmstepd: [1234.batch]") == "job:1234"
    assert stepd_job(b"slurmstepd: [1234.extern]") == "job:1234"
    assert stepd_job(b"slurmstepd: [1234.4294967292]") == "job:1234"
    assert stepd_job(b"slurmstepd\x00") is None
    assert stepd_job(b"bash\x00-c\x00slurmstepd: [1.0]") is None
    assert stepd_job(b"") is None


def fake_proc(root, pid: int, *, name: str, ppid: int, uid: int, cgroup: str = "0::/\n",
              cmdline: bytes = b"") -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "status").write_text(f"Name:\t{name}\nUmask:\t0022\nState:\tS (sleeping)\n"
                              f"Tgid:\t{pid}\nPid:\t{pid}\nPPid:\t{ppid}\nTracerPid:\t0\n"
                              f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t0\t0\t0\t0\n")
    (d / "cgroup").write_text(cgroup)
    (d / "cmdline").write_bytes(cmdline)


def test_slurm_without_cgroups_is_found_by_its_slurmstepd(tmp_path):
    fake_proc(tmp_path, 1, name="systemd", ppid=0, uid=0)
    fake_proc(tmp_path, 50, name="slurmd", ppid=1, uid=0)
    fake_proc(tmp_path, 60, name="slurmstepd", ppid=1, uid=0,
              cmdline=b"slurmstepd: [4321.batch]\x00")
    fake_proc(tmp_path, 61, name="bash", ppid=60, uid=65534)
    fake_proc(tmp_path, 62, name="python3", ppid=61, uid=65534)
    fake_proc(tmp_path, 70, name="bash", ppid=1, uid=65534)
    # a user's own process named slurmstepd, with a command line to match, is no job's
    fake_proc(tmp_path, 80, name="slurmstepd", ppid=70, uid=65534,
              cmdline=b"slurmstepd: [9999.0]\x00")
    fake_proc(tmp_path, 81, name="cat", ppid=80, uid=65534)
    callers = Callers(proc=str(tmp_path))
    assert callers.reader(62, 65534) == "job:4321"
    assert callers.reader(61, 65534) == "job:4321"
    assert callers.reader(70, 65534) == "uid:65534"
    assert callers.reader(81, 65534) == "uid:65534"


def test_a_cgroup_wins_over_the_process_tree(tmp_path):
    fake_proc(tmp_path, 60, name="slurmstepd", ppid=1, uid=0, cmdline=b"slurmstepd: [1.0]")
    fake_proc(tmp_path, 61, name="sh", ppid=60, uid=5,
              cgroup="0::/system.slice/slurmstepd.scope/job_2/step_0/user/task_0\n")
    assert Callers(proc=str(tmp_path)).reader(61, 5) == "job:2"


def test_a_loop_in_the_process_tree_ends(tmp_path):
    fake_proc(tmp_path, 10, name="a", ppid=11, uid=5)
    fake_proc(tmp_path, 11, name="b", ppid=10, uid=5)
    assert Callers(proc=str(tmp_path)).reader(10, 5) == "uid:5"


def test_unreadable_or_garbage_proc_files_answer_the_uid(tmp_path):
    d = tmp_path / "40"
    d.mkdir()
    (d / "cgroup").write_bytes(b"\xff\xfe\x00garbage")
    (d / "status").write_bytes(b"Name:\tx\nPPid:\tnot-a-number\n")
    assert Callers(proc=str(tmp_path)).reader(40, 7) == "uid:7"


def test_answers_are_cached_per_pid_until_the_ttl(tmp_path):
    clock = FakeClock()
    callers = Callers(ttl_s=30, clock=clock, proc=str(tmp_path))
    fake_proc(tmp_path, 100, name="x", ppid=1, uid=5,
              cgroup="0::/system.slice/slurmstepd.scope/job_1/step_0\n")
    assert callers.reader(100, 5) == "job:1"
    # the pid is reused by another process: the cached answer stands until the TTL
    (tmp_path / "100" / "cgroup").write_text(f"0::/kubepods/pod{POD}/c\n")
    clock.advance(29)
    assert callers.reader(100, 5) == "job:1"
    clock.advance(2)
    assert callers.reader(100, 5) == f"pod:{POD}"


def test_the_cache_is_bounded_least_recently_used_first(tmp_path):
    for pid in (1001, 1002, 1003):
        fake_proc(tmp_path, pid, name="x", ppid=1, uid=5,
                  cgroup=f"0::/system.slice/slurmstepd.scope/job_{pid}/step_0\n")
    callers = Callers(max_pids=2, proc=str(tmp_path))
    assert [callers.reader(p, 5) for p in (1001, 1002)] == ["job:1001", "job:1002"]
    callers.reader(1001, 5)  # 1001 used again: 1002 is the least recently used
    callers.reader(1003, 5)
    for pid in (1001, 1002, 1003):  # each answer now comes from /proc again, or the cache
        (tmp_path / str(pid) / "cgroup").write_text("0::/\n")
    assert callers.reader(1001, 5) == "job:1001"  # cached
    assert callers.reader(1003, 5) == "job:1003"  # cached
    assert callers.reader(1002, 5) == "uid:5"  # was dropped, read again
    assert len(callers._cache) == 2


def test_this_machine_real_processes():
    callers = Callers()
    me = callers.reader(os.getpid(), os.getuid())
    with open(f"/proc/{os.getpid()}/cgroup") as f:
        assert me == reader_of(f.read(), os.getuid())
    # a pid that is gone (a child that exited and was reaped): its uid, no error
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    gone = int(child.stdout)
    if not os.path.exists(f"/proc/{gone}"):  # not reused meanwhile
        assert callers.reader(gone, 4242) == "uid:4242"
    assert callers.reader(0, 4242) == "uid:4242"  # a request the kernel made itself
