"""`tierfs-csi --endpoint unix:///csi/csi.sock --node-id NAME`: the node plugin's gRPC server.

Stopping the plugin (SIGTERM, or a crash) never touches the volumes: the tierfs daemons
run in their own sessions and keep serving the pods; the next plugin adopts them.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import stat
import sys
import threading
from concurrent import futures
from typing import NoReturn

from . import DRIVER_NAME


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _fail(f"{message} (see 'tierfs-csi --help')", 2)


def _fail(message: str, code: int = 1) -> NoReturn:
    sys.stderr.write(f"tierfs-csi: error: {message}\n")
    sys.exit(code)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tierfs-csi", description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", required=True,
                   help="unix:///PATH of the gRPC socket kubelet talks to")
    p.add_argument("--node-id", required=True, help="this node's name (NodeGetInfo)")
    p.add_argument("--state-dir", default="/var/lib/tierfs-csi",
                   help="host dir for the volumes' caches and records (default "
                        "/var/lib/tierfs-csi; put it on the node's NVMe)")
    p.add_argument("--kubelet-dir", default="/var/lib/kubelet",
                   help="kubelet's root directory: staging and target paths must lie under "
                        "it (default /var/lib/kubelet)")
    p.add_argument("--driver-name", default=DRIVER_NAME,
                   help=f"CSI driver name (default {DRIVER_NAME})")
    p.add_argument("--mount-timeout", type=float, default=120.0,
                   help="seconds a tierfs mount or unmount may take (default 120)")
    p.add_argument("--fs-timeout", type=float, default=10.0,
                   help="seconds a mount may take to answer statfs before a call on it "
                        "fails UNAVAILABLE (default 10)")
    p.add_argument("--systemd-scopes", action="store_true",
                   help="start each tierfs daemon in a transient systemd scope of the host, "
                        "so it outlives the plugin container (needs hostPID and the host's "
                        "/run/systemd)")
    p.add_argument("--accounting-file", metavar="FILE",
                   help="append one JSON line per pod that read through a volume, at its "
                        "NodeUnpublishVolume (what it read, from where, its stalls)")
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error"))
    return p


def socket_path(endpoint: str) -> str:
    """unix:///csi/csi.sock, unix:/csi/csi.sock or /csi/csi.sock -> /csi/csi.sock"""
    path = endpoint
    if endpoint.startswith("unix://"):
        path = endpoint[len("unix://"):]
    elif endpoint.startswith("unix:"):
        path = endpoint[len("unix:"):]
    elif "://" in endpoint:
        raise ValueError(f"--endpoint {endpoint!r}: only unix:///PATH sockets are served")
    if not path.startswith("/"):
        raise ValueError(f"--endpoint {endpoint!r}: expected unix:///ABSOLUTE/PATH")
    return path


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        path = socket_path(args.endpoint)
    except ValueError as exc:
        _fail(str(exc), 2)
    if not args.node_id.strip():
        _fail("--node-id must not be empty", 2)
    if not (0 < args.mount_timeout <= 86400 and 0 < args.fs_timeout <= 86400):
        _fail("--mount-timeout and --fs-timeout must be positive (and at most a day)", 2)
    if not os.path.isabs(args.kubelet_dir) or os.path.normpath(args.kubelet_dir) == "/":
        _fail(f"--kubelet-dir {args.kubelet_dir!r}: expected an absolute directory, not /", 2)
    if args.accounting_file is not None and not os.path.isabs(args.accounting_file):
        _fail(f"--accounting-file {args.accounting_file!r}: expected an absolute path", 2)
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(args, path)
    except OSError as exc:
        _fail(f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
    except KeyboardInterrupt:
        _fail("interrupted", 130)


def serve(args: argparse.Namespace, path: str) -> None:
    import grpc  # after argument checks: bad flags answer without loading gRPC

    from . import csi_pb2_grpc as pb_grpc
    from .paths import KubeletDir
    from .pods import Pods
    from .service import Controller, Identity, Node
    from .volumes import Volumes

    log = logging.getLogger("tierfs_csi")
    os.makedirs(args.state_dir, mode=0o700, exist_ok=True)
    # one plugin per state dir: a second one (an upgrade's new pod while the old one is
    # still stopping) waits instead of acting on the same volumes beside it
    lock_path = os.path.join(args.state_dir, "plugin.lock")
    lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)  # held for life
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.warning("another tierfs-csi uses %s; waiting for it to exit", args.state_dir)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
    volumes = Volumes(args.state_dir, mount_timeout=args.mount_timeout,
                      fs_timeout=args.fs_timeout, systemd_scopes=args.systemd_scopes)
    volumes.adopt_all()

    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)  # left by a previous plugin; kubelet reconnects to the new one
    except FileNotFoundError:
        pass
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_IdentityServicer_to_server(Identity(args.driver_name, volumes), server)
    pb_grpc.add_ControllerServicer_to_server(Controller(), server)
    pb_grpc.add_NodeServicer_to_server(
        Node(args.node_id, volumes, KubeletDir(args.kubelet_dir),
             Pods(volumes.records, args.accounting_file)), server)
    try:
        server.add_insecure_port(f"unix://{path}")
    except RuntimeError as exc:
        _fail(f"cannot listen on {path}: {exc}")
    os.chmod(path, 0o660)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    log.info("%s %s serving on unix://%s (node %s, state dir %s, kubelet dir %s)",
             args.driver_name, "tierfs-csi", path, args.node_id, args.state_dir,
             args.kubelet_dir)
    stop.wait()
    log.info("stopping; the tierfs daemons keep serving their volumes")
    server.stop(grace=10).wait()
