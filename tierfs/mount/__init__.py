"""The daemon: one process serving one mount.

daemon.py runs it (start, readiness, unmount, stop); core.py builds the parts every
mount has, the same for the daemon and the tests; fs.py is the thin FUSE adapter over
tierfs.files; control.py answers the control socket (warm.py, the report); peerserve.py
serves chunks to other nodes; metricsserve.py serves Prometheus; hardening.py,
sdnotify.py and mountinfo.py are its dealings with the system.
"""
