"""bench/report_run.py's bad options: one error line and exit 2, before it starts anything
(no RGW, no mount: these run in a second)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "report_run.py")


@pytest.mark.parametrize("args, why", [
    (["--epochs", "0"], "--epochs must be 1 - 50"),
    (["--epochs", "many"], "invalid int value"),
    (["--step-ms", "-5"], "--step-ms must be 0 - 10000"),
    (["--no-such-option"], "unrecognized arguments"),
])
def test_a_bad_option_is_one_line(args, why):
    r = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and why in lines[0], r.stderr
    assert r.stdout == ""
