"""Getting a chunk's bytes: fetch.py (one fetch per chunk, from a peer or the store),
prefetch.py (read-ahead of sequential readers), storecheck.py (a peer's bytes checked
against the store's own checksums).
"""
