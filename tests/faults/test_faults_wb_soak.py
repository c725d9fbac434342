"""Write-back soak (issue 25): one writer in --writeback creates, overwrites, partially
writes, renames (over pending files too) and deletes a small set of names while the proxy
cycles faults: connections refused, hangs (dropped, never forwarded late), 503s, responses
reset or closed mid-body, and outages (the store unreachable). TIERFS_WB_SOAK_S seconds
(default 40); TIERFS_WB_SOAK_SEED picks the sequence.

The writer keeps a model of what each call returned (docs/semantics.md, "Writes"): a call
that succeeded is what the name holds now; one that failed leaves the name as it was, or
(a request the store may have carried out before its answer was lost) as the call would
have left it: both are allowed for that name, nothing else. At the end, once the store
answers and the daemon has settled (no upload pending, no multipart upload open):
- every name holds in the bucket what the model says, byte for byte, and the bucket holds
  nothing else (no stale leftovers: an old name of a renamed file, a deleted file); no
  multipart upload is left open and nothing unsaved is left in the cache dir;
- a fresh mount on a new cache dir shows exactly the bucket; the writer's mount shows the
  model's bytes (page cache dropped);
- the daemon's log shows no upload tierfs aborted while running it ("vanished", or an
  aborted upload's id used again) and no upload stuck on a copy of a missing range.

Faults whose effect no client could tell from a tierfs bug are kept out: body faults are
never applied to CompleteMultipartUpload answers (a Complete carried out whose answer was
lost makes the retry find the upload gone, which is "vanished" without a bug), and a held
request is dropped, never forwarded late.

Figures (operations, acknowledged files, faults injected) are printed (pytest -s) and
written to wb_soak.json in the test's tmp dir.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import random
import threading
import time

import pytest

import fkit
from fkit import KiB, MiB
from test_lost_checkpoints import bucket_objects, label, self_aborts, settle, status

SECONDS = float(os.environ.get("TIERFS_WB_SOAK_S", "40"))
SEED = int(os.environ.get("TIERFS_WB_SOAK_SEED", "25"))
pytestmark = pytest.mark.timeout(900 + 2 * SECONDS)  # a long soak gets longer
NAMES = [f"c{i:02}" for i in range(16)]
ABSENT = None
NO_COMPLETE = {"GET", "HEAD", "LIST", "PUT", "CreateMultipart", "UploadPart", "Abort",
               "Delete", "Copy", "HeadBucket", "ListUploads", "Other"}

# the fault phases the cycler goes through (each for PHASE_S, a healthy pause between):
# (name, [(kind, op kinds, probability, extra parameters)], or "down" for an outage
PHASE_S = 3.0
PHASES = [
    ("refuse", [("refuse", None, 0.3, {})]),
    ("503", [("503", None, 0.3, {"retry_after": 1})]),
    ("hang", [("hang", None, 0.15, {"seconds": 2.5, "then": "close"})]),
    ("reset", [("reset", NO_COMPLETE, 0.25, {})]),
    ("truncated", [("close", NO_COMPLETE, 0.25, {})]),
    ("down", "down"),
    ("mixed", [("refuse", None, 0.05, {}), ("503", None, 0.05, {}),
               ("reset", NO_COMPLETE, 0.05, {}), ("close", NO_COMPLETE, 0.05, {}),
               ("hang", None, 0.03, {"seconds": 2.5, "then": "close"})]),
]


class Model:
    """What each name may hold: a set of candidate contents (ABSENT: no such file). One
    candidate once every call on the name succeeded; more after a failed call."""

    def __init__(self) -> None:
        self.may: dict[str, list[bytes | None]] = {n: [ABSENT] for n in NAMES}

    def certain(self, name: str) -> bool:
        return len(self.may[name]) == 1

    def now(self, name: str) -> bytes | None:
        return self.may[name][0]

    def set(self, name: str, value: bytes | None) -> None:
        self.may[name] = [value]

    def either(self, name: str, *values: bytes | None) -> None:
        out: list[bytes | None] = []
        for v in [*self.may[name], *values]:
            if not any(v is w or (v is not None and w is not None and v == w) for w in out):
                out.append(v)
        self.may[name] = out


class Writer:
    def __init__(self, m, rnd: random.Random, deadline: float) -> None:
        self.m = m
        self.root = m.path / "ck"
        self.rnd = rnd
        self.deadline = deadline
        self.model = Model()
        self.ops: collections.Counter[str] = collections.Counter()
        self.n = 0

    def path(self, name: str):
        return self.root / name

    def note(self, op: str, err: OSError | None = None) -> None:
        self.ops[op if err is None else f"{op}:{errno.errorcode.get(err.errno, err.errno)}"] += 1

    def data(self, size: int) -> bytes:
        self.n += 1
        return fkit.payload(f"{SEED}.{self.n}", size)

    def size(self) -> int:
        r = self.rnd.random()
        if r < 0.12:
            return self.rnd.randrange(9 * MiB, 17 * MiB)  # multipart
        return self.rnd.choice([0, 4 * KiB, self.rnd.randrange(1, 1536 * KiB),
                                self.rnd.randrange(1, 3 * MiB)])

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            present = [n for n in NAMES if self.model.certain(n)
                       and self.model.now(n) is not ABSENT]
            r = self.rnd.random()
            if r < 0.35 or not present:
                self.write(self.rnd.choice(NAMES))
            elif r < 0.55:
                self.partial(self.rnd.choice(present))
            elif r < 0.85:
                self.rename(self.rnd.choice(present), self.rnd.choice(NAMES))
            else:
                self.delete(self.rnd.choice(present))

    def write(self, name: str) -> None:
        """create or overwrite (O_TRUNC), sometimes with fsync."""
        data = self.data(self.size())
        try:
            fd = os.open(self.path(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            self.note("write.open", e)
            return
        failed: OSError | None = None
        try:
            view, off = memoryview(data), 0
            while off < len(data):
                off += os.write(fd, view[off:off + MiB])
            if self.rnd.random() < 0.15:
                try:
                    os.fsync(fd)
                except OSError as e:
                    self.note("write.fsync", e)  # EIO: not in S3 yet; close journals it
        except OSError as e:
            failed = e
        self.closed("write", name, fd, failed, data)

    def partial(self, name: str) -> None:
        old = self.model.now(name)
        assert old is not None
        off = self.rnd.randrange(0, len(old) + 1) if old else 0
        patch = self.data(self.rnd.choice([1, 4 * KiB, 64 * KiB, 300 * KiB]))
        try:
            fd = os.open(self.path(name), os.O_WRONLY)
        except OSError as e:
            self.note("partial.open", e)
            return
        failed: OSError | None = None
        try:
            os.pwrite(fd, patch, off)
        except OSError as e:
            failed = e
        self.closed("partial", name, fd, failed, old[:off] + patch + old[off + len(patch):])

    def closed(self, op: str, name: str, fd: int, failed: OSError | None,
               new: bytes) -> None:
        """Close the file written; the model learns what the calls returned: `new` now,
        or (a call failed) what the name held, or `new`."""
        try:
            os.close(fd)
        except OSError as e:
            failed = failed or e
        self.note(op, failed)
        if failed is None:
            self.model.set(name, new)
        else:
            self.model.either(name, new)

    def rename(self, src: str, dst: str) -> None:
        if src == dst:
            return
        moving = self.model.now(src)
        over = not (self.model.certain(dst) and self.model.now(dst) is ABSENT)
        try:
            os.rename(self.path(src), self.path(dst))
        except OSError as e:
            # copy done and delete lost, or nothing done: both stay possible
            self.note("rename", e)
            self.model.either(dst, moving)
            self.model.either(src, ABSENT)
            return
        self.model.set(dst, moving)
        self.model.set(src, ABSENT)
        self.note("rename_over" if over else "rename")

    def delete(self, name: str) -> None:
        try:
            os.unlink(self.path(name))
        except OSError as e:
            self.note("delete", e)
            self.model.either(name, ABSENT)  # the DELETE may have been carried out
            return
        self.model.set(name, ABSENT)
        self.note("delete")


class Cycler:
    def __init__(self, proxy, rnd: random.Random, deadline: float) -> None:
        self.proxy = proxy
        self.rnd = rnd
        self.deadline = deadline
        self.phases: collections.Counter[str] = collections.Counter()
        self.outages = 0

    def run(self) -> None:
        order = list(PHASES)
        i = 0
        while time.monotonic() < self.deadline - PHASE_S:
            if i % len(order) == 0:
                self.rnd.shuffle(order)
            name, rules = order[i % len(order)]
            i += 1
            self.phases[name] += 1
            if rules == "down":
                self.proxy.down()
                self.outages += 1
                time.sleep(PHASE_S)
                self.proxy.up()
            else:
                added = [self.proxy.inject(kind, ops, probability=p,
                                           seed=self.rnd.randrange(1 << 30), **extra)
                         for kind, ops, p, extra in rules]
                time.sleep(PHASE_S)
                for rule in added:
                    self.proxy.remove(rule)  # held requests are dropped when their time is up
            time.sleep(self.rnd.uniform(0.5, 2.0))  # the store answers for a while
        time.sleep(3.0)  # the last held requests dropped: heal() must not forward them


def test_writeback_soak(mounts, s3, bucket, proxy, tmp_path):
    m = mounts.start("--writeback")
    os.mkdir(m.path / "ck")
    t0 = time.monotonic()
    deadline = t0 + SECONDS
    writer = Writer(m, random.Random(SEED), deadline)
    cycler = Cycler(proxy, random.Random(SEED + 1), deadline)
    failures: list[BaseException] = []

    def run(fn) -> threading.Thread:
        def body():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - a thread's exception fails the test
                failures.append(e)
        t = threading.Thread(target=body, name=fn.__qualname__, daemon=True)
        t.start()
        return t

    threads = [run(writer.run), run(cycler.run)]
    for t in threads:
        t.join(max(1.0, deadline + 120 - time.monotonic()))
    blocked = [t.name for t in threads if t.is_alive()]
    elapsed = time.monotonic() - t0
    injected = proxy.injected_by_kind()
    requests = proxy.requests_by_op()
    proxy.heal()
    assert not failures, f"a soak thread failed: {failures[0]!r}"
    assert not blocked, f"threads still blocked in a file system call: {blocked}"
    fkit.assert_alive(m, "after the soak")

    # the store answers: everything acknowledged reaches the bucket, nothing else stays
    settle(m, s3, bucket, proxy, timeout=180)
    try:  # nothing unsaved is left behind either (staging files of superseded versions)
        fkit.eventually(lambda: status(m)["dirty_bytes"] == 0, 15, alive_of=m)
    except AssertionError:
        pass  # reported below
    unsaved = status(m)["dirty_bytes"]
    model = writer.model
    have = {k.removeprefix("ck/"): v for k, v in bucket_objects(s3, bucket).items()}
    wrong, leftovers = [], []
    for k in sorted(have.keys() - set(NAMES)):
        leftovers.append(f"{k}: {fkit.short(have[k])}")
    for name in NAMES:
        got = have.get(name)
        if not any(got == v for v in model.may[name]):
            known = {f"candidate {i}": v for i, v in enumerate(model.may[name])
                     if v is not None}
            wrong.append(f"{name}: the bucket has {label(got, known)}, expected "
                         + " or ".join(fkit.short(v) for v in model.may[name]))
    acked = {n: model.now(n) for n in NAMES if model.certain(n)}
    view = []
    for name, want in acked.items():
        got, err = fkit.read_errno(writer.path(name))
        if got != want and not (want is ABSENT and err == errno.ENOENT):
            view.append(f"{name}: the mount reads {fkit.short(got)} (errno {err}), "
                        f"expected {fkit.short(want)}")
    bad_log = self_aborts(m.log_text())
    bad_log += [ln for ln in m.log_text().splitlines() if "InvalidRange" in ln][:10]
    st_uploads = fkit.open_uploads(s3, bucket)

    fresh = mounts.start(cache="cache-fresh", mnt="mnt-fresh")
    fresh_diff = []
    names = sorted(os.listdir(fresh.path / "ck"))
    if names != sorted(have):
        fresh_diff.append(f"a fresh mount lists {names}, the bucket {sorted(have)}")
    for name in names:
        got, err = fkit.read_errno(fresh.path / "ck" / name)
        if got != have.get(name):
            fresh_diff.append(f"{name}: a fresh mount reads {fkit.short(got)} (errno {err}), "
                              f"the bucket has {fkit.short(have.get(name))}")
    fresh.stop()

    ops = dict(writer.ops)
    figures = {
        "seconds": round(elapsed, 1),
        "seed": SEED,
        "operations": sum(n for k, n in ops.items()),
        "operations_by_outcome": ops,
        "acknowledged_files_at_end": sum(1 for v in acked.values() if v is not ABSENT),
        "acknowledged_bytes_at_end": sum(len(v) for v in acked.values() if v is not ABSENT),
        "names_left_uncertain": sum(1 for n in NAMES if not model.certain(n)),
        "faults_injected": injected,
        "faults_total": sum(injected.values()),
        "outages": cycler.outages,
        "fault_phases": dict(cycler.phases),
        "proxy_requests": requests,
        "wrong_in_bucket": len(wrong),
        "leftovers_in_bucket": len(leftovers),
        "self_aborted_or_stuck_uploads_in_log": len(bad_log),
        "open_multipart_uploads": len(st_uploads),
        "unsaved_bytes_left": unsaved,
    }
    out = tmp_path / "wb_soak.json"
    out.write_text(json.dumps(figures, indent=2))
    print(f"\nwrite-back soak figures ({out}):\n{json.dumps(figures, indent=2)}")

    assert not wrong, f"{len(wrong)} names differ in the bucket:\n" + "\n".join(wrong)
    assert not leftovers, "stale leftovers in the bucket:\n" + "\n".join(leftovers)
    assert not bad_log, ("tierfs aborted uploads it was running, or an upload got stuck:\n"
                         + "\n".join(bad_log[:20]))
    assert not view, "the writer's mount differs:\n" + "\n".join(view)
    assert not fresh_diff, "a fresh mount differs from the bucket:\n" + "\n".join(fresh_diff)
    assert st_uploads == [], f"multipart uploads left: {st_uploads}"
    assert unsaved == 0, f"{unsaved} unsaved bytes left once every upload was done"
    assert sum(injected.values()) > 0 and cycler.outages > 0
    assert ops.get("rename_over", 0) > 0 and ops.get("partial", 0) > 0
