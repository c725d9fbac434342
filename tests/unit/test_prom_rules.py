"""The Prometheus rules (docs/prometheus/) and the Grafana dashboard (docs/grafana/) hold
up: promtool checks the rules and runs their unit tests, the dashboard's queries parse,
and every metric and label they name is one tierfs exports (tests/unit/metricskit.py).

promtool comes with the Debian package prometheus (scripts/install.sh installs it): its
absence is a failure, not a skip, so CI cannot pass without running the rules' tests."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

from metricskit import registry_series

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
PROM = DOCS / "prometheus"
DASHBOARD = DOCS / "grafana" / "tierfs.json"

# series Prometheus itself adds; labels every scraped series has
PROMETHEUS_SERIES = {"up"}
TARGET_LABELS = {"job", "instance"}

_SERIES = re.compile(r"(?<![\w:$])(tierfs_[a-z0-9_]+|up)\b(\{[^}]*\})?")
_RECORDED = re.compile(r"(?<![\w:])(tierfs:[a-z0-9_:]+)")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def _promtool(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool not found: install the Debian package prometheus "
                    "(scripts/install.sh does)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def _rule_files() -> list[pathlib.Path]:
    return sorted(p for p in PROM.glob("*.yml") if "test" not in p.name)


def _test_files() -> list[pathlib.Path]:
    return sorted(PROM.glob("*test*.yml"))


def _rules() -> list[dict]:
    return [r for p in _rule_files() for g in yaml.safe_load(p.read_text())["groups"]
            for r in g["rules"]]


def _dashboard_exprs() -> list[str]:
    def walk(panels: list[dict]) -> list[str]:
        out = []
        for p in panels:
            out += [t["expr"] for t in p.get("targets", []) if t.get("expr")]
            out += walk(p.get("panels", []))
        return out
    dash = json.loads(DASHBOARD.read_text())
    return walk(dash["panels"])


def _problems(where: str, expr: str, recorded: dict[str, set[str]]) -> list[str]:
    """What in one PromQL expression names no series tierfs (or Prometheus) has: metric
    names, label names in matchers and in by/without/on/ignoring lists."""
    series = registry_series()
    out, seen_labels = [], set(TARGET_LABELS)
    for name, matchers in _SERIES.findall(expr):
        if name in PROMETHEUS_SERIES:
            continue
        if name not in series:
            out.append(f"{where}: {name} is not a series of tierfs/metrics.py")
            continue
        seen_labels |= series[name]
        for label in _MATCHER.findall(matchers):
            if label not in series[name] | TARGET_LABELS:
                out.append(f"{where}: {name} has no label {label!r}")
    for name in _RECORDED.findall(expr):
        if name not in recorded:
            out.append(f"{where}: {name} is not a recording rule of docs/prometheus")
        else:
            seen_labels |= recorded[name]
    for group in _GROUPING.findall(expr):
        for label in filter(None, (x.strip() for x in group.split(","))):
            if label not in seen_labels:
                out.append(f"{where}: grouping label {label!r} is on none of its series")
    return out


def _recorded_labels() -> dict[str, set[str]]:
    """{recording rule: the labels its series keep}: its sum's by() list, else those of
    the recorded series it is computed from."""
    out: dict[str, set[str]] = {}
    for r in _rules():
        if "record" in r:
            by = re.search(r"\bby\s*\(([^)]*)\)", r["expr"])
            if by:
                out[r["record"]] = {x.strip() for x in by.group(1).split(",")}
            else:
                out[r["record"]] = set().union(*(out.get(n, set())
                                                 for n in _RECORDED.findall(r["expr"])))
    return out


def test_promtool_checks_the_rules():
    files = _rule_files()
    assert files, "no rule files in docs/prometheus"
    r = _promtool("check", "rules", *map(str, files))
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_tests_of_the_rules_pass():
    files = _test_files()
    assert files, "no docs/prometheus/*test*.yml"
    r = _promtool("test", "rules", *map(str, files))
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_has_a_firing_case_in_the_unit_tests():
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    fired = set()
    for p in _test_files():
        for t in yaml.safe_load(p.read_text())["tests"]:
            fired |= {a["alertname"] for a in t.get("alert_rule_test", []) if a["exp_alerts"]}
    assert alerts - fired == set()


def test_rules_name_only_real_metrics_and_labels():
    recorded = _recorded_labels()
    problems = []
    for r in _rules():
        problems += _problems(r.get("alert") or r["record"], r["expr"], recorded)
    assert problems == []


def test_dashboard_queries_parse_and_name_only_real_metrics_and_labels(tmp_path):
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    exprs = _dashboard_exprs()
    assert exprs
    problems = []
    for i, e in enumerate(exprs):
        problems += _problems(f"dashboard query {i}", e, {})
    assert problems == []
    # PromQL syntax: promtool parses each query as a recording rule, with Grafana's
    # variables given values
    rules = [{"record": f"dashboard:query_{i}",
              "expr": e.replace("$__rate_interval", "5m").replace("$instance", ".+")}
             for i, e in enumerate(exprs)]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = _promtool("check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_panels_have_unique_ids_and_do_not_overlap():
    """Grafana stacks overlapping panels unpredictably and keys its state by panel id."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    taken: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"])
                     for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in taken, f"{p['title']!r} overlaps {taken[cell]!r}"
            taken[cell] = p["title"]


def test_the_name_check_catches_what_does_not_exist():
    """The checks above would pass vacuously if the patterns matched nothing."""
    recorded = {"tierfs:hit_ratio:rate5m": {"job", "instance"}}
    assert _problems("x", 'sum by (instance) (rate(tierfs_read_bytes_total{source="disk"}[5m]))',
                     recorded) == []
    assert _problems("x", "rate(tierfs_read_byte_total[5m])", recorded) == [
        "x: tierfs_read_byte_total is not a series of tierfs/metrics.py"]
    assert _problems("x", 'tierfs_cache_bytes{tire="disk"}', recorded) == [
        "x: tierfs_cache_bytes has no label 'tire'"]
    assert _problems("x", "sum by (op) (tierfs_cache_bytes)", recorded) == [
        "x: grouping label 'op' is on none of its series"]
    assert _problems("x", "tierfs:hit_ratio:rate1h > 0", recorded) == [
        "x: tierfs:hit_ratio:rate1h is not a recording rule of docs/prometheus"]
    assert _problems("x", "histogram_quantile(0.9, sum by (le) (rate(tierfs_read_seconds_bucket[5m])))",
                     recorded) == []
