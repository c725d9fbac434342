"""Identity, capabilities and the command line of tierfs-csi (no volume needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from csikit import DRIVER, Plugin, pb


def test_identity_and_capabilities(plugin):
    info = plugin.identity.GetPluginInfo(pb.GetPluginInfoRequest())
    assert info.name == DRIVER and info.vendor_version
    caps = plugin.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest())
    assert list(caps.capabilities) == []  # node only: no CONTROLLER_SERVICE
    probe = plugin.identity.Probe(pb.ProbeRequest())
    assert probe.HasField("ready") and probe.ready.value is True

    node = plugin.node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest())
    rpc = pb.NodeServiceCapability.RPC
    assert {c.rpc.type for c in node.capabilities} == {rpc.STAGE_UNSTAGE_VOLUME,
                                                       rpc.GET_VOLUME_STATS}
    assert plugin.node.NodeGetInfo(pb.NodeGetInfoRequest()).node_id == "node-1"

    ctrl = plugin.controller.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest())
    assert [c.rpc.type for c in ctrl.capabilities] == [
        pb.ControllerServiceCapability.RPC.UNKNOWN]


def test_probe_reports_not_ready_when_tierfs_cannot_run(csi_root):
    # no fusermount3 on PATH: tierfs could not mount or unmount anything
    env = dict(os.environ, PATH="/nonexistent")
    p = Plugin(csi_root, env=env).start()
    try:
        probe = p.identity.Probe(pb.ProbeRequest())
        assert probe.ready.value is False
        p.identity.Probe(pb.ProbeRequest())
    finally:
        p.stop()
    log = p.log_text()
    assert log.count("not ready: fusermount3 is not on PATH") == 1  # polled: logged once


@pytest.mark.parametrize("args,message", [
    ([], "the following arguments are required: --endpoint, --node-id"),
    (["--endpoint", "unix:///tmp/x.sock"], "--node-id"),
    (["--endpoint", "tcp://127.0.0.1:9000", "--node-id", "n"], "only unix:///PATH"),
    (["--endpoint", "unix://relative.sock", "--node-id", "n"], "ABSOLUTE"),
    (["--endpoint", "unix:///tmp/x.sock", "--node-id", " "], "--node-id must not be empty"),
    (["--endpoint", "unix:///tmp/x.sock", "--node-id", "n", "--mount-timeout", "soon"],
     "invalid float value"),
    (["--endpoint", "unix:///tmp/x.sock", "--node-id", "n", "--bogus"], "--bogus"),
])
def test_bad_flags_give_one_line_and_exit_2(args, message):
    r = subprocess.run([sys.executable, "-m", "tierfs_csi", *args], capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierfs-csi: error: "), r.stderr
    assert message in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_unusable_socket_dir_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = subprocess.run([sys.executable, "-m", "tierfs_csi", "--endpoint",
                        f"unix://{blocker}/csi.sock", "--node-id", "n",
                        "--state-dir", str(tmp_path / "state")],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("tierfs-csi: error: ")
    assert "Traceback" not in r.stderr


def test_second_plugin_on_the_same_state_dir_waits_for_the_first(plugin, csi_root):
    second = Plugin(csi_root)
    second.socket = csi_root / "plugin2" / "csi.sock"
    second.log_path = csi_root / "plugin2.log"
    with open(second.log_path, "wb") as log:
        proc = subprocess.Popen(second.argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while "waiting for it to exit" not in second.log_text():
            assert proc.poll() is None and time.monotonic() < deadline, second.log_text()
            time.sleep(0.05)
        assert not second.socket.exists()  # not serving beside the first
        plugin.stop()
        while "serving on" not in second.log_text():
            assert proc.poll() is None and time.monotonic() < deadline + 30, second.log_text()
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(os.path.exists("/run/systemd/private"), reason="this host runs systemd")
def test_probe_with_systemd_scopes_and_no_systemd_is_not_ready(csi_root):
    p = Plugin(csi_root, extra_args=["--systemd-scopes"]).start()
    try:
        assert p.identity.Probe(pb.ProbeRequest()).ready.value is False
    finally:
        p.stop()
    assert "not ready: --systemd-scopes: no systemd at /run/systemd/private" in p.log_text()
