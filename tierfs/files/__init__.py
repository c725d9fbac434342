"""The file system the mount serves, without FUSE: names and open files.

namespace.py owns names (keys as paths, listings, renames, the metadata TTL and
revalidation.py); fileio.py owns open files (reads through the tiers, writes through
tierfs.writeback); pagecache.py keeps the kernel's page cache to one version per read;
exclusive.py makes O_EXCL exclusive across nodes.
"""
