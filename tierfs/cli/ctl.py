"""`tierfs status | warm | evict | unpin | usage | report`: clients of a running mount's
control socket.

Paths name files, directories or glob patterns under a tierfs mount, as the user sees
them; the mount is found in /proc/self/mountinfo (fstype fuse.tierfs, longest prefix)
without stat-ing anything under it, and its socket from the mount point and the owner
uid the kernel records (tierfs.runpaths). Globs are passed on quoted and expanded by the
daemon from its listings, never by walking the mount.

Exit status: 0 done; 1 failed (one `tierfs: error:` line, plus one per failed path);
2 bad usage; `warm --check` exits 3 when part of the set is not cached.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from pydantic import ValidationError

from .. import protocol
from ..config import (
    MANIFEST_MAX_PATHS,
    MAX_DURATION,
    check_job_id,
    format_size,
    parse_duration,
    read_manifest_fd,
)
from ..errors import TierfsError, UsageError
from ..mount.mountinfo import mounts
from ..protocol import MAX_REPLY, ProtocolError
from ..runpaths import control_socket

IDLE_TIMEOUT_S = 120.0  # a warm sends progress every 0.5 s; silence this long is a hang
NOT_CACHED = 3


class ControlError(TierfsError):
    """The daemon refused a request or could not be reached."""


# ---- finding mounts ----------------------------------------------------------------------


@dataclass(frozen=True)
class TierfsMount:
    mountpoint: str
    uid: int

    @property
    def socket(self) -> str:
        return control_socket(self.mountpoint, self.uid)


def tierfs_mounts() -> list[TierfsMount]:
    return [TierfsMount(m.mountpoint, int(m.super_options.get("user_id") or 0))
            for m in mounts() if m.fstype == "fuse.tierfs"]


def locate(path: str, mounts: list[TierfsMount]) -> tuple[TierfsMount, str]:
    """(the mount a path is under, the path relative to the mount's root)."""
    full = os.path.normpath(os.path.abspath(path))
    best = None
    for m in mounts:
        if full == m.mountpoint or full.startswith(m.mountpoint.rstrip("/") + "/"):
            if best is None or len(m.mountpoint) > len(best.mountpoint):
                best = m
    if best is None:
        raise UsageError(f"{path} is not under a tierfs mount")
    return best, os.path.relpath(full, best.mountpoint) if full != best.mountpoint else ""


def group_by_mount(paths: list[str]) -> tuple[dict[TierfsMount, list[str]], int]:
    """(paths grouped by the mount they are under, exit status so far). A path outside
    every mount is reported (`tierfs: error: ...`, status 1) and the others still done."""
    mounts = tierfs_mounts()
    groups: dict[TierfsMount, list[str]] = {}
    outside = []
    for p in paths:
        try:
            m, rel = locate(p, mounts)
        except UsageError as exc:
            outside.append(str(exc))
            continue
        groups.setdefault(m, []).append(rel)
    if outside and not groups:
        raise UsageError(outside[0] if len(outside) == 1 else
                         f"none of the {len(outside)} paths is under a tierfs mount")
    for why in outside:
        sys.stderr.write(f"tierfs: error: {why}\n")
    return groups, 1 if outside else 0


def read_manifest(path: str) -> list[str]:
    """One path or glob per line; blank lines and '#' comments are skipped. Relative
    lines are relative to the current directory, like paths on the command line.

    A regular file of at most MANIFEST_MAX_BYTES: /dev/zero, a FIFO or a huge file is
    refused up front instead of read until memory runs out (or for ever)."""
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer; fstat then refuses it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"cannot read manifest {path}: {exc.strerror}") from None
    try:
        text = read_manifest_fd(fd, path)
    except OSError as exc:
        raise UsageError(f"cannot read manifest {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    lines = [ln.strip() for ln in text.splitlines()]
    paths = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(paths) > MANIFEST_MAX_PATHS:
        raise UsageError(f"manifest {path} names more than {MANIFEST_MAX_PATHS} paths")
    return paths


# ---- the protocol ------------------------------------------------------------------------


def encode(op: str, fields: dict[str, object]) -> bytes:
    """A request line, checked by the same model the daemon uses: a bad field (a job id
    with a newline, a TTL beyond a year) is one usage error here, before any connection."""
    try:
        return protocol.REQUESTS[op].model_validate(fields).encode()
    except ValidationError as exc:
        from ..config import usage_error
        raise usage_error(exc) from None


def request(mount: TierfsMount, op: str, *, on_event: Callable[[dict], None] | None = None,
            **fields: object) -> dict:
    """Send one request; call on_event for each event line; return the result (checked
    against the op's result model; a reply that is not one is a ControlError line)."""
    line = encode(op, fields)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(IDLE_TIMEOUT_S)
    try:
        try:
            sock.connect(mount.socket)
        except FileNotFoundError:
            raise ControlError(f"{mount.mountpoint}: no control socket at {mount.socket} "
                               "(is its tierfs daemon running?)") from None
        except PermissionError:
            raise ControlError(f"{mount.mountpoint}: permission denied: only root and the user "
                               "who mounted may control it") from None
        except ConnectionRefusedError:
            raise ControlError(f"{mount.mountpoint}: its tierfs daemon is not running "
                               "(stale socket)") from None
        sock.sendall(line)
        for msg in _replies(sock, mount):
            if isinstance(msg, protocol.Event):
                if on_event is not None:
                    on_event(msg.model_dump())
                continue
            if not msg.ok:
                why = " ".join((msg.error or "request failed").split())  # one line
                raise ControlError(f"{mount.mountpoint}: {why}")
            try:
                return protocol.check_result(op, msg.result or {})
            except ProtocolError as exc:
                raise ControlError(f"{mount.mountpoint}: {exc}") from None
        raise ControlError(f"{mount.mountpoint}: the daemon closed the connection "
                           "without an answer (did it stop?)")
    except socket.timeout:
        raise ControlError(f"{mount.mountpoint}: the daemon did not answer for "
                           f"{IDLE_TIMEOUT_S:.0f}s") from None
    finally:
        sock.close()


def _replies(sock: socket.socket, mount: TierfsMount
             ) -> Iterator[protocol.Event | protocol.Final]:
    """The reply lines, parsed; a line longer than MAX_REPLY or not a message of the
    protocol ends the exchange with one ControlError (the buffer never grows past it)."""
    buf = bytearray()
    while True:
        data = sock.recv(1 << 16)
        if not data:
            return
        buf += data
        while (end := buf.find(b"\n")) >= 0:
            line = bytes(buf[:end])
            del buf[:end + 1]
            try:
                yield protocol.parse_reply(line)
            except ProtocolError as exc:
                raise ControlError(f"{mount.mountpoint}: garbled answer from the daemon: "
                                   f"{exc}") from None
        if len(buf) > MAX_REPLY:
            raise ControlError(f"{mount.mountpoint}: the daemon's answer is longer than "
                               f"{format_size(MAX_REPLY)}")


# ---- output ------------------------------------------------------------------------------


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class ProgressBar:
    """One redrawn line on stderr (a terminal only): bytes, rate, ETA."""

    def __init__(self) -> None:
        self.enabled = sys.stderr.isatty()
        self._t0 = time.monotonic()
        self._shown = False

    def __call__(self, ev: dict) -> None:
        if not self.enabled or ev.get("event") != "progress":
            return
        if ev.get("phase") == "listing":
            line = f"warm: listing... {ev.get('files', 0)} files so far"
        else:
            total, done = ev.get("bytes", 0), ev.get("bytes_done", 0)
            elapsed = max(1e-3, time.monotonic() - self._t0)
            rate = ev.get("bytes_fetched", 0) / elapsed
            eta = (total - done) / rate if rate > 0 else None
            pct = 100.0 * done / total if total else 100.0
            width = 24
            bar = "#" * int(width * pct / 100)
            line = (f"warm: [{bar:<{width}}] {pct:5.1f}% "
                    f"{format_size(done)} / {format_size(total)}  {format_size(rate)}/s  "
                    f"ETA {_duration(eta) if eta is not None else '--'}")
            if ev.get("error_count"):
                line += f"  {ev['error_count']} errors"
        sys.stderr.write("\r\033[K" + line)
        sys.stderr.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _emit_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _report_errors(result: dict) -> None:
    for e in result.get("errors", []):
        sys.stderr.write(f"tierfs: error: {e['path']}: {e['error']}\n")
    more = result.get("error_count", 0) - len(result.get("errors", []))
    if more > 0:
        sys.stderr.write(f"tierfs: error: ... and {more} more (see the daemon's log)\n")


# ---- commands ----------------------------------------------------------------------------


def _counts_row(rows: list[tuple[str, str]], what: str, counts: dict[str, float]) -> None:
    """One "what: 3 get, 1 list" row of the non-zero counts, none if all are zero."""
    shown = sorted((k, n) for k, n in counts.items() if n)
    if shown:
        rows.append(("", f"{what}: " + ", ".join(f"{n:.0f} {k}" for k, n in shown)))


def _status(args: argparse.Namespace) -> int:
    mounts = tierfs_mounts()
    m, rel = locate(args.mountpoint, mounts)
    if rel:
        raise UsageError(f"{args.mountpoint} is inside the mount {m.mountpoint}, not its root")
    st = request(m, "status")
    if args.json:
        _emit_json(st)
        return 0
    d, mem, pin = st["disk"], st["memory"], st["pinned"]
    ratio = st["hit_ratio"]["bytes"]
    rows = [
        ("mount", f"{st['mountpoint']} (pid {st['pid']}, up {_duration(st['uptime_s'])})"),
        ("source", st["source"]),
        ("cache dir", st["cache_dir"]),
        ("disk tier", f"{format_size(d['used'])} of {format_size(d['budget'])} "
                      f"({100 * d['used'] / max(1, d['budget']):.0f}%), {d['chunks']} chunks"),
        ("memory tier", f"{format_size(mem['used'])} of {format_size(mem['capacity'])}"),
        ("hit ratio", "no reads yet" if ratio is None else
         f"{100 * ratio:.1f}% of bytes read came from the cache"),
        ("pinned", f"{format_size(pin['bytes'])} in {pin['files']} files"),
    ]
    for o in pin["owners"]:
        until = "" if o.get("expires") is None else " until " + _when(o["expires"])
        rows.append(("", f"{o['owner']}: {o['files']} files, {format_size(o['bytes'])}{until}"))
    rows.append(("unsaved", f"{format_size(st['dirty_bytes'])}, "
                            f"{st['uploads_pending']} uploads pending"))
    if "backend_up" in st:  # a daemon from before degraded mode does not say
        rows.append(("object store", "answering" if st["backend_up"] else
                     "NOT ANSWERING: degraded, serving what is cached (uncached reads EIO)"))
    for field, what in (("backend_requests", "requests"), ("backend_errors", "errors")):
        _counts_row(rows, what, st.get(field, {}))  # errors: absent from older daemons
    near = st.get("near")
    if near:  # None without --tier (absent from a daemon from before the near store)
        c = near["chunks"]
        rows.append(("near store", f"{near['store']}: " + (
            "answering" if near["up"] else "NOT ANSWERING: reads go to the source")))
        rows.append(("", f"chunks: {c['hits']} read, {c['misses']} missing, "
                         f"{c['failures']} failed"))
        p = near.get("promotions")
        if p is not None:
            rows.append(("", f"copied: {p['copied']} objects, {format_size(p['copied_bytes'])}"
                             f", {p['pending']} waiting"))
    peers = st.get("peers")
    if peers:  # None without --peers (and absent from a daemon from before the peer tier)
        rows.append(("peers", f"{peers['source']}: {len(peers['up'])} up, "
                              f"{len(peers['down'])} down (this node {peers['me']})"))
        if peers["down"]:
            rows.append(("", "down: " + ", ".join(peers["down"])))
        for role, what in (("client", "asked"), ("server", "answered")):
            _counts_row(rows, what, peers["requests"][role])
        rows.append(("", f"chunk bytes: {format_size(peers['bytes']['in'])} in, "
                         f"{format_size(peers['bytes']['out'])} out"))
    for k, v in rows:
        print(f"{k:<12} {v}")
    return 0


def _when(t: float) -> str:
    """A pin's expiry; one set before TTLs were bounded may lie beyond what a date holds."""
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return "far in the future"


def _warm(args: argparse.Namespace) -> int:
    paths = list(args.paths)
    if args.manifest:
        paths += read_manifest(args.manifest)
    if not paths:
        raise UsageError("nothing to warm: give paths or --manifest")
    fields: dict[str, object] = {"check": args.check}
    if args.job is not None:
        fields["job"] = args.job
    if args.pin or args.pin_ttl or args.job is not None:
        fields["pin"] = True
    if args.pin_ttl:
        fields["pin_ttl"] = _pin_ttl(args.pin_ttl)
    if args.concurrency is not None:
        fields["concurrency"] = args.concurrency
    if args.tier != "local":
        if fields.get("pin"):
            raise UsageError("--pin, --pin-ttl and --job keep files in this node's cache: "
                             "not with --tier near")
        fields["tier"] = args.tier
    groups, status = group_by_mount(paths)
    for mount, rels in groups.items():
        bar = ProgressBar() if not args.json else None

        def on_event(ev: dict, bar: ProgressBar | None = bar, mount: TierfsMount = mount) -> None:
            if args.json:
                _emit_json({**ev, "mountpoint": mount.mountpoint})
            elif bar is not None:
                bar(ev)

        try:
            res = request(mount, "warm", on_event=on_event, paths=rels, **fields)
        except ControlError as exc:
            if args.json:
                _emit_json({"event": "error", "mountpoint": mount.mountpoint, "error": str(exc)})
            sys.stderr.write(f"tierfs: error: {exc}\n")
            status = 1
            continue
        finally:
            if bar is not None:
                bar.close()
        if args.json:
            _emit_json({"event": "summary", "mountpoint": mount.mountpoint, **res})
        else:
            print(_warm_summary(mount, res, args.check))
        _report_errors(res)
        if res.get("error_count"):
            status = 1
        elif args.check and res["bytes_cached_before"] < res["bytes"] and status == 0:
            status = NOT_CACHED
    return status


def _pin_ttl(text: str) -> float:
    ttl = parse_duration(text, "pin-ttl")
    if not 0 < ttl <= MAX_DURATION:
        raise UsageError(f"invalid pin-ttl {text!r}: must be more than 0s and at most 365d")
    return ttl


def _positive_int(text: str) -> int:
    """argparse type of --concurrency: 0 or 'many' is refused, not silently the default."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= 256:
        raise argparse.ArgumentTypeError(f"{value} is not between 1 and 256")
    return value


def _job_id(text: str) -> str:
    """argparse type of --job: the protocol's job id (no newline to forge a log line,
    at most 64 characters)."""
    try:
        return check_job_id(text)
    except ValueError as exc:
        shown = repr(text) if len(text) <= 40 else repr(text[:37]) + "..."
        raise argparse.ArgumentTypeError(f"{shown}: {exc}") from None


def _warm_summary(mount: TierfsMount, r: dict, check: bool) -> str:
    head = f"{mount.mountpoint}: {r['files']} files, {format_size(r['bytes'])}"
    if r.get("tier") == "near":
        done = "missing" if check else "copied"
        left = r["bytes"] - r["bytes_cached_before"] if check else r["bytes_fetched"]
        return (f"{head}: {format_size(r['bytes_cached_before'])} in the near store already, "
                f"{format_size(left)} {done}"
                + (f"; {r['error_count']} errors" if r.get("error_count") else ""))
    if check:
        pct = 100.0 * r["bytes_cached_before"] / r["bytes"] if r["bytes"] else 100.0
        fits = "" if r["fits"] else "; the set does not fit in the cache"
        return f"{head}: {format_size(r['bytes_cached_before'])} cached ({pct:.1f}%){fits}"
    rate = r["bytes_fetched"] / r["seconds"] if r["seconds"] else 0.0
    text = (f"{head}: {format_size(r['bytes_cached_before'])} already cached, "
            f"{format_size(r['bytes_fetched'])} fetched in {r['seconds']:.1f}s "
            f"({format_size(rate)}/s)")
    if r.get("pinned"):
        text += f"; pinned for {r['pinned']}"
    if r.get("unsaved_files"):
        text += f"; {r['unsaved_files']} files with unsaved writes are local already"
    return text + (f"; {r['error_count']} errors" if r.get("error_count") else "")


def near_gc(mountpoint: str, budget: int | None, dry_run: bool, as_json: bool) -> int:
    """`tierfs gc --tier near MOUNTPOINT` (cli/gc.py hands it over): the mount's near store
    collected by its daemon, which knows both stores (tierfs/read/neargc.py)."""
    mount, _ = locate(os.path.abspath(mountpoint), tierfs_mounts())
    fields: dict[str, object] = {"dry_run": dry_run}
    if budget is not None:
        fields["budget"] = budget
    r = request(mount, "near_gc", on_event=None, **fields)
    if as_json:
        _emit_json({"mountpoint": mount.mountpoint, **r})
    else:
        would = "would go" if dry_run else "removed"
        print(f"{mount.mountpoint}: near store: {r['copies']} copies; {r['stale']} stale "
              f"({format_size(r['stale_bytes'])}) and {r['over_budget']} over the budget "
              f"({format_size(r['over_budget_bytes'])}) {would}; {r['kept']} kept "
              f"({format_size(r['kept_bytes'])}); {r['not_copies']} other objects left alone")
    _report_errors(r)
    return 1 if r.get("error_count") else 0


def _evict(args: argparse.Namespace) -> int:
    groups, status = group_by_mount(args.paths)
    for mount, rels in groups.items():
        res = request(mount, "evict", on_event=None, paths=rels,
                      **({"tier": "near"} if args.tier == "near" else {}))
        if args.json:
            _emit_json({"mountpoint": mount.mountpoint, **res})
        else:
            kept = f"; {res['pinned_kept']} pinned files kept (unpin them first)" \
                if res["pinned_kept"] else ""
            print(f"{mount.mountpoint}: {res['files']} files, "
                  f"{format_size(res['bytes_evicted'])} evicted{kept}")
        _report_errors(res)
        status = status or (1 if res.get("error_count") else 0)
    return status


def _unpin(args: argparse.Namespace) -> int:
    if args.paths and (args.job or args.all):
        raise UsageError("give PATHs, or --job ID, or --all, not several")
    if not args.paths and not args.job and not args.all:
        raise UsageError("give PATHs to unpin, --job ID or --all")
    status = 0
    targets: list[tuple[TierfsMount, dict[str, object]]]
    if args.paths:
        groups, status = group_by_mount(args.paths)
        targets = [(m, {"paths": rels}) for m, rels in groups.items()]
    else:  # a job's pins, or all pins, on every tierfs mount of this node
        fields: dict[str, object] = {"job": args.job} if args.job else {"all": True}
        targets = [(m, fields) for m in tierfs_mounts()
                   if not args.mount or m.mountpoint in args.mount]
    for mount, fields in targets:
        try:
            res = request(mount, "unpin", on_event=None, **fields)
        except ControlError as exc:
            sys.stderr.write(f"tierfs: error: {exc}\n")
            status = 1
            continue
        if args.json:
            _emit_json({"mountpoint": mount.mountpoint, **res})
        elif "pins_released" in res:
            print(f"{mount.mountpoint}: {res['pins_released']} pins released "
                  f"({res['files']} files)")
            _report_errors(res)
        else:
            print(f"{mount.mountpoint}: released {', '.join(res['owners_released']) or 'nothing'}"
                  f" ({res['objects']} files)")
    return status


def _usage(args: argparse.Namespace) -> int:
    """`tierfs usage [MOUNT]`: one mount, or every tierfs mount of this node."""
    fields: dict[str, object] = {"by": args.by, "forecast": args.forecast}
    if args.reader:
        fields["reader"] = args.reader
    encode("usage", fields)  # a bad --reader is one error line before any mount is asked
    status = 0
    for mount, res in _ask_each(_targets(args.mountpoint), "usage", fields):
        if res is None:
            status = 1
        elif args.json:
            _emit_json({"mountpoint": mount.mountpoint, **res})
        else:
            print(usage_table(mount.mountpoint, protocol.UsageResult.model_validate(res)))
    return status


def usage_table(mountpoint: str, r: protocol.UsageResult) -> str:
    """The readable form of a usage result: one row per tenant or reader."""
    c = r.cache
    lines = [f"{mountpoint}: cache {format_size(c.used)} of {format_size(c.budget)}, "
             f"{format_size(c.pinned)} pinned, {format_size(c.dirty)} unsaved"]
    tenants = r.by == "tenant"
    head = f"{r.by:<20} {'read':>10} {'memory':>9} {'disk':>9} {'peer':>9} {'near':>9} " \
           f"{'store':>9} " \
           f"{'hit':>6} {'stalled':>8}"
    lines.append(head + (f" {'cached':>9} {'pinned':>9}" if tenants else ""))
    for row in r.rows:
        rd = row.read
        hit = "-" if row.hit_ratio is None else f"{100 * row.hit_ratio:.0f}%"
        text = (f"{row.name[:20]:<20} {format_size(rd.total()):>10} {format_size(rd.memory):>9} "
                f"{format_size(rd.disk):>9} {format_size(rd.peer):>9} "
                f"{format_size(rd.near):>9} {format_size(rd.backend):>9} {hit:>6} "
                f"{row.stall_s:>7.1f}s")
        if tenants:
            text += "".join(f" {'-' if v is None else format_size(v):>9}"
                            for v in (row.cached, row.pinned))
        lines.append(text)
    if not r.rows:
        lines.append(f"(no {r.by} has read through this mount yet)")
    if tenants and r.cached_from == "index":
        lines.append("(cached and pinned per tenant from the chunk index, up to a second old)")
    f = r.forecast
    if f is not None:
        lines.append(f"forecast: {f.text}")
        for ws in f.working_set:
            lines.append(f"working set of {ws.tenant}: {format_size(ws.day)} in the last day, "
                         f"{format_size(ws.week)} in the last week (estimated)")
    return "\n".join(lines)


def _targets(mountpoint: str | None) -> list[TierfsMount]:
    """The mount a MOUNT argument names (its root), or every tierfs mount of this node."""
    all_mounts = tierfs_mounts()
    if mountpoint:
        m, rel = locate(mountpoint, all_mounts)
        if rel:
            raise UsageError(f"{mountpoint} is inside the mount {m.mountpoint}, not its root")
        return [m]
    if not all_mounts:
        raise UsageError("no tierfs mount on this node")
    return all_mounts


def _ask_each(targets: list[TierfsMount], op: str, fields: dict[str, object]
              ) -> Iterator[tuple[TierfsMount, dict | None]]:
    """Each mount's answer to one request; a mount that fails is one error line and None."""
    for mount in targets:
        try:
            res = request(mount, op, on_event=None, **fields)
        except ControlError as exc:
            sys.stderr.write(f"tierfs: error: {exc}\n")
            res = None
        yield mount, res


def _report(args: argparse.Namespace) -> int:
    """`tierfs report [MOUNT] [--json | --html FILE]`, or `--manifest --job ID`."""
    if args.manifest:
        return _job_manifest(args)
    if args.job is not None or args.since is not None:
        raise UsageError("--job and --since go with --manifest")
    if args.json and args.html:
        raise UsageError("--json and --html: give one of them")
    fields: dict[str, object] = {"top": args.top}
    if args.cold_after is not None:
        fields["cold_after"] = parse_duration(args.cold_after, "cold-after")
    encode("report", fields)
    targets = _targets(args.mountpoint)
    if args.html and len(targets) > 1:
        raise UsageError("--html writes one mount's page: name the MOUNT")
    from . import reportpage  # the page's plotting library only when asked for

    status = 0
    for mount, res in _ask_each(targets, "report", fields):
        if res is None:
            status = 1
            continue
        if args.json:
            _emit_json(res)
            continue
        r = protocol.ReportResult.model_validate(res)
        if args.html:
            doc = reportpage.page(r)
            try:
                with open(args.html, "w", encoding="utf-8") as f:
                    f.write(doc)
            except OSError as exc:
                raise UsageError(f"cannot write {args.html}: {exc.strerror}") from None
            print(f"{mount.mountpoint}: report written to {args.html}")
        else:
            print(reportpage.text(r))
    return status


def _job_manifest(args: argparse.Namespace) -> int:
    """The files job ID read through the mounts, as `tierfs warm --manifest` reads them:
    absolute paths, glob characters escaped (a file named `a[1]` is that file), names a
    line cannot hold (a newline, surrounding blanks) left out and counted in a comment."""
    if args.job is None:
        raise UsageError("--manifest needs --job ID")
    if args.json or args.html:
        raise UsageError("--manifest prints a manifest: no --json or --html")
    fields: dict[str, object] = {"job": args.job}
    if args.since is not None:
        since = parse_duration(args.since, "since")
        if not 0 <= since <= MAX_DURATION:
            raise UsageError("--since must be between 0 and 365d")
        fields["since"] = since
    encode("job_files", fields)
    lines, known, status = [], False, 0
    for mount, answer in _ask_each(_targets(args.mountpoint), "job_files", fields):
        if answer is None:
            status = 1
            continue
        res = protocol.JobFilesResult.model_validate(answer)
        known |= res.known
        skipped = 0
        for f in res.files:
            path = os.path.join(mount.mountpoint, f.path)
            if "\n" in path or "\r" in path or path != path.strip():
                skipped += 1
            else:
                lines.append(glob.escape(path))
        if skipped:
            lines.append(f"# {skipped} files of {mount.mountpoint} left out: their names "
                         f"cannot be a manifest line")
        if res.truncated:
            lines.append(f"# job {args.job} read more files on {mount.mountpoint} than the "
                         f"mount keeps per job: the list is partial")
    if not known and status == 0:
        raise UsageError(f"job {args.job} read nothing through "
                         f"{args.mountpoint or 'any tierfs mount of this node'} "
                         f"(or longer ago than the mounts keep)")
    print(f"# tierfs report --manifest --job {args.job}: "
          f"{sum(1 for ln in lines if not ln.startswith('#'))} files")
    for line in lines:
        print(line)
    return status


def add_parsers(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("status", help="cache usage, hit ratio, pins and pending uploads of a mount")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="print the status as one JSON object")
    s.set_defaults(run=_status)

    w = sub.add_parser("warm", help="fetch files, directories or globs into the cache")
    w.add_argument("paths", nargs="*", metavar="PATH",
                   help="files, directories or quoted globs ('data/*/train', '**/*.pt') "
                        "under a tierfs mount")
    w.add_argument("--manifest", metavar="FILE", help="more paths, one per line (# comments)")
    w.add_argument("--check", action="store_true",
                   help="only report how much is cached (exit 3 if not all); fetch nothing")
    w.add_argument("--pin", action="store_true", help="keep the warmed files from eviction")
    w.add_argument("--pin-ttl", metavar="DURATION", help="release the pin after this long (24h)")
    w.add_argument("--job", metavar="ID", type=_job_id,
                   help="pin for this job; `tierfs unpin --job ID` releases")
    w.add_argument("--concurrency", type=_positive_int, metavar="N",
                   help="parallel GETs (default: the mount's warm-concurrency, 16)")
    w.add_argument("--tier", choices=("local", "near"), default="local",
                   help="near: fill the mount's near store for the whole cluster, not this "
                        "node's cache (docs/tiers.md)")
    w.add_argument("--json", action="store_true", help="JSON lines: progress events, a summary")
    w.set_defaults(run=_warm)

    e = sub.add_parser("evict", help="drop files, directories or globs from the cache")
    e.add_argument("paths", nargs="+", metavar="PATH")
    e.add_argument("--tier", choices=("local", "near"), default="local",
                   help="near: remove the near store's copies of the files (docs/tiers.md)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(run=_evict)

    u = sub.add_parser("unpin", help="release pins (of paths, of a job, or all)")
    u.add_argument("paths", nargs="*", metavar="PATH")
    u.add_argument("--job", metavar="ID", type=_job_id,
                   help="release this job's pins on every tierfs mount")
    u.add_argument("--all", action="store_true", help="release every pin on every tierfs mount")
    u.add_argument("--mount", action="append", metavar="MOUNTPOINT",
                   help="with --job/--all: only this mount (repeatable; the Slurm epilog)")
    u.add_argument("--json", action="store_true")
    u.set_defaults(run=_unpin)

    g = sub.add_parser("usage", help="bytes read, hit ratio, stalls and cache share per "
                                     "tenant or reader; --forecast: when the cache fills")
    g.add_argument("mountpoint", nargs="?", metavar="MOUNT",
                   help="a tierfs mount point (default: every tierfs mount of this node)")
    g.add_argument("--by", choices=("tenant", "job", "uid", "pod", "namespace"),
                   default="tenant", help="rows per tenant (default), Slurm job, uid, "
                   "Kubernetes pod or namespace (pods named by tierfs-csi)")
    g.add_argument("--forecast", action="store_true",
                   help="also the capacity forecast and each tenant's working set")
    g.add_argument("--reader", metavar="NAME",
                   help="only this reader: job:ID, pod:UID or uid:N (the Slurm epilog)")
    g.add_argument("--json", action="store_true", help="one JSON object per mount")
    g.set_defaults(run=_usage)

    r = sub.add_parser("report", help="hot and cold data, hit ratios, stalls, metadata "
                                      "pressure; --html: a page with plots; --manifest: "
                                      "the files a job read")
    r.add_argument("mountpoint", nargs="?", metavar="MOUNT",
                   help="a tierfs mount point (default: every tierfs mount of this node)")
    r.add_argument("--json", action="store_true", help="one JSON object per mount")
    r.add_argument("--html", metavar="FILE", help="write one self-contained HTML page")
    r.add_argument("--top", type=_positive_int, default=20, metavar="N",
                   help="rows per list (default 20)")
    r.add_argument("--cold-after", metavar="DURATION",
                   help="a cached prefix not read for this long is cold (default 24h)")
    r.add_argument("--manifest", action="store_true",
                   help="print the files --job read, as `tierfs warm --manifest` reads them")
    r.add_argument("--job", metavar="ID", type=_job_id, help="with --manifest: the Slurm job")
    r.add_argument("--since", metavar="DURATION",
                   help="with --manifest: only files read in the last DURATION (e.g. 12h)")
    r.set_defaults(run=_report)
