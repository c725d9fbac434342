"""tierfs: a POSIX mount of an S3/Ceph bucket through a persistent NVMe chunk cache."""

__version__ = "0.1.0"
