"""A throw-away real Ceph RGW (S3) on 127.0.0.1 for the tests.

Started with scripts/ceph-rgw/start.sh in a fresh temporary folder (about 1 s), stopped with
scripts/ceph-rgw/stop.sh, which kills exactly the PIDs that start.sh recorded. Three lines of
defence make sure no Ceph daemon outlives the test run:
  1. RGW.stop() from the fixture's finally (also runs on KeyboardInterrupt: pytest tears
     session fixtures down on Ctrl-C);
  2. an atexit hook (idempotent);
  3. a watchdog shell in its own session whose stdin is a pipe from this process: when this
     process dies in any way (SIGKILL included) the pipe reaches EOF and the watchdog runs
     stop.sh.

Used by tests/conftest.py (fixtures `rgw`, `bucket`) and tests/mounting.py.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
START_SH = REPO / "scripts" / "ceph-rgw" / "start.sh"
STOP_SH = REPO / "scripts" / "ceph-rgw" / "stop.sh"

# Runs in its own session so a Ctrl-C on the terminal does not hit it. Blocks on stdin (a pipe
# whose only writer is this Python process) until EOF, i.e. until RGW.stop() closes it or this
# process dies; then stops the cluster if it still exists.
_WATCHDOG = r"""
read -r _ || true
[ -f "$1/pids" ] && exec bash "$2" "$1"
exit 0
"""


class RGWError(RuntimeError):
    pass


def s3_env(rgw: "RGW", base: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of os.environ (or `base`) for a child process that talks to `rgw`.

    Every AWS_* variable of the caller is dropped (a developer's AWS_PROFILE, AWS_SESSION_TOKEN
    or AWS_ENDPOINT_URL must not leak in), then the test credentials are set, the instance
    metadata service is disabled and ~/.aws is hidden behind /dev/null.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID=rgw.access_key,
        AWS_SECRET_ACCESS_KEY=rgw.secret_key,
        AWS_DEFAULT_REGION=rgw.region,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )
    if rgw.ca_bundle:
        env["AWS_CA_BUNDLE"] = rgw.ca_bundle
    return env


class RGW:
    """A running throw-away Ceph RGW. Attributes: endpoint ("http://127.0.0.1:PORT"),
    access_key, secret_key, region, ca_bundle (None unless https), dir (the cluster's
    folder; daemon logs in dir/log, the HTTP access log in dir/log/client.rgw.gw.log)."""

    def __init__(self, dir: str, values: dict[str, str], watchdog: subprocess.Popen,
                 memstore_bytes: int):
        self.dir = dir
        self.memstore_bytes = memstore_bytes
        self.endpoint = values["S3_ENDPOINT"]
        self.access_key = values["S3_ACCESS_KEY"]
        self.secret_key = values["S3_SECRET_KEY"]
        self.region = values.get("S3_REGION", "us-east-1")
        self.ca_bundle = values.get("S3_CA_BUNDLE") or None
        self._watchdog = watchdog
        self._stopped = False
        self._clients: list = []
        self._health = None  # the client of answers()

    def __repr__(self) -> str:
        return f"RGW({self.endpoint}, dir={self.dir})"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        return s3_env(self, base)

    def client(self, **config):
        """A boto3 S3 client for this RGW: path-style addressing, checksums only when
        required (botocore >= 1.36 defaults break RGW), no ~/.aws or AWS_PROFILE influence.
        Extra keyword arguments are merged into the botocore Config. The client is closed
        by stop(); tests need not close it."""
        import boto3
        import botocore.session
        from botocore.config import Config
        from botocore.configprovider import ConstantProvider

        bs = botocore.session.Session()
        store = bs.get_component("config_store")
        for name, value in (("profile", None), ("config_file", os.devnull),
                            ("credentials_file", os.devnull)):
            store.set_config_provider(name, ConstantProvider(value))
        cfg = Config(
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"mode": "standard", "max_attempts": 3},
            connect_timeout=10,
            read_timeout=120,
        )
        if config:
            cfg = cfg.merge(Config(**config))
        client = boto3.session.Session(botocore_session=bs).client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            verify=self.ca_bundle if self.ca_bundle else None,
            config=cfg,
        )
        self._clients.append(client)
        return client

    def answers(self) -> bool:
        """Whether the RGW answers a request within seconds (a full memstore hangs them)."""
        if self._health is None:
            self._health = self.client(connect_timeout=5, read_timeout=20,
                                       retries={"mode": "standard", "max_attempts": 1})
        try:
            self._health.list_buckets()
        except Exception:  # noqa: BLE001 - any failure: it does not answer
            return False
        return True

    def restart(self) -> None:
        """Replace the cluster with a new, empty one (a new port): this object then stands
        for the new one."""
        capacity = self.memstore_bytes
        self.stop()
        self.__dict__.update(start_rgw(capacity, https=bool(self.ca_bundle)).__dict__)

    def memstore_used(self) -> tuple[int, int]:
        """(bytes used, capacity) of the OSD's memstore, from its admin socket."""
        r = subprocess.run(["ceph", "--admin-daemon", os.path.join(self.dir, "run", "osd.0.asok"),
                            "perf", "dump"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RGWError(f"ceph perf dump of osd.0 failed: {r.stderr.strip()}")
        osd = json.loads(r.stdout)["osd"]
        return osd["stat_bytes_used"], osd["stat_bytes"]

    def free_deleted(self) -> None:
        """Free the data of deleted objects now, not at the next garbage collection (RGW
        keeps it 60 s or more): memstore is RAM and every request hangs once it is full."""
        r = subprocess.run(["radosgw-admin", "-c", os.path.join(self.dir, "ceph.conf"), "gc",
                            "process", "--include-all"], capture_output=True, text=True,
                           timeout=120)
        if r.returncode != 0:
            raise RGWError(f"radosgw-admin gc process failed: {r.stderr.strip()}")

    def stop(self) -> None:
        """Stop the daemons (exactly the PIDs start.sh recorded) and delete the folder.
        Idempotent; never raises for an already stopped cluster."""
        if self._stopped:
            return
        self._stopped = True
        for c in self._clients:
            try:
                c.close()
            except Exception:
                pass
        self._clients.clear()
        # the watchdog first, so it cannot race the stop below
        _end(self._watchdog)
        if os.path.exists(os.path.join(self.dir, "pids")):
            r = subprocess.run(["bash", str(STOP_SH), self.dir], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise RGWError(f"stop.sh {self.dir} failed (rc={r.returncode}): {r.stderr.strip()}")


def _end(proc: subprocess.Popen) -> None:
    """SIGKILL a process this module started (by its PID, via the Popen handle), reap it,
    and only then close its stdin (closing first would let the watchdog run stop.sh)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass


def _read_env_file(path: str) -> dict[str, str]:
    values = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("export "):
                k, _, v = line[len("export "):].partition("=")
                values[k] = v
    return values


def start_rgw(memstore_bytes: int = 3 << 30, *, parent_dir: str | None = None,
              timeout: float = 180.0, https: bool = False) -> RGW:
    """Start a Ceph RGW in a new temporary folder and return it; the caller must call stop().

    memstore_bytes: the OSD's capacity. The data lives in RAM (about 2x the stored bytes) and
    every request HANGS once it is nearly full; deleted data is freed only ~1-2 min later.
    https: serve TLS with a self-signed certificate (RGW.ca_bundle is its path).
    """
    d = tempfile.mkdtemp(prefix="tierfs-rgw.", dir=parent_dir)
    env = dict(os.environ, MEMSTORE_BYTES=str(int(memstore_bytes)), RGW_HTTPS=str(int(https)))
    started = None
    watchdog = None
    keep_logs = False
    try:
        # own session: a terminal Ctrl-C reaches only this process, which then ends start.sh
        # (SIGTERM: its EXIT trap kills what it started) and runs stop.sh below
        proc = subprocess.Popen(["bash", str(START_SH), d], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.communicate(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
            proc.communicate()
            raise
        if proc.returncode != 0:
            keep_logs = True
            tail = "\n".join(err.strip().splitlines()[-15:])
            raise RGWError(f"scripts/ceph-rgw/start.sh failed (rc={proc.returncode}); "
                           f"logs in {d}/log\n{tail}")
        watchdog = subprocess.Popen(["bash", "-c", _WATCHDOG, "rgw-watchdog", d, str(STOP_SH)],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
        started = RGW(d, _read_env_file(os.path.join(d, "env")), watchdog,
                      int(memstore_bytes))
        atexit.register(started.stop)
        return started
    finally:
        if started is None:
            if watchdog is not None:
                _end(watchdog)
            # kill whatever start.sh got to start; after a failed start keep the folder
            # (logs) for a post-mortem, after an interruption remove it
            if os.path.exists(os.path.join(d, "pids")):
                subprocess.run(["bash", str(STOP_SH), d],
                               env=dict(os.environ, KEEP_DIR="1" if keep_logs else "0"),
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
            if not keep_logs:
                shutil.rmtree(d, ignore_errors=True)


def delete_bucket(client, bucket: str) -> None:
    """Delete every object (and unfinished multipart upload) of `bucket`, then the bucket.
    A bucket that no longer exists is not an error."""
    from botocore.exceptions import ClientError

    try:
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            for u in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=bucket)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") != "NoSuchBucket":
            raise
