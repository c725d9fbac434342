"""The control socket server of a running mount (placeholder)."""
