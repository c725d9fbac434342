"""Offline checks of systemd/*.service and *.timer: `systemd-analyze verify` must print
nothing at all (it reports unknown keys and bad values as warnings with exit status 0),
and `systemctl --root enable` must accept the [Install] sections.

verify checks that every Exec*= binary exists, so it runs on instance copies whose
/usr/local/bin/tierfs is replaced by this checkout's installed tierfs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "systemd"
TEMPLATES = ["tierfs@.service", "tierfs-warm@.service"]
GC_UNITS = ["tierfs-gc.service", "tierfs-gc.timer"]  # not templates: one per node
INSTALLED = "/usr/local/bin/tierfs"  # where docs/operations.md installs the command
TIERFS = Path(sys.executable).with_name("tierfs")

def instance_copies(dest: Path, instance: str = "test", edit=lambda text: text) -> list[Path]:
    out = []
    for name in TEMPLATES + GC_UNITS:
        text = (UNITS / name).read_text().replace(INSTALLED, str(TIERFS))
        path = dest / name.replace("@.", f"@{instance}.")
        path.write_text(edit(text))
        out.append(path)
    return out


def verify(paths: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, paths)],
                          capture_output=True, text=True, timeout=120)


def test_units_use_the_documented_binary():
    for name in TEMPLATES + ["tierfs-gc.service"]:
        text = (UNITS / name).read_text()
        assert f"ExecStart={INSTALLED} " in text, name
    assert TIERFS.exists(), f"{TIERFS}: the checkout's tierfs is not installed"


def test_verify_prints_nothing(tmp_path):
    r = verify(instance_copies(tmp_path))
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


@pytest.mark.parametrize("mistake", [
    ("\nRestart=on-failure", "\nRestart=sometimes"),
    ("\nExecStart=", "\nExecStrat="),
    ("\nKillMode=mixed", "\nKillMode=gently"),
])
def test_verify_would_catch_a_mistake(tmp_path, mistake):
    # the check above is only worth something if a broken unit makes output
    old, new = mistake
    assert old in (UNITS / TEMPLATES[0]).read_text()
    r = verify(instance_copies(tmp_path, edit=lambda t: t.replace(old, new, 1)))
    assert r.stdout + r.stderr != ""


def test_enable_with_root_creates_the_wants_links(tmp_path):
    system = tmp_path / "etc/systemd/system"
    system.mkdir(parents=True)
    for name in TEMPLATES + GC_UNITS:
        shutil.copy(UNITS / name, system / name)
    r = subprocess.run(["systemctl", f"--root={tmp_path}", "enable",
                        "tierfs@datasets.service", "tierfs-warm@datasets.service",
                        "tierfs-gc.timer"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    wants = system / "multi-user.target.wants"
    for name in TEMPLATES:
        link = wants / name.replace("@.", "@datasets.")
        assert link.is_symlink() and link.readlink() == Path("/etc/systemd/system") / name
    timer = system / "timers.target.wants" / "tierfs-gc.timer"
    assert timer.is_symlink() and timer.readlink() == Path("/etc/systemd/system/tierfs-gc.timer")


def test_example_config_is_valid():
    from tierfs.config import build_config_with_file

    cfg = build_config_with_file(str(UNITS / "example.toml"), None, None, {})
    assert cfg.mountpoint == "/mnt/datasets" and cfg.allow_other and cfg.writeback


def test_units_create_private_files():
    # V1 of issue 10: cache files, index and log must not be readable by other users
    for unit in ("tierfs@.service", "tierfs-warm@.service", "tierfs-gc.service"):
        lines = (UNITS / unit).read_text().splitlines()
        assert "UMask=0077" in lines, unit
