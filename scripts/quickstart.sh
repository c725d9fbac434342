#!/usr/bin/env bash
# scripts/quickstart.sh [DEMO OPTIONS...] - install everything (scripts/install.sh), then run
# the demo: a throw-away Ceph RGW with a sample dataset, mounted through tierfs, read cold,
# warm and after a restart (scripts/demo.py --help for options, e.g. --keep, --size-mib N).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

bash scripts/install.sh
exec .venv/bin/python scripts/demo.py "$@"
