"""Warming the cache for a set of paths (placeholder)."""
