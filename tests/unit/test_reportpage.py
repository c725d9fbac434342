"""tierfs/cli/reportpage.py's pure pieces: how the report names a duration (the cold list's
title follows `--cold-after`)."""

from __future__ import annotations

from tierfs import protocol

from tierfs.cli import reportpage
def _report(cold_after: float) -> protocol.ReportResult:
    return protocol.ReportResult.model_validate({
        "mountpoint": "/mnt", "source": "s3://b/", "generated": 0.0, "levels": 2,
        "cache": {"used": 0, "budget": 1 << 20, "pinned": 0, "dirty": 0}, "read": {},
        "tiers": {}, "hot": [], "cold": [], "cold_after": cold_after,
        "metadata": {"lists": 0, "heads": 0, "top": []}, "stalls": {}, "composition": {},
        "heat": [], "eviction": {"evictions": 0, "fetches": 0, "refetches": 0},
        "usage_series": [], "ratio_series": []})


def test_a_duration_is_named_in_its_largest_whole_unit():
    assert [reportpage._span(s) for s in (0, 45, 90, 120, 5400, 86400, 30 * 86400)] == \
        ["0 s", "45 s", "1.5 min", "2 min", "1.5 h", "24 h", "720 h"]


def test_the_cold_list_title_follows_cold_after():
    titles = [t for t, _, _ in reportpage.sections(_report(120.0))]
    assert "Cold cached prefixes (not read for 2 min)" in titles
    assert "not read for 24 h" in reportpage.text(_report(86400.0))


def test_time_plots_place_points_where_they_happened(monkeypatch):
    """The capacity history is one sample per 5 minutes and the report's own point comes
    seconds after the last: the x values are the times, not equal steps."""
    from matplotlib.dates import date2num

    t0 = 1_800_000_000.0
    r = _report(86400.0).model_copy(update={
        "usage_series": [protocol.UsagePoint(t=t, used=u, budget=1 << 20)
                         for t, u in ((t0, 0), (t0 + 300, 1 << 19), (t0 + 305, 1 << 19))],
        "ratio_series": [protocol.RatioPoint(t=t, hit_ratio=h, bytes=1)
                         for t, h in ((t0 + 90, 0.5), (t0 + 300, 0.25), (t0 + 305, None))]})
    figs = []
    monkeypatch.setattr(reportpage, "_png", lambda fig: figs.append(fig) or "")
    reportpage.plots(r)
    usage, ratio = figs[0].axes[0], figs[1].axes[0]
    xs = [date2num(x) for x in usage.lines[0].get_xdata()]
    gaps = [round((b - a) * 86400, 3) for a, b in zip(xs, xs[1:])]
    assert gaps == [300.0, 5.0]
    assert [round(y, 3) for y in usage.lines[0].get_ydata()] == [0, 0.5, 0.5]  # MiB
    rx = [date2num(x) for x in ratio.lines[0].get_xdata()]  # the point with no reads: none
    assert [round((x - rx[0]) * 86400, 3) for x in rx] == [0.0, 210.0]
    lo, hi = usage.get_xlim()
    assert lo < xs[0] and hi > xs[-1]


def test_one_point_gets_a_readable_axis(monkeypatch):
    """One sample (a new mount) is drawn on a few minutes of axis, not days; none at all
    is an empty plot, not an error."""
    assert len(reportpage.plots(_report(86400.0))) == 4
    r = _report(86400.0).model_copy(update={
        "usage_series": [protocol.UsagePoint(t=1_800_000_000.0, used=0, budget=1 << 20)]})
    figs = []
    monkeypatch.setattr(reportpage, "_png", lambda fig: figs.append(fig) or "")
    reportpage.plots(r)
    lo, hi = figs[0].axes[0].get_xlim()
    assert 0 < (hi - lo) * 1440 <= 5  # minutes
