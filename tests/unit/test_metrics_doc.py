"""docs/metrics.md against the live registry (issue 15 item 7): the table names every
metric tierfs/metrics.py registers, with its type and label names, and nothing else; the
backend op vocabulary it documents is the one the backend runner labels requests with."""

from __future__ import annotations

import ast
import pathlib
import re

from metricskit import MetricDef, registry_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
RUNNER = ROOT / "tierfs" / "backend" / "runner.py"


def _documented() -> dict[str, tuple[MetricDef, str]]:
    """{name: (its row as a MetricDef, the labels column)} of the doc's metrics table."""
    out = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| `(tierfs_\w+)` \| (\w+) \|([^|]*)\|", line)
        if m:
            name, kind, labels = m.groups()
            assert name not in out, f"{name} has two rows"
            # label names are in backticks, their values are not
            out[name] = (MetricDef(name, kind, frozenset(re.findall(r"`(\w+)`", labels))),
                         labels)
    return out


def _ops_of_runner() -> set[str]:
    """The op labels tierfs/backend/runner.py passes to AsyncBackend._call."""
    ops = set()
    for node in ast.walk(ast.parse(RUNNER.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "_call" and node.args
                and isinstance(node.args[0], ast.Constant)):
            ops.add(node.args[0].value)
    return ops


def test_every_registered_metric_is_documented_and_nothing_else():
    documented, live = _documented(), registry_metrics()
    assert len(documented) > 20  # the table was found
    undocumented = sorted(live.keys() - documented.keys())
    assert undocumented == [], f"registered but not in docs/metrics.md: {undocumented}"
    unknown = sorted(documented.keys() - live.keys())
    assert unknown == [], f"in docs/metrics.md but not registered: {unknown}"


def test_types_and_label_names_match_the_registry():
    documented, live = _documented(), registry_metrics()
    wrong = [f"{name}: doc says {doc.type} {sorted(doc.labels)}, "
             f"registry has {live[name].type} {sorted(live[name].labels)}"
             for name, (doc, _) in sorted(documented.items())
             if name in live and doc != live[name]]
    assert wrong == []


def test_the_backend_ops_documented_are_the_ops_the_runner_counts():
    ops = _ops_of_runner()
    assert {"get", "list", "put", "mpu_create", "upload_part", "mpu_complete"} <= ops
    for name in ("tierfs_backend_requests_total",):
        labels = _documented()[name][1]
        listed = set(re.split(r",\s*", labels.split("=", 1)[1].strip()))
        assert listed == ops, name
