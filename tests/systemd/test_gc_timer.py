"""U2: tierfs-gc.timer and tierfs-gc.service under a real systemd (PID 1 in systemd-nspawn).

Before: nothing ran `tierfs gc`, and on a node that never mounted it exited 2 ("cache
root ... No such file"). Now the timer is enabled like any timer, the service removes an
unused cache dir and keeps a recent one, and a missing cache root is a success."""

from __future__ import annotations

import os
import time

SERVICE, TIMER = "tierfs-gc.service", "tierfs-gc.timer"


def _cache_dir(path, idle_days: float) -> None:
    path.mkdir()
    (path / "lock").write_text("")  # what a mount creates first: this is a cache dir
    (path / "chunks").mkdir()
    (path / "chunks" / "c0").write_bytes(b"x" * 4096)
    then = time.time() - idle_days * 86400
    for p in (path / "chunks" / "c0", path / "chunks", path / "lock", path):
        os.utime(p, (then, then))


def test_timer_runs_gc_daily_and_gc_collects_what_nobody_uses(machine):
    machine.run("systemctl", "enable", "--now", TIMER)
    try:
        props = machine.show(TIMER, "ActiveState", "UnitFileState", "TimersCalendar")
        assert props["ActiveState"] == "active" and props["UnitFileState"] == "enabled"
        assert "OnCalendar=*-*-* 00:00:00" in props["TimersCalendar"], props  # daily
        assert "timers.target" in machine.show(TIMER, "WantedBy")["WantedBy"]

        old, recent = machine.cache / "gc-old", machine.cache / "gc-recent"
        _cache_dir(old, idle_days=30)
        _cache_dir(recent, idle_days=1)
        machine.run("systemctl", "start", SERVICE)  # oneshot: returns when it is done
        assert machine.show(SERVICE, "Result", "ExecMainStatus") == \
            {"Result": "success", "ExecMainStatus": "0"}
        assert not old.exists() and (recent / "chunks" / "c0").exists()
        journal = machine.journal(SERVICE)
        assert "/var/cache/tierfs/gc-old" in journal and "total: freed" in journal, journal

        # a node that never mounted: no cache root at all
        env = machine.etc / "gc.env"
        env.write_text("TIERFS_GC_ARGS=--cache-root /var/cache/tierfs-never-mounted\n")
        try:
            machine.run("systemctl", "start", SERVICE)
            assert machine.show(SERVICE, "Result", "ExecMainStatus") == \
                {"Result": "success", "ExecMainStatus": "0"}
            assert "nothing to collect: cache root /var/cache/tierfs-never-mounted does " \
                   "not exist" in machine.journal(SERVICE)
        finally:
            env.unlink()
    finally:
        machine.run("systemctl", "disable", "--now", TIMER, check=False)
        for d in ("gc-old", "gc-recent"):
            machine.run("rm", "-rf", f"/var/cache/tierfs/{d}", check=False)
