"""Fixtures of the warm / control-socket tests (real mounts on the session's Ceph RGW).

  tierfs   run `python -m tierfs ARGS...` as the CLI user would: tierfs("warm", path, "--json")
           -> Result(rc, out, err, events: the JSON lines of stdout)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuse"))


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.out.splitlines() if line.startswith("{")]

    @property
    def summary(self) -> dict:
        (s,) = [e for e in self.events if e.get("event") == "summary"]
        return s


def run_tierfs(*args: str, timeout: float = 120) -> Result:
    p = subprocess.run([sys.executable, "-m", "tierfs", *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return Result(p.returncode, p.stdout, p.stderr)


@pytest.fixture
def tierfs():
    return run_tierfs
