"""The metrics tierfs exports, read from the live registry (tierfs/metrics.py on a fresh
CollectorRegistry), for the tests that hold docs and dashboards to it
(test_metrics_doc.py, test_prom_rules.py)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from tierfs.metrics import Metrics


@dataclass(frozen=True)
class MetricDef:
    name: str  # as scraped and documented: a counter with its _total
    type: str  # counter, gauge, histogram
    labels: frozenset[str]

    def series(self) -> dict[str, frozenset[str]]:
        """{series name: its labels} of what a scrape of this metric shows."""
        if self.type == "histogram":
            return {self.name + "_bucket": self.labels | {"le"},
                    self.name + "_sum": self.labels, self.name + "_count": self.labels}
        return {self.name: self.labels}


def registry_metrics() -> dict[str, MetricDef]:
    """Every metric of a fresh Metrics, by documented name."""
    out = {}
    for metric in vars(Metrics()).values():
        if not isinstance(metric, (Counter, Gauge, Histogram)):
            continue
        # prometheus_client keeps a family's label names only on the wrapper (a labelled
        # family with no child yet has no samples to read them from)
        name = metric._name + ("_total" if metric._type == "counter" else "")
        out[name] = MetricDef(name, metric._type, frozenset(metric._labelnames))
    return out


def registry_series() -> dict[str, frozenset[str]]:
    """{series name: labels} of every series the registry can expose."""
    return {s: labels for d in registry_metrics().values() for s, labels in d.series().items()}
