"""`tierfs report` on a real mount (RGW) after a real read workload: the JSON matches the
reads, the text report names the hot prefix, and the HTML page, rendered by headless
Chromium, shows its four plots decoded and no script error."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from helpers import payload, put_many, read_uncached

MiB = 1 << 20
HOT = {f"data/hot/{i}.bin": payload(f"hot{i}", 2 * MiB) for i in range(3)}
ONCE = {f"data/once/{i}.bin": payload(f"once{i}", MiB) for i in range(2)}
CHROMIUM = "/usr/bin/chromium"


def tierfs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierfs", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--virtual-time-budget=5000", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium (scripts/install.sh)")
def test_report_of_a_real_workload_renders_with_its_plots(rgw, bucket, tmp_path, mounts):
    put_many(rgw.client(), bucket, {**HOT, **ONCE})
    with mounts.start("--chunk-size", "1M", "--cache-size", "64M") as m:
        for _ in range(3):  # the hot set read three times (the page cache dropped each time)
            for key, data in HOT.items():
                assert read_uncached(m.path / key) == data
        for key, data in ONCE.items():
            assert read_uncached(m.path / key) == data

        r = tierfs("report", m.mountpoint, "--json")
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["hot"][0]["prefix"] == "data/hot/"
        hot = rep["hot"][0]
        assert sum(hot["read"].values()) == 3 * 6 * MiB
        assert hot["cached"] == hot["total"] == 6 * MiB  # fits: cached whole
        # 6 chunks read by 3 handles each: 2 of every 3 accesses re-read cached data
        assert hot["accesses"] == 18 and hot["reread_ratio"] == round(12 / 18, 4)
        once = next(p for p in rep["hot"] if p["prefix"] == "data/once/")
        assert sum(once["read"].values()) == 2 * MiB and once["reread_ratio"] == 0
        assert rep["metadata"]["lists"] > 0
        assert sum(rep["read"].values()) == 20 * MiB

        text = tierfs("report", m.mountpoint)
        assert text.returncode == 0 and "data/hot/" in text.stdout, text.stderr

        page = tmp_path / "report.html"
        r = tierfs("report", m.mountpoint, "--html", str(page))
        assert r.returncode == 0, r.stderr
        assert page.stat().st_size > 10_000  # four PNGs inside
    dom = chromium("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr
    # the page's self-check, filled in by the browser once everything loaded
    assert "plots decoded: 4, failed: 0, errors: 0" in dom.stdout, dom.stdout[-2000:]
    shot = tmp_path / "report.png"
    r = chromium(f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri())
    assert r.returncode == 0, r.stderr
    head = shot.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (1200, 1600)


def test_report_bad_input_is_one_line(tmp_path):
    for args, why in ((["--json", "--html", "x.html"], "--json and --html"),
                      (["--manifest"], "--manifest needs --job"),
                      (["--since", "1h"], "--job and --since go with --manifest"),
                      (["--manifest", "--job", "1", "--since", "soon"], "since"),
                      (["--top", "0"], "top"),
                      (["--cold-after", "soon"], "cold-after")):
        r = tierfs("report", *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and why in lines[0], (args, r.stderr)
