"""What the cache dir remembers: the LMDB index (meta.py opens it and holds one table per
owner: inodes.py, chunks.py, pins.py, usage.py, analytics.py, capacity.py, over env.py's one
environment; probe.py checks and salvages it), the write-back journal (journal.py) and the
file attributes stored with each object (attrs.py).
"""
