"""tierfs-csi: a Kubernetes CSI node plugin that mounts tierfs volumes into pods.

One tierfs daemon per volume and node, mounted at the volume's staging path with its
cache on the node's disk; pods get bind mounts of it. See docs/kubernetes.md.
"""

__version__ = "0.1.0"
DRIVER_NAME = "csi.tierfs.io"
