"""`tierfs report`'s two faces: the text a terminal shows, and one self-contained HTML page
with the plots (docs/report.md). The only module that imports matplotlib (Agg backend, no
display), and only when a page is asked for: the text report starts no plotting library.

The page embeds every plot as a base64 PNG (no file beside it, no network), escapes every
name it shows (a prefix is whatever the bucket's keys are), and ends with a one-line
self-check a browser fills in: how many plots it decoded (headless Chromium reads it in
the tests).
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import time
from typing import Any

from ..config import format_size
from ..protocol import Bucket, PrefixRow, ReportResult

SOURCES = ("memory", "disk", "peer", "near", "backend")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _when(t: float) -> str:
    return "never" if not t else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _secs(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def _span(s: float) -> str:
    """A duration in its largest unit that is at least 1 (--cold-after 2m is "2 min",
    not "0.0333 h")."""
    for unit, n in (("h", 3600.0), ("min", 60.0)):
        if s >= n:
            return f"{round(s / n, 2):g} {unit}"
    return f"{round(s, 2):g} s"


def _shown(prefix: str) -> str:
    return prefix or "(root)"


def _bound(b: Bucket, unit: str = "s") -> str:
    return "+inf" if b.le is None else f"{b.le:g}{unit}"


# ---- the sections, as rows (shared by the text and the page) -----------------------------


def _prefix_rows(rows: list[PrefixRow]) -> list[list[str]]:
    return [[_shown(r.prefix), format_size(r.read.total()), _pct(r.hit_ratio),
             _pct(r.reread_ratio), str(r.refetches), f"{format_size(r.cached)} / "
             f"{format_size(r.total)}", _when(r.last_read)] for r in rows]


PREFIX_HEAD = ["prefix", "read", "hit", "re-read", "re-fetched", "cached / total", "last read"]


def sections(r: ReportResult) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of each table of the report."""
    read_total = r.read.total()
    out = [
        ("Reads by tier", ["source", "bytes", "share", "reads", "p50", "p99"],
         [[s, format_size(getattr(r.read, s)), _pct(r.tiers.get(s)),
           *next(([str(lt.reads), _secs(lt.p50), _secs(lt.p99)] for lt in r.latency
                  if lt.source == s), ["-", "-", "-"])] for s in SOURCES]
         + [["all", format_size(read_total), f"hit ratio {_pct(r.hit_ratio)}", "", "", ""]]),
        ("Hot prefixes (decayed bytes read)", PREFIX_HEAD, _prefix_rows(r.hot)),
        (f"Cold cached prefixes (not read for {_span(r.cold_after)})",
         ["prefix", "cached", "last access"],
         [[_shown(c.prefix), format_size(c.cached), _when(c.last_access)] for c in r.cold]),
        (f"Metadata pressure: {r.metadata.lists} LISTs, {r.metadata.heads} HEADs",
         ["prefix", "LISTs", "HEADs", "last read"],
         [[_shown(p.prefix), str(p.lists), str(p.heads), _when(p.last_read)]
          for p in r.metadata.top]),
    ]
    st = r.stalls
    out.append((f"Stalls: {st.total} reads waited past {_secs(st.threshold_s)} "
                f"({st.total_s:.1f} s in all; by source "
                f"{', '.join(f'{k} {v}' for k, v in st.by_source.items()) or '-'}); "
                f"{st.backend_stalls} store requests past --stall-warn",
                ["key", "offset", "wait", "waited on", "reader", "when"],
                [[str(s.get("key", "")), str(s.get("offset", "")), _secs(s.get("wait_s")),
                  str(s.get("source", "")), str(s.get("reader", "")), _when(s.get("at", 0))]
                 for s in st.slowest]))
    out.append(("Cache by heat", ["band", "bytes"],
                [[band, format_size(n)] for band, n in r.composition.items()]))
    e = r.eviction
    out.append(("Eviction quality", ["evictions", "not stored (admission)", "chunks fetched",
                                     "fetched again", "re-fetch ratio"],
                [[str(e.evictions), str(e.refused), str(e.fetches), str(e.refetches),
                  _pct(e.refetch_ratio)]]))
    return out


def _headline(r: ReportResult) -> str:
    c = r.cache
    return (f"{r.mountpoint} ({r.source}): cache {format_size(c.used)} of "
            f"{format_size(c.budget)}, {format_size(c.pinned)} pinned, "
            f"{format_size(c.dirty)} unsaved; report at {_when(r.generated)}")


def text(r: ReportResult) -> str:
    lines = [_headline(r)]
    for title, head, rows in sections(r):
        lines += ["", title]
        if not rows:
            lines.append("  (none)")
            continue
        widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
        for row in [head, *rows]:
            cells = (x.ljust(w) for x, w in zip(row, widths, strict=True))
            lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)


# ---- the page ----------------------------------------------------------------------------


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def plots(r: ReportResult) -> list[tuple[str, str]]:
    """(title, base64 PNG) of each plot: cache usage over time, hit ratio over time, the
    stall histogram, the heat distribution."""
    import matplotlib
    matplotlib.use("Agg")  # no display: render to memory
    from matplotlib.figure import Figure  # not pyplot: no global state, no GUI

    out = []
    fig = Figure(figsize=(7, 3))
    ax = fig.add_subplot()
    xs = _when_x([p.t for p in r.usage_series])
    top = max((p.budget for p in r.usage_series), default=0)
    unit, scale = ("GiB", float(1 << 30)) if top >= 1 << 30 else ("MiB", float(1 << 20))
    for label, ys in (("used", [p.used for p in r.usage_series]),
                      ("budget", [p.budget for p in r.usage_series]),
                      ("pinned", [p.pinned for p in r.usage_series])):
        ax.plot(xs, [y / scale for y in ys],  # type: ignore[arg-type]  # dates: matplotlib units
                marker="o", label=label)
    _time_axis(ax, xs)
    ax.set_ylim(bottom=0)
    ax.set_ylabel(unit)
    ax.legend(loc="upper left")
    out.append(("Cache usage over time", _png(fig)))

    fig = Figure(figsize=(7, 3))
    ax = fig.add_subplot()
    pts = [p for p in r.ratio_series if p.hit_ratio is not None]
    xs = _when_x([p.t for p in pts])
    ratios = [100 * (p.hit_ratio or 0) for p in pts]
    ax.plot(xs, ratios, marker="o")  # type: ignore[arg-type]  # dates: matplotlib units
    _time_axis(ax, xs)
    ax.set_ylim(0, 105)
    ax.set_ylabel("hit ratio (% of bytes)")
    out.append(("Hit ratio over time", _png(fig)))

    fig = Figure(figsize=(7, 3))
    ax = fig.add_subplot()
    hist = r.stalls.histogram
    ax.bar(range(len(hist)), [b.count for b in hist])
    ax.set_xticks(range(len(hist)), [f"≤{_bound(b)}" for b in hist], rotation=45,
                  fontsize=7)
    ax.set_ylabel("stalled reads")
    ax.set_ylim(bottom=0, top=max([b.count for b in hist] + [1]) * 1.1)
    if not any(b.count for b in hist):
        ax.text(0.5, 0.5, "no stalls", transform=ax.transAxes, ha="center", va="center")
    ax.set_xlabel("wait on a fetch")
    out.append(("Stall histogram", _png(fig)))

    fig = Figure(figsize=(7, 3))
    ax = fig.add_subplot()
    ax.bar(range(len(r.heat)), [b.count / (1 << 20) for b in r.heat])
    ax.set_xticks(range(len(r.heat)), [f"<{b.le:g}" if b.le is not None else
                                       f"≥{r.heat[-2].le:g}" if len(r.heat) > 1 else "all"
                                       for b in r.heat], fontsize=8)
    ax.set_ylabel("cached MiB")
    ax.set_xlabel("decayed heat (reads per handle)")
    out.append(("Heat distribution", _png(fig)))
    return out


def _when_x(ts: list[float]) -> list[datetime.datetime]:
    """Epoch seconds as the x values of a time plot (local time, as the tables show it)."""
    return [datetime.datetime.fromtimestamp(t) for t in ts]


def _time_axis(ax: Any, xs: list[datetime.datetime]) -> None:
    """Points where they happened: the samples of a history are 5 minutes apart, then an
    hour, and the report's own point comes seconds after the last one; an axis of equal
    steps would draw those intervals alike."""
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter

    locator = AutoDateLocator(maxticks=8)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    ax.tick_params(axis="x", labelsize=7)
    if xs:  # a minute either side at least (one point alone: not matplotlib's 4 days)
        pad = max((max(xs) - min(xs)) / 20, datetime.timedelta(minutes=1))
        ax.set_xlim(min(xs) - pad, max(xs) + pad)
    ax.grid(True, alpha=0.3)


_STYLE = """body{font-family:sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;
padding:2px 8px;text-align:left;font-size:90%}th{background:#eee}
.plots{display:flex;flex-wrap:wrap;gap:1em}figure{margin:0}"""

# fills in #selfcheck once the page has loaded: plots decoded (naturalWidth > 0) and errors
_CHECK = """<script>
var errors=[];window.addEventListener('error',function(e){errors.push(String(e.message))});
window.addEventListener('load',function(){var ok=0,bad=0;
for(var i of document.images){if(i.complete&&i.naturalWidth>0)ok++;else bad++;}
document.getElementById('selfcheck').textContent='plots decoded: '+ok+', failed: '+bad+
', errors: '+errors.length;});
</script>"""


def page(r: ReportResult) -> str:
    """The report as one HTML document with its plots embedded."""
    e = html.escape
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>tierfs report: {e(r.mountpoint)}</title><style>{_STYLE}</style>",
             "</head><body>", f"<h1>tierfs report</h1><p>{e(_headline(r))}</p>",
             '<div class="plots">']
    for title, png in plots(r):
        parts.append(f'<figure><img alt="{e(title)}" src="data:image/png;base64,{png}">'
                     f"<figcaption>{e(title)}</figcaption></figure>")
    parts.append("</div>")
    for title, head, rows in sections(r):
        parts.append(f"<h2>{e(title)}</h2>")
        if not rows:
            parts.append("<p>(none)</p>")
            continue
        parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{e(x)}</td>" for x in row) + "</tr>" for row in rows]
        parts.append("</table>")
    parts += ['<p id="selfcheck">plots not checked (scripts off)</p>', _CHECK,
              "</body></html>"]
    return "\n".join(parts)
