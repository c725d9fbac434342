"""U5: what an install puts in the venv. pyproject.toml files keep floors, raised past known
fixes (h11 0.16: request smuggling, CVE-2025-43859); constraints.txt pins the exact
versions, and scripts/install.sh and the CSI image install through it.

Before: `h11>=0.14` admitted the vulnerable releases and nothing pinned an install."""

from __future__ import annotations

import pathlib
import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECTS = [ROOT / "pyproject.toml", ROOT / "csi" / "pyproject.toml"]
FLOORS = {"h11": "0.16", "urllib3": "2.6", "pillow": "11.3", "setuptools": "78.1.1"}


def _requirements(path: pathlib.Path) -> list[Requirement]:
    data = tomllib.loads(path.read_text())
    names = data["build-system"]["requires"] + data["project"]["dependencies"]
    for extra in data["project"].get("optional-dependencies", {}).values():
        names += extra
    return [Requirement(n) for n in names]


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line.strip())
            assert m, f"constraints.txt: not name==version: {line!r}"
            pins[canonicalize_name(m[1])] = Version(m[2])
    return pins


def test_floors_are_past_the_known_fixes():
    reqs = {canonicalize_name(r.name): r for p in PYPROJECTS for r in _requirements(p)}
    for name, fixed in FLOORS.items():
        spec = reqs[name].specifier
        assert spec, name
        # no version below the fix is admitted, the fix itself is
        assert Version(fixed) in spec, (name, spec)
        below = Version(fixed).release[:-1] + (Version(fixed).release[-1] - 1,)
        assert Version(".".join(map(str, below))) not in spec, (name, spec)


def test_every_runtime_and_test_dependency_is_pinned_within_its_floor():
    pins = _pins()
    for path in PYPROJECTS:
        data = tomllib.loads(path.read_text())
        runtime = [Requirement(n) for n in data["project"]["dependencies"]]
        for extra in data["project"].get("optional-dependencies", {}).values():
            runtime += [Requirement(n) for n in extra]
        for req in runtime:
            name = canonicalize_name(req.name)
            if name in ("tierfs",):
                continue  # this checkout, installed editable
            assert name in pins, f"{path.name}: {req} is not in constraints.txt"
            assert pins[name] in req.specifier, f"{req} vs constraints.txt {pins[name]}"
    assert pins["h11"] >= Version("0.16")


def test_install_and_image_install_through_the_constraints():
    script = (ROOT / "scripts" / "install.sh").read_text()
    installs = re.findall(r'"\$VENV/bin/pip" install[^|]*', script)
    assert len(installs) == 2 and all('-c "$CONSTRAINTS"' in i for i in installs), installs
    assert 'CONSTRAINTS=$ROOT/constraints.txt' in script
    assert '"$CONSTRAINTS" -nt "$STAMP"' in script  # a changed pin is installed by the next run
    docker = (ROOT / "csi" / "Dockerfile").read_text()
    assert "-c /src/constraints.txt" in docker and "constraints.txt /src/" in docker
