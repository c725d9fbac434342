"""Client of a running mount's control socket: status, warm, evict, unpin (placeholder)."""

from __future__ import annotations

import argparse


def add_parsers(sub: argparse._SubParsersAction) -> None:
    pass
