"""kill -9 of the daemon at random moments while files are written and uploaded, then a
remount on the same cache dir. Repeated TRIALS times per mode, one bucket per mode.

Each trial: a writer process (wkit.py crash-writer) writes a 10-20 MiB file, three small
files and a new version of shared/ckpt.bin, fsync on some (on the big file sometimes
half-way, then it goes on writing); it logs every fsync() and close() that returned. After a random 0-1.5 s the daemon is SIGKILLed, then mounted again.

Checked (results collected once per mode by the module fixture, asserted by the tests):
  lost     an acknowledged file (fsync or close returned; both modes) is not in the bucket
           with that content or a later complete version - in default mode right after the
           kill, in write-back mode after the remount's recovery (polled up to 30 s)
  partial  an object under a final name whose bytes are not exactly one of the complete
           contents ever written to that name (sampled continuously during every trial
           and after every recovery)
  unread   after the remount, the mount does not show an acknowledged file's content
Run with -s to see the per-trial table and totals; TIERFS_CRASH_TRIALS=N for more trials.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest
import wkit
from mounting import Mounts
from rgw import delete_bucket

TRIALS = int(os.environ.get("TIERFS_CRASH_TRIALS", "10"))  # per mode
MAX_DELAY = 1.5
WKIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wkit.py")


@dataclass
class Results:
    mode: str
    trials: list[dict] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    other_keys: set[str] = field(default_factory=set)
    error: str | None = None
    checked_acks: int = 0
    leftover_uploads: list = field(default_factory=list)

    def summary(self) -> str:
        rows = [f"crash[{self.mode}]: {len(self.trials)} trials"]
        for t in self.trials:
            rows.append(f"  trial {t['trial']:2}: kill at {t['delay']:.2f}s  "
                        f"acked {t['acked']}/{t['planned']} files  "
                        f"{'writer finished' if t['done'] else 'writer cut: ' + t['cut']}")
        finished = sum(t["done"] for t in self.trials)
        rows.append(f"  writer finished before the kill in {finished}, cut in "
                    f"{len(self.trials) - finished}; acknowledged files checked: "
                    f"{self.checked_acks}; lost {len(self.lost)}, partial {len(self.partial)}, "
                    f"unreadable {len(self.unread)}")
        if self.other_keys:
            rows.append(f"  other keys seen (not final names): {sorted(self.other_keys)[:20]}")
        if self.error:
            rows.append(f"  ABORTED: {self.error}")
        return "\n".join(rows)


class Sampler(threading.Thread):
    """Polls the bucket while a trial runs: every object under a final name must be one of
    the complete contents written to it."""

    def __init__(self, client, bucket: str, history: dict[str, list[str]], out: Results):
        super().__init__(daemon=True)
        self.client, self.bucket, self.history, self.out = client, bucket, history, out
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                check_bucket(self.client, self.bucket, self.history, self.out, "during writes")
            except Exception as e:  # a transient S3 error must not end the sampling
                print(f"sampler: {e!r}")
            self.stop_event.wait(0.05)


def check_bucket(client, bucket, history, out: Results, when: str) -> None:
    for key in wkit.s3_keys(client, bucket):
        if key.endswith("/"):
            continue
        if key not in history:
            out.other_keys.add(key)
            continue
        data = wkit.s3_get(client, bucket, key)
        if data is None:
            continue  # deleted between LIST and GET
        if wkit.sha(data) not in history[key]:
            msg = f"{key} {wkit.short(data)} ({when}) is none of the {len(history[key])} written"
            if msg not in out.partial:
                out.partial.append(msg)


def version_at_least(client, bucket, key: str, history: dict[str, list[str]],
                     min_index: int) -> str | None:
    """None if the bucket holds version >= min_index of `key`; else what is wrong."""
    data = wkit.s3_get(client, bucket, key)
    if data is None:
        return f"{key}: absent"
    digest = wkit.sha(data)
    if digest not in history[key]:
        return f"{key}: {wkit.short(data)} is not a written version"
    idx = history[key].index(digest)
    if idx < min_index:
        return f"{key}: holds version {idx}, version {min_index} was acknowledged"
    return None


def run_trials(mode: str, mounter: Mounts, client, bucket: str, tmp) -> Results:
    out = Results(mode)
    rnd = random.Random(f"crash-{mode}")
    history: dict[str, list[str]] = {}
    acked: dict[str, int] = {}  # key -> index in history of the newest acknowledged version
    m = mounter.start(*wkit.MODES[mode])
    for trial in range(TRIALS):
        plan = wkit.crash_plan(rnd, trial)
        for f in plan:
            history.setdefault(f["key"], []).extend(map(wkit.sha, wkit.crash_versions(f)))
        plan_path, acklog = tmp / f"plan{trial}.json", tmp / f"ack{trial}.log"
        root_fd = os.open(m.path, os.O_RDONLY | os.O_DIRECTORY)
        plan_path.write_text(json.dumps({"root_fd": root_fd, "plan": plan}))
        sampler = Sampler(client, bucket, history, out)
        sampler.start()
        delay = rnd.uniform(0, MAX_DELAY)
        try:
            writer = subprocess.Popen([sys.executable, WKIT, "crash-writer", str(plan_path),
                                       str(acklog)], stdin=subprocess.DEVNULL,
                                      pass_fds=(root_fd,))
        finally:
            os.close(root_fd)
        try:
            time.sleep(delay)
            m.kill9()
            try:
                writer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                writer.kill()
                writer.wait()
                out.error = f"trial {trial}: the writer hung after the daemon was killed"
                return out
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
        lines = wkit.read_acklog(str(acklog))
        this_trial: dict[str, int] = {}
        for words in lines:
            if words[0] in ("FSYNC", "CLOSE"):
                key, digest = words[1], words[2]
                idx = history[key].index(digest)  # seeds differ per trial: unique
                acked[key] = max(acked.get(key, -1), idx)
                this_trial[key] = idx
        errs = [w for w in lines if w[0] == "ERR"]
        out.trials.append({
            "trial": trial, "delay": delay, "planned": len(plan),
            "acked": len({k for k in this_trial}), "done": ["DONE"] in lines,
            "cut": f"{errs[0][1]} errno {errs[0][2]}" if errs else "before its first ack",
        })
        if mode == "default":
            # close()/fsync() returned => durable in S3, before any recovery
            for key, idx in acked.items():
                problem = version_at_least(client, bucket, key, history, idx)
                if problem:
                    out.lost.append(f"trial {trial}, right after kill -9: {problem}")
        try:
            m = mounter.again(m)
        except Exception as e:
            out.error = f"trial {trial}: remount failed: {e}"
            sampler.stop_event.set()
            sampler.join()
            return out

        def missing() -> dict[str, str]:
            found = {k: version_at_least(client, bucket, k, history, i) for k, i in acked.items()}
            return {k: p for k, p in found.items() if p}

        try:
            wkit.eventually(lambda: not missing(), wkit.BUCKET_LAG)
        except AssertionError:
            for key, problem in missing().items():
                out.lost.append(f"trial {trial}, {wkit.BUCKET_LAG:.0f}s after the remount: "
                                f"{problem}")
                del acked[key]  # reported once
        sampler.stop_event.set()
        sampler.join()
        check_bucket(client, bucket, history, out, f"after recovery of trial {trial}")
        out.checked_acks += len(this_trial)
        for key, idx in this_trial.items():
            try:
                data = (m.path / key).read_bytes()
            except OSError as e:
                try:
                    size = os.stat(m.path / key).st_size
                except OSError as e2:
                    size = repr(e2)
                in_s3 = wkit.s3_get(client, bucket, key)
                head = client.head_object(Bucket=bucket, Key=key)["ETag"] if in_s3 else None
                said = [ln for ln in m.log_text().splitlines()[-400:] if key in ln][-5:]
                out.unread.append(f"trial {trial}: {key}: {e} (stat size {size}; bucket has "
                                  f"{wkit.short(in_s3)} ETag {head}, acked version {idx} of "
                                  f"{len(history[key])}; log: {said})")
                continue
            digest = wkit.sha(data)
            if digest not in history[key][idx:]:
                out.unread.append(f"trial {trial}: {key} reads {wkit.short(data)} through the "
                                  f"remounted mount")
        # keep the RGW's memstore small: forget the objects of two trials ago
        old = f"t{trial - 2:02}/"
        for key in [k for k in acked if k.startswith(old)]:
            del acked[key]
        for key in wkit.s3_keys(client, bucket, old):
            client.delete_object(Bucket=bucket, Key=key)
    # the last word: everything settled, nothing partial anywhere
    time.sleep(2)
    check_bucket(client, bucket, history, out, "at the end")
    # the last remount has aborted the multipart uploads the kills interrupted
    out.leftover_uploads = wkit.open_uploads(client, bucket)
    return out


@pytest.fixture(scope="module", params=list(wkit.MODES))
def crash_results(request, rgw, tmp_path_factory):
    mode = request.param
    client = rgw.client()
    bucket = f"crash-{mode}-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    tmp = tmp_path_factory.mktemp(f"crash-{mode}")
    mounter = Mounts(rgw, bucket, tmp)
    try:
        try:
            out = run_trials(mode, mounter, client, bucket, tmp)
        except Exception as e:
            out = Results(mode, error=f"{type(e).__name__}: {e}")
        print("\n" + out.summary())
        if out.error or out.lost or out.partial or out.unread:
            print(mounter.report(60))
        yield out
    finally:
        mounter.close()
        delete_bucket(client, bucket)


def _ran(r: Results) -> None:
    assert r.error is None, r.summary()
    assert len(r.trials) == TRIALS


def test_every_acknowledged_file_is_in_the_bucket_after_kill9(crash_results):
    _ran(crash_results)
    assert crash_results.lost == [], "\n".join(crash_results.lost)


def test_no_partial_object_ever_appears_under_a_final_name(crash_results):
    _ran(crash_results)
    assert crash_results.partial == [], "\n".join(crash_results.partial)


def test_acknowledged_files_read_back_through_the_remounted_mount(crash_results):
    _ran(crash_results)
    assert crash_results.unread == [], "\n".join(crash_results.unread)


def test_multipart_uploads_cut_by_a_kill_are_aborted_by_the_next_mount(crash_results):
    _ran(crash_results)
    assert crash_results.leftover_uploads == []
