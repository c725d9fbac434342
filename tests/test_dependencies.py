"""The dependency direction of docs/architecture.md, held by the test suite.

Layers between our modules are checked by import-linter (contract in pyproject.toml);
this file also pins each third-party package to the one module allowed to import it.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PKG = pathlib.Path(__file__).resolve().parent.parent / "tierfs"

# package -> the modules (relative to tierfs/) that may import it
ALLOWED = {
    # s3get.py: GETs signed without botocore's request machinery, answered in its shapes
    "boto3": {"backend/s3.py", "backend/s3get.py"},
    "botocore": {"backend/s3.py", "backend/s3get.py"},
    "h11": {"peers/http.py"},
    # the index's environment and its probe child; fsck reads the index of a cache dir no
    # daemon holds, without MetaStore's start-up probe, migration and salvage (which would
    # change what it is asked to check)
    "lmdb": {"index/env.py", "index/probe.py", "cli/fsck.py"},
    "matplotlib": {"cli/reportpage.py"},  # imported only when a page is rendered
    "prometheus_client": {"metrics.py"},
    "pyfuse3": {"mount/fs.py", "mount/daemon.py"},
}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_third_party_packages_stay_in_their_module():
    wrong = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        for pkg, allowed in ALLOWED.items():
            if pkg in _imports(path) and rel not in allowed:
                wrong.append(f"{rel} imports {pkg}")
    assert wrong == []


def test_layers_contract_holds():
    exe = pathlib.Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(exe)], capture_output=True, text=True,
                       cwd=PKG.parent)
    assert r.returncode == 0, r.stdout + r.stderr
