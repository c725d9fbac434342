"""`tierfs slurm prolog|epilog`: warm and pin what a Slurm job declares (placeholder)."""

from __future__ import annotations

import argparse


def add_parsers(sub: argparse._SubParsersAction) -> None:
    pass
