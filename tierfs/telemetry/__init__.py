"""What the mount tells about its use: who reads (callers.py), usage per reader and tenant
(usage.py), heat per prefix (analytics.py), stalls on the store (stalls.py), cache
capacity over time (capacity.py) and the report built from them (report.py).
"""
