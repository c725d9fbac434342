"""What the cache dir remembers: the LMDB index (meta.py: objects, chunks, and the tables
of pins, usage, analytics, capacity), the write-back journal (journal.py) and the file
attributes stored with each object (attrs.py).
"""
