"""tierfs@.service and tierfs-warm@.service under a real systemd (PID 1 in systemd-nspawn)
against the tests' Ceph RGW: active only once the mount answers, stop uploads what is
pending and unmounts (also a mount still in use), Restart=on-failure brings a killed
daemon back, a bad configuration fails with one line in the journal, and the warm unit
warms a manifest."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from rgw import start_rgw

pytestmark = pytest.mark.mount


def wait_for(predicate, what: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_active_only_once_the_mount_answers(machine, mount_config, rgw, bucket):
    rgw.client().put_object(Bucket=bucket, Key="dir/hello.txt", Body=b"hello from s3\n")
    name = mount_config()
    unit = f"tierfs@{name}.service"
    machine.run("systemctl", "start", unit)  # Type=notify: returns after READY=1
    # no waiting: the unit is active, so the mount answers now
    assert machine.run("cat", f"/mnt/{name}/dir/hello.txt").stdout == "hello from s3\n"
    shown = machine.run("systemctl", "show", unit).stdout
    assert rgw.secret_key not in shown and rgw.access_key not in shown
    props = machine.show(unit, "ActiveState", "SubState", "StatusText", "Type", "Before",
                         "After", "Wants")
    assert props["ActiveState"] == "active" and props["SubState"] == "running"
    assert "slurmd.service" in props["Before"].split()  # jobs start only after the mount
    assert "network-online.target" in props["After"].split()
    assert "network-online.target" in props["Wants"].split()
    assert props["Type"] == "notify"
    assert props["StatusText"] == f"mounted s3://{bucket}/ on /mnt/{name}"
    # the journal has its own time stamps: the lines carry none
    assert f"INFO tierfs: mounted s3://{bucket}/ on /mnt/{name}" in machine.journal(unit).splitlines()
    machine.run("systemctl", "stop", unit)


def test_credentials_from_an_environment_file(machine, mount_config, rgw, bucket):
    # no NAME.credentials: LoadCredential= falls back to the empty profile of
    # SetCredential=, and botocore takes the keys from NAME.env
    rgw.client().put_object(Bucket=bucket, Key="k.txt", Body=b"via env\n")
    name = mount_config(credentials="env")
    unit = f"tierfs@{name}.service"
    assert not (machine.etc / f"{name}.credentials").exists()
    machine.run("systemctl", "start", unit)
    assert machine.run("cat", f"/mnt/{name}/k.txt").stdout == "via env\n"
    # the keys are nowhere systemd shows them
    shown = machine.run("systemctl", "show", unit).stdout
    assert rgw.secret_key not in shown and rgw.access_key not in shown
    machine.run("systemctl", "stop", unit)


def test_stop_uploads_pending_files_then_unmounts(machine, mount_config, rgw, bucket):
    name = mount_config(writeback="true")
    unit = f"tierfs@{name}.service"
    machine.run("systemctl", "start", unit)
    data = os.urandom(24 << 20)  # several chunks: a multipart upload
    # with writeback, close() returns before the upload: the stop has to finish it
    machine.run("sh", "-c", f"cat > /mnt/{name}/checkpoint.bin", input=data)
    machine.run("systemctl", "stop", unit)
    assert not machine.mounted(f"/mnt/{name}")
    props = machine.show(unit, "ActiveState", "Result", "ExecMainStatus")
    assert props == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}
    body = rgw.client().get_object(Bucket=bucket, Key="checkpoint.bin")["Body"].read()
    assert body == data
    journal = machine.journal(unit)
    assert "signal SIGTERM: unmounting" in journal and f"unmounted /mnt/{name}" in journal
    assert "Traceback" not in journal and "unsaved files remain" not in journal
    # the ExecStopPost= cleanup found nothing to do and said nothing
    assert "tierfs: error" not in journal


def test_stop_unmounts_a_mount_still_in_use(machine, mount_config):
    # a job that outlives the order (its cwd in the mount) must not keep the mount or
    # make the stop fail: the daemon detaches it (lazily) and exits 0
    name = mount_config()
    unit, holder = f"tierfs@{name}.service", f"holder-{name}.service"
    machine.run("systemctl", "start", unit)
    machine.run("systemd-run", f"--unit={holder}", "sh", "-c", f"cd /mnt/{name} && exec sleep 600")
    try:
        def holding():
            pid = machine.show(holder, "MainPID")["MainPID"]
            cwd = machine.run("readlink", f"/proc/{pid}/cwd", check=False).stdout.strip()
            return pid != "0" and cwd == f"/mnt/{name}"

        wait_for(holding, "the holder to sit in the mount")
        machine.run("systemctl", "stop", unit)
        assert not machine.mounted(f"/mnt/{name}")
        props = machine.show(unit, "ActiveState", "Result", "ExecMainStatus")
        assert props == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}
    finally:
        machine.run("systemctl", "stop", holder, check=False)


def test_stop_is_bounded_when_uploads_cannot_finish(machine, mount_config):
    # the object store hangs with a file still to upload: the stop waits drain_timeout
    # (and the request under way), keeps the file journaled for the next mount, and ends
    # cleanly, though that takes longer than the unit's own stop timeout
    own = start_rgw(memstore_bytes=256 << 20)  # this test freezes and stops its own RGW
    name = None
    try:
        own.client().create_bucket(Bucket="drain")
        name = mount_config(server=own, bucket_name="drain", writeback="true",
                            drain_timeout='"3s"', backend_timeout='"2s"', backend_retries=1)
        unit = f"tierfs@{name}.service"
        # a stop timeout shorter than the drain: the daemon must extend it itself
        # (EXTEND_TIMEOUT_USEC), or systemd kills it half-way (Result=timeout)
        dropin = f"/run/systemd/system/{unit}.d"
        machine.run("mkdir", "-p", dropin)
        machine.run("sh", "-c", f"printf '[Service]\\nTimeoutStopSec=1s\\n' > {dropin}/t.conf")
        machine.run("systemctl", "daemon-reload")
        assert machine.show(unit, "TimeoutStopUSec")["TimeoutStopUSec"] == "1s"
        machine.run("systemctl", "start", unit)
        machine.run("ls", f"/mnt/{name}")  # listed: creating a file needs no request then
        # frozen, not gone: the upload's request hangs instead of failing at once
        pids = [int(line.split()[1]) for line in Path(own.dir, "pids").read_text().splitlines()]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            machine.run("sh", "-c", f"echo unsaved > /mnt/{name}/late.txt")
            machine.run("systemctl", "stop", unit)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        assert not machine.mounted(f"/mnt/{name}")
        props = machine.show(unit, "ActiveState", "Result", "ExecMainStatus")
        assert props == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}
        journal = machine.journal(unit)
        assert "unsaved files remain" in journal and "Traceback" not in journal
        staged = list((machine.cache / name / "dirty").iterdir())
        assert [p.read_bytes() for p in staged if p.stat().st_size] == [b"unsaved\n"]
    finally:
        own.stop()
        if name:
            machine.run("rm", "-rf", f"/run/systemd/system/tierfs@{name}.service.d")
            machine.run("systemctl", "daemon-reload")


def test_restart_on_failure_after_sigkill(machine, mount_config, rgw, bucket):
    rgw.client().put_object(Bucket=bucket, Key="a.txt", Body=b"still here\n")
    name = mount_config()
    unit = f"tierfs@{name}.service"
    machine.run("systemctl", "start", unit)
    first = machine.show(unit, "MainPID")["MainPID"]
    machine.run("kill", "-KILL", first)

    def restarted():
        p = machine.show(unit, "MainPID", "ActiveState", "SubState", "NRestarts")
        return p if (p["MainPID"] not in ("0", first) and p["ActiveState"] == "active"
                     and p["SubState"] == "running") else None

    props = wait_for(restarted, f"{unit} to be restarted")
    assert props["NRestarts"] == "1"
    # the dead mount was detached (ExecStopPost=) and the new daemon mounted again
    assert machine.run("cat", f"/mnt/{name}/a.txt").stdout == "still here\n"
    machine.run("systemctl", "stop", unit)
    assert not machine.mounted(f"/mnt/{name}")
    assert machine.show(unit, "Result")["Result"] == "success"


def test_bad_configuration_fails_with_one_journal_line(machine, mount_config):
    name = mount_config(cache_size='"lots"')
    unit = f"tierfs@{name}.service"
    r = machine.run("systemctl", "start", unit, check=False)
    assert r.returncode != 0
    journal = machine.journal(unit)
    assert (f"tierfs: error: /etc/tierfs/{name}.toml: invalid cache-size 'lots'"
            in journal), journal
    assert "Traceback" not in journal
    machine.run("systemctl", "stop", unit)  # cancels the pending restart
    assert not machine.mounted(f"/mnt/{name}")


def test_warm_unit_warms_the_manifest(machine, mount_config, rgw, bucket):
    client = rgw.client()
    blobs = {f"train/part-{i}.bin": os.urandom(3 << 20) for i in range(3)}
    for key, body in blobs.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)
    client.put_object(Bucket=bucket, Key="other/skip.bin", Body=b"x" * 1000)
    name = mount_config()
    (machine.etc / f"{name}.warm").write_text(f"# what jobs read\n/mnt/{name}/train\n")
    warm = f"tierfs-warm@{name}.service"
    # Requires= + After=: starting the warm unit starts the mount first
    machine.run("systemctl", "start", warm)
    assert machine.show(f"tierfs@{name}.service", "ActiveState")["ActiveState"] == "active"
    props = machine.show(warm, "Result", "ExecMainStatus")
    assert props == {"Result": "success", "ExecMainStatus": "0"}
    check = machine.run("/usr/local/bin/tierfs", "warm", "--check", f"/mnt/{name}/train",
                        check=False)
    assert check.returncode == 0, check.stdout + check.stderr  # exit 3 if not all cached
    assert "3 files" in machine.journal(warm)
    machine.run("systemctl", "stop", f"tierfs@{name}.service")
