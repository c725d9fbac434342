"""`tierfs warm` / status / evict / unpin on a real mount of the real Ceph RGW.

Backend request counts come from the daemon's own metrics: they prove what was fetched
when, e.g. that a job reading a warmed set sends zero GETs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import payload, put_many, read_uncached, sha
from mounting import Mount

MiB = 1 << 20
SMALL = ["--chunk-size", "1M", "--memory-cache-size", "0"]


def gets(m: Mount) -> float:
    return m.counter("tierfs_backend_requests_total", op="get")


def dataset(client, bucket: str) -> dict[str, bytes]:
    objects = {f"train/shard{i}.bin": payload(f"shard{i}", 2 * MiB + i * 1000) for i in range(4)}
    objects.update({f"train/labels/{i}.txt": f"label {i}\n".encode() for i in range(5)})
    objects.update({"ckpt/run42/model.pt": payload("model", 3 * MiB + 7),
                    "ckpt/run42/optim.pt": payload("optim", MiB),
                    "ckpt/run41/model.pt": payload("old", MiB), "other/x.bin": b"x" * 100})
    put_many(client, bucket, objects)
    return objects


def test_warmed_set_is_read_with_zero_gets_and_byte_exact(rgw, bucket, tierfs, mounts):
    objects = dataset(rgw.client(), bucket)
    with mounts.start(*SMALL) as m:
        r = tierfs("warm", m.path / "train", m.path / "ckpt/run42/*.pt", "--json")
        assert r.rc == 0, r.err
        s = r.summary
        want = [k for k in objects if k.startswith(("train/", "ckpt/run42/"))]
        assert s["files"] == len(want)
        assert s["bytes"] == sum(len(objects[k]) for k in want)
        assert s["bytes_fetched"] == s["bytes"] and s["bytes_cached_before"] == 0
        assert s["error_count"] == 0 and s["errors"] == []
        assert [e for e in r.events if e.get("event") == "progress"]
        before, heads = gets(m), m.counter("tierfs_backend_requests_total", op="head")
        for key in want:
            assert sha(read_uncached(m.path / key)) == sha(objects[key]), key
        assert gets(m) == before  # the job's reads: zero GETs
        assert m.counter("tierfs_backend_requests_total", op="head") == heads
        # what was not in the set was not fetched
        assert m.counter("tierfs_backend_bytes_total") == s["bytes"]


def test_check_reports_without_fetching_and_a_rerun_resumes(rgw, bucket, tierfs, mounts):
    objects = dataset(rgw.client(), bucket)
    train = sum(len(v) for k, v in objects.items() if k.startswith("train/"))
    ckpt = sum(len(v) for k, v in objects.items() if k.startswith("ckpt/"))
    with mounts.start(*SMALL) as m:
        r = tierfs("warm", "--check", m.path / "train", m.path / "ckpt", "--json")
        assert r.rc == 3, r.err  # not cached yet
        assert r.summary["bytes"] == train + ckpt and r.summary["bytes_cached_before"] == 0
        assert gets(m) == 0
        assert tierfs("warm", m.path / "train").rc == 0
        r = tierfs("warm", m.path / "train", m.path / "ckpt", "--json")
        assert r.rc == 0, r.err
        assert r.summary["bytes_cached_before"] == train  # resumed: only ckpt was fetched
        assert r.summary["bytes_fetched"] == ckpt
        g = gets(m)
        r = tierfs("warm", "--check", m.path / "train", m.path / "ckpt")
        assert r.rc == 0 and "100.0%" in r.out, r.out + r.err
        assert gets(m) == g


def test_interrupted_warm_resumes_without_fetching_twice(rgw, bucket, tierfs, mounts):
    # 64 KiB chunks, one GET at a time: 1536 GETs, a warm of several seconds
    objects = {f"big/{i}.bin": payload(f"b{i}", 4 * MiB) for i in range(24)}
    put_many(rgw.client(), bucket, objects)
    chunks = 24 * 4 * 16
    args = ["--chunk-size", "64K", "--memory-cache-size", "0"]
    with mounts.start(*args) as m:
        # SIGINT as at a terminal: a suite started in the background (`cmd &`) hands its
        # children SIGINT ignored, and Python then installs no KeyboardInterrupt for it
        client = subprocess.Popen([sys.executable, "-m", "tierfs", "warm", m.path / "big",
                                   "--json", "--concurrency", "1"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        # Ctrl-C once the daemon has fetched a few chunks (its own counter, not the client's
        # progress lines, which come every 0.5 s through a pipe)
        deadline = time.monotonic() + 60
        while gets(m) < 32 and client.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        client.send_signal(signal.SIGINT)
        client.communicate(timeout=30)
        assert client.returncode != 0
        # the daemon notices the client left and stops fetching
        deadline = time.monotonic() + 10
        while True:
            g = gets(m)
            time.sleep(0.5)
            if gets(m) == g or time.monotonic() > deadline:
                break
        assert 0 < g < chunks
        r = tierfs("warm", m.path / "big", "--json")
        assert r.rc == 0, r.err
        assert r.summary["bytes_cached_before"] > 0
        # every chunk fetched once, except at most the one in flight when it was stopped
        assert chunks <= gets(m) <= chunks + 1
        for key, data in objects.items():
            assert read_uncached(m.path / key) == data


def test_pinned_set_survives_a_scan_and_unpin_releases_it(rgw, bucket, tierfs, mounts):
    keep = {f"keep/{i}.bin": payload(f"k{i}", 2 * MiB) for i in range(3)}
    scan = {f"scan/{i:02}.bin": payload(f"s{i}", MiB) for i in range(40)}
    put_many(rgw.client(), bucket, {**keep, **scan})
    args = ["--cache-size", "16M", *SMALL]
    with mounts.start(*args) as m:
        assert tierfs("warm", m.path / "keep", "--job", "42").rc == 0
        st = tierfs("status", m.path, "--json")
        assert st.rc == 0, st.err
        (status,) = st.events
        assert status["pinned"]["bytes"] == 6 * MiB and status["pinned"]["files"] == 3
        assert [o["owner"] for o in status["pinned"]["owners"]] == ["job:42"]
        for key, data in scan.items():  # 2.5x the cache, read twice (hotter than the pin)
            assert read_uncached(m.path / key) == data
            assert read_uncached(m.path / key) == data
        g = gets(m)
        for key, data in keep.items():
            assert read_uncached(m.path / key) == data
        assert gets(m) == g  # pinned: nothing was evicted
        r = tierfs("unpin", "--job", "42")
        assert r.rc == 0 and "job:42" in r.out, r.out + r.err
        (status,) = tierfs("status", m.path, "--json").events
        assert status["pinned"] == {"files": 0, "bytes": 0, "owners": []}
        # each scan file read 4 times: the 4th read's remembered 3 are more than twice the
        # unpinned set's 1 (its warm), so the admission policy lets it in over the set
        for key, data in scan.items():
            for _ in range(4):
                assert read_uncached(m.path / key) == data
        assert tierfs("warm", "--check", m.path / "keep").rc == 3  # evictable again, evicted


def test_set_larger_than_the_cache_is_refused_up_front(rgw, bucket, tierfs, mounts):
    put_many(rgw.client(), bucket, {f"d/{i}.bin": payload(f"d{i}", 4 * MiB) for i in range(6)})
    args = ["--cache-size", "16M", *SMALL]
    with mounts.start(*args) as m:
        r = tierfs("warm", m.path / "d")
        assert r.rc == 1
        lines = r.err.strip().splitlines()
        assert len(lines) == 1 and "24.0 MiB" in lines[0] and "can hold" in lines[0], r.err
        assert "Traceback" not in r.err
        assert gets(m) == 0
        # pins of others count against what a new set may take
        assert tierfs("warm", m.path / "d/0.bin", m.path / "d/1.bin", "--pin").rc == 0
        r = tierfs("warm", m.path / "d/2.bin", m.path / "d/3.bin")
        assert r.rc == 1 and "pinned by others" in r.err


def test_evict_drops_unpinned_files_and_keeps_pinned_ones(rgw, bucket, tierfs, mounts):
    objects = dataset(rgw.client(), bucket)
    with mounts.start(*SMALL) as m:
        assert tierfs("warm", m.path / "train").rc == 0
        assert tierfs("warm", m.path / "ckpt/run42", "--pin").rc == 0
        r = tierfs("evict", m.path / "train", m.path / "ckpt", "--json")
        assert r.rc == 0, r.err
        (res,) = r.events
        train = sum(len(v) for k, v in objects.items() if k.startswith("train/"))
        assert res["bytes_evicted"] == train and res["pinned_kept"] == 2
        assert tierfs("warm", "--check", m.path / "train").rc == 3
        assert tierfs("warm", "--check", m.path / "ckpt/run42").rc == 0
        g = gets(m)
        assert read_uncached(m.path / "train/shard0.bin") == objects["train/shard0.bin"]
        assert gets(m) > g  # evicted data is fetched again, correctly
        assert tierfs("unpin", m.path / "ckpt/run42/model.pt").rc == 0
        (status,) = tierfs("status", m.path, "--json").events
        assert status["pinned"]["files"] == 1


def test_pins_and_warmed_data_survive_a_restart(rgw, bucket, tierfs, mounts):
    objects = dataset(rgw.client(), bucket)
    with mounts.start(*SMALL) as m:
        assert tierfs("warm", m.path / "ckpt/run42", "--job", "9", "--pin-ttl", "2h").rc == 0
    with mounts.start(*SMALL) as m:
        (status,) = tierfs("status", m.path, "--json").events
        (owner,) = status["pinned"]["owners"]
        assert owner["owner"] == "job:9" and owner["files"] == 2
        assert 2 * 3600 - 120 < owner["expires"] - time.time() <= 2 * 3600
        for key in ("ckpt/run42/model.pt", "ckpt/run42/optim.pt"):
            assert read_uncached(m.path / key) == objects[key]
        assert gets(m) == 0


def test_many_small_files_list_once_and_never_head(rgw, bucket, tierfs, mounts):
    objects = {f"many/{i // 500}/{i:05}.txt": f"sample {i}\n".encode() * 10 for i in range(1500)}
    put_many(rgw.client(), bucket, objects, threads=32)
    with mounts.start(*SMALL) as m:
        lists = m.counter("tierfs_backend_requests_total", op="list")
        r = tierfs("warm", m.path / "many", "--json")
        assert r.rc == 0, r.err
        assert r.summary["files"] == 1500
        assert gets(m) == 1500
        assert m.counter("tierfs_backend_requests_total", op="head") == 0
        # the root, "many/" and its 3 directories: one LIST page each (plus a lookup's two)
        assert m.counter("tierfs_backend_requests_total", op="list") - lists <= 8
        for key in list(objects)[::97]:
            assert (m.path / key).read_bytes() == objects[key]
        assert gets(m) == 1500


def test_bad_input_gets_one_line_and_nonzero_exit(rgw, bucket, tmp_path, tierfs, mounts):
    dataset(rgw.client(), bucket)
    manifest = tmp_path / "manifest.txt"
    with mounts.start(*SMALL) as m:
        manifest.write_text(f"# the job's data\n{m.path}/train/labels\n\n{m.path}/nope/*\n")
        r = tierfs("warm", "--manifest", manifest, m.path / "missing.bin")
        assert r.rc == 1
        assert "labels" not in r.err  # the good lines were warmed
        assert sorted(r.err.strip().splitlines()) == [
            "tierfs: error: missing.bin: no such file or directory",
            "tierfs: error: nope/*: matches nothing"]
        assert "5 files" in r.out
        # a path outside every mount is one error; the rest is still warmed
        r = tierfs("warm", m.path / "ckpt/run42", tmp_path / "elsewhere")
        assert r.rc == 1 and "2 files" in r.out, r.out + r.err
        assert r.err.strip().splitlines() == [
            f"tierfs: error: {tmp_path / 'elsewhere'} is not under a tierfs mount"]
        for args, msg in [
            (("warm", tmp_path), "is not under a tierfs mount"),
            (("warm", "--manifest", tmp_path / "none.txt"), "cannot read manifest"),
            (("warm", m.path / "train", "--pin-ttl", "soon"), "invalid pin-ttl"),
            (("warm", m.path / "../x"), "not under a tierfs mount"),
            (("warm",), "nothing to warm"),
            (("unpin",), "give PATHs to unpin"),
            (("status", m.path / "train"), "not its root"),
        ]:
            r = tierfs(*args)
            assert r.rc in (1, 2) and msg in r.err, (args, r.err)
            assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err, r.err


def test_control_socket_is_private_and_speaks_a_versioned_protocol(rgw, bucket, mounts):
    import json
    import socket

    from tierfs.cli.ctl import ControlError, request, tierfs_mounts

    with mounts.start(*SMALL) as m:
        (mount,) = [t for t in tierfs_mounts() if t.mountpoint == m.mountpoint]
        st = os.stat(mount.socket)
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == 0
        assert os.stat(os.path.dirname(mount.socket)).st_mode & 0o077 == 0

        def ask(raw: bytes) -> dict:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(mount.socket)
                s.sendall(raw)
                return json.loads(s.makefile().readline())

        assert "protocol version 2" in ask(b'{"v": 2, "op": "status"}\n')["error"]
        assert "not JSON" in ask(b"hello\n")["error"]
        assert "unknown request" in ask(b'{"v": 1, "op": "format"}\n')["error"]
        assert "paths must be" in ask(b'{"v": 1, "op": "warm", "paths": "x"}\n')["error"]
        assert ask(b'{"v": 1, "op": "status"}\n')["ok"]
        # another user cannot reach it (a forked child that drops to nobody)
        pid = os.fork()
        if pid == 0:
            try:
                os.setgid(65534)
                os.setuid(65534)
                request(mount, "status")
                os._exit(1)
            except ControlError as exc:
                os._exit(0 if "permission denied" in str(exc) else 2)
            except BaseException:
                os._exit(3)
        assert os.waitpid(pid, 0)[1] == 0


def test_reads_during_a_warm_get_exact_bytes_and_no_chunk_is_fetched_twice(rgw, bucket,
                                                                           mounts):
    import threading

    objects = {f"mix/{i}.bin": payload(f"m{i}", 2 * MiB + 4321 * i) for i in range(6)}
    put_many(rgw.client(), bucket, objects)
    chunks = sum(-(-len(v) // (64 << 10)) for v in objects.values())
    args = ["--chunk-size", "64K", "--memory-cache-size", "0"]
    with mounts.start(*args) as m:
        warm = subprocess.Popen([sys.executable, "-m", "tierfs", "warm", m.path / "mix",
                                 "--concurrency", "4"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        errors: list[str] = []

        def reader(keys: list[str]) -> None:
            for key in keys:
                if read_uncached(m.path / key) != objects[key]:
                    errors.append(key)

        keys = list(objects)
        threads = [threading.Thread(target=reader, args=(keys[i::2][::-1],)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out, err = warm.communicate(timeout=120)
        assert warm.returncode == 0, err
        assert errors == []
        assert gets(m) == chunks  # readers and the warm shared every fetch
        for key, data in objects.items():  # and what is cached is right
            assert read_uncached(m.path / key) == data
        assert gets(m) == chunks
